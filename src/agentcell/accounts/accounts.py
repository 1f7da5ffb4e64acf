"""Persistent agent accounts: create, share folders with, check, and delete a UNIX user per agent.

An agent NAME is a user NAME whose primary group is ``agentcell-NAME``; the human who made it is a
member of that group. Its home ``/home/NAME`` is ``2770 NAME:agentcell-NAME`` with a default ACL
giving the group rwx, so files either side creates there stay editable by both. Folders are shared
with the group through ACLs (:mod:`.acl`). The account has no password and ``nologin`` as its shell:
agentcell runs it only inside a cell, and there is no setuid helper — privilege comes from root.

Every step is recorded first (:mod:`.registry`) and every change is a printed command
(:mod:`.commands`); ``delete`` works from any partial state and says what it could not remove.
"""
from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
import sys
import time

from ..errors import AgentcellError
from ..policy import resolve as rs
from . import acl
from .commands import Commands, need_root
from .registry import GROUP_PREFIX, AgentRecord, Registry, Share, check_share, open_registry

MAX_NAME = 32 - len(GROUP_PREFIX)  # the group name agentcell-NAME must fit useradd's 32 characters
NOLOGIN = "/usr/sbin/nologin"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-")


class AccountError(AgentcellError):
    pass


def check_name(name: str) -> str:
    if not (name and len(name) <= MAX_NAME and set(name) <= _NAME_CHARS and (name[0].isalpha() or name[0] == "_")):
        raise AccountError("NAME", f"'{name}' is not a valid agent name",
                           f"lowercase letters, digits, '-' and '_', starting with a letter, at most {MAX_NAME} "
                           "characters")
    return name


def _user(name: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def _group(name: str) -> grp.struct_group | None:
    try:
        return grp.getgrnam(name)
    except KeyError:
        return None


def resolve_human(human: str | None) -> str:
    """The human the agent works for: --human, else the account that ran sudo."""
    name = human or os.environ.get("SUDO_USER", "")
    if not name:
        raise AccountError("--human", "no human to share the agent's files with",
                           "run through sudo, or name your account with --human USER")
    pw = _user(name)
    if pw is None:
        raise AccountError("--human", f"no user named '{name}'", "name an existing account")
    if pw.pw_uid == 0:
        raise AccountError("--human", "root cannot be the agent's human (it reads everything anyway)",
                           "name the account you work as with --human USER")
    return name


def processes(uid: int) -> list[int]:
    """PIDs of every live process with ``uid`` as its real, effective, saved or filesystem uid (a
    zombie is dead: only its parent can reap it)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if line.startswith(("State:", "Uid:")))
        except (OSError, ValueError):
            continue
        if str(uid) in fields.get("Uid", "").split() and not fields.get("State", "").strip().startswith("Z"):
            out.append(int(entry))
    return out


def in_a_cell(pid: int) -> bool:
    """Whether the process lives in an agentcell cell's cgroup."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return "/agentcell/" in f.read()
    except OSError:
        return False


def kill_all(cmds: Commands, uid: int, gid: int) -> list[int]:
    """Kill every process of ``uid`` (cells included: they run as it). ``kill -1`` sent *as* the
    account reaches exactly its processes, new ones too, with no PID-reuse race; repeated until none is
    left. Returns the PIDs still there (an uninterruptible sleep, say)."""
    argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", "kill", "-KILL", "--", "-1"]
    if cmds.dry_run:
        cmds.run(argv, check=False)
        return []
    for _ in range(20):
        if not processes(uid):
            return []
        cmds.run(argv, check=False, step="kill")
        time.sleep(0.05)
    return processes(uid)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _save(reg: Registry, cmds: Commands, what: str) -> None:
    cmds.note(f"{what} in {reg.path}")
    if not cmds.dry_run:
        reg.save()


# ---- new ----------------------------------------------------------------------------------------

def new(name: str, *, human: str | None, cmds: Commands) -> AgentRecord:
    need_root("agent new")
    check_name(name)
    human = resolve_human(human)
    group, home = GROUP_PREFIX + name, f"/home/{name}"
    with open_registry(write=True) as reg:
        if name in reg.agents:
            raise AccountError("NAME", f"agent '{name}' already exists (state {reg.agents[name].state})",
                               f"pick another name, or 'agentcell agent delete {name}' first")
        if _user(name) is not None:
            raise AccountError("NAME", f"a user named '{name}' exists and is not an agentcell agent",
                               "pick another name; agentcell never takes over an account")
        if _group(group) is not None:
            raise AccountError("NAME", f"a group named '{group}' exists and is not an agentcell agent's",
                               "pick another name")
        if os.path.lexists(home):
            raise AccountError("NAME", f"{home} already exists", "pick another name, or move it away")
        rec = AgentRecord(name, state="creating", home=home, human=human, created=_now())
        reg.agents[name] = rec
        _save(reg, cmds, f"record agent {name} (creating)")
        cmds.run(["groupadd", group], step="groupadd")
        cmds.run(["useradd", "--gid", group, "--no-user-group", "--home-dir", home, "--no-create-home",
                  "--shell", NOLOGIN, "--comment", f"agentcell agent {name}", name], step="useradd")
        cmds.run(["install", "-d", "-m", "2770", "-o", name, "-g", group, home], step="home")
        cmds.run(["setfacl", "-m", f"d:g:{group}:rwx", home], step="home ACL")
        cmds.run(["gpasswd", "--add", human, group], step="human")
        if not cmds.dry_run:
            pw = pwd.getpwnam(name)
            rec.uid, rec.gid = pw.pw_uid, pw.pw_gid
        rec.state = "ready"
        _save(reg, cmds, f"record agent {name} (ready)")
    return rec


# ---- shares -------------------------------------------------------------------------------------

def _idle(rec: AgentRecord, what: str) -> None:
    """ACLs are applied by walking the tree: the agent must not be changing it meanwhile."""
    running = processes(rec.uid) if rec.uid >= 0 else []
    if running:
        raise AccountError(what, f"agent '{rec.name}' has {len(running)} processes running",
                           "wait for its cells to end (or 'agentcell agent delete') before changing shares")


def _ready(reg: Registry, name: str) -> AgentRecord:
    rec = reg.get(name)
    if rec.state != "ready":
        raise AccountError("agent", f"agent '{name}' is {rec.state}, not ready",
                           f"'agentcell agent delete {name} --yes' removes what was made")
    return rec


def mount_add(name: str, source: str, mode: str, *, cmds: Commands) -> Share:
    need_root("agent mount add")
    with open_registry(write=True) as reg:
        rec = _ready(reg, name)
        real = rs.resolve_path(source, field="SOURCE", writable=mode == "rw")
        if real == rec.home or real.startswith(rec.home + "/"):
            raise AccountError("SOURCE", f"{real} is in the agent's own home", "share a folder of yours")
        for s in rec.shares:
            if real == s.source or real.startswith(s.source + "/") or s.source.startswith(real + "/"):
                raise AccountError("SOURCE", f"{real} overlaps the share {s.source} ({s.mode})",
                                   f"remove it first: agentcell agent mount remove {s.source} --agent {name}")
        _idle(rec, "SOURCE")
        st = os.lstat(real)
        share = Share(real, mode, st.st_dev, st.st_ino, acl.prior_acl(real))
        acl.grant(cmds, rec.group, real, mode)
        rec.shares.append(share)
        _save(reg, cmds, f"record share {real} ({mode}) of agent {name}")
    return share


def _find_share(rec: AgentRecord, path: str) -> Share:
    candidates = {path, os.path.abspath(os.path.expanduser(path))}
    try:
        candidates.add(os.path.realpath(path))
    except OSError:
        pass
    for s in rec.shares:
        if s.source in candidates:
            return s
    raise AccountError("SOURCE", f"agent '{rec.name}' has no share {path}",
                       f"see 'agentcell agent mount list --agent {rec.name}'")


def _unshare(cmds: Commands, rec: AgentRecord, share: Share) -> list[str]:
    """Revoke one share; what is left of it (empty when clean)."""
    acl.revoke(cmds, rec.gid, share.source, share.prior_acl)
    if cmds.dry_run:
        return []
    left = acl.residue(rec.gid, share.source)
    return [f"ACL entries for {rec.group} remain on {p}" for p in left[:5]] + (
        [f"... and {len(left) - 5} more"] if len(left) > 5 else [])


def mount_remove(name: str, path: str, *, cmds: Commands) -> Share:
    need_root("agent mount remove")
    with open_registry(write=True) as reg:
        rec = reg.get(name)
        share = _find_share(rec, path)
        _idle(rec, "SOURCE")
        left = _unshare(cmds, rec, share)
        if left:
            raise AccountError("SOURCE", "; ".join(left), "remove them with setfacl -x, then run this again")
        rec.shares.remove(share)
        _save(reg, cmds, f"forget share {share.source} of agent {name}")
    return share


# ---- health -------------------------------------------------------------------------------------

def health(rec: AgentRecord) -> list[tuple[str, bool, str]]:
    """(check, ok, detail) for everything an agent needs; all ok means healthy."""
    out: list[tuple[str, bool, str]] = []

    def check(what: str, ok: bool, detail: str = "") -> None:
        out.append((what, ok, detail))

    check("record", rec.state == "ready", f"state {rec.state}")
    pw = _user(rec.name)
    check("user", pw is not None and pw.pw_uid == rec.uid and pw.pw_gid == rec.gid,
          "missing" if pw is None else f"uid {pw.pw_uid} gid {pw.pw_gid} (recorded {rec.uid}/{rec.gid})")
    if pw is not None:
        check("no login", pw.pw_shell == NOLOGIN, f"shell {pw.pw_shell}")
    gr = _group(rec.group)
    check("group", gr is not None and gr.gr_gid == rec.gid, "missing" if gr is None else f"gid {gr.gr_gid}")
    check("human in group", gr is not None and rec.human in gr.gr_mem, f"{rec.human} in {rec.group}")
    try:
        st = os.lstat(rec.home)
        mode = stat.S_IMODE(st.st_mode)
        home_ok = stat.S_ISDIR(st.st_mode) and st.st_uid == rec.uid and st.st_gid == rec.gid and mode == 0o2770
        check("home", home_ok, f"{rec.home} {oct(mode)} uid {st.st_uid} gid {st.st_gid} (want 02770 "
              f"{rec.uid}:{rec.gid}, a directory)")
        check("home default ACL", rec.gid in {i for t, p, i in acl.entries(rec.home, acl.DEFAULT) or ()
                                              if t == acl.TAG_GROUP and p == 7}, f"default:group:{rec.group}:rwx")
    except FileNotFoundError:
        check("home", False, f"{rec.home} is missing")
    tools = [t for t in ("setfacl", "getfacl", "setpriv", "useradd", "userdel") if shutil.which(t) is None]
    check("tools", not tools, "missing: " + ", ".join(tools) if tools else "setfacl, setpriv, useradd present")
    for s in rec.shares:
        why = check_share(rec, s)
        if not why and rec.gid not in acl.named_ids(s.source):
            why = f"{s.source} no longer has the ACL entry for {rec.group}"
        check(f"share {s.source} ({s.mode})", not why, why or "valid")
    if rec.uid >= 0:
        stray = [p for p in processes(rec.uid) if not in_a_cell(p)]
        check("no stray processes", not stray, f"running outside any cell: {stray}" if stray else "none")
    return out


def cells_running(rec: AgentRecord) -> int:
    return sum(1 for p in processes(rec.uid) if in_a_cell(p)) if rec.uid >= 0 else 0


# ---- delete -------------------------------------------------------------------------------------

def delete(name: str, *, delete_home: bool, cmds: Commands) -> list[str]:
    """Remove agent NAME from whatever state it is in. Returns what could not be removed (empty: all
    gone, and the record with it); the record stays, state ``deleting``, until everything is."""
    need_root("agent delete")
    problems: list[str] = []
    with open_registry(write=True) as reg:
        rec = reg.get(name)
        rec.state = "deleting"
        _save(reg, cmds, f"record agent {name} (deleting)")
        pw = _user(name)
        if pw is not None and rec.uid >= 0 and pw.pw_uid != rec.uid:
            problems.append(f"user {name} has uid {pw.pw_uid}, not the recorded {rec.uid}: left alone")
            pw = None
        uid = pw.pw_uid if pw is not None else rec.uid
        if pw is None and uid >= 0:
            try:
                other = pwd.getpwuid(uid).pw_name
            except KeyError:
                other = ""
            if other:
                problems.append(f"uid {uid} now belongs to {other}: its processes were not killed")
                uid = -1
        if uid >= 0:
            gid = pw.pw_gid if pw is not None else (rec.gid if rec.gid >= 0 else 65534)
            left = kill_all(cmds, uid, gid)
            if left:
                problems.append(f"processes of {name} still run: {left}")
        _give_to_human(cmds, rec, uid, [s.source for s in rec.shares])
        for share in list(rec.shares):
            if rec.gid < 0:
                rec.shares.remove(share)  # never got an id: nothing was shared
                continue
            try:
                left_acl = _unshare(cmds, rec, share)
            except AgentcellError as e:
                left_acl = [e.problem]
            if left_acl:
                problems += left_acl
            else:
                rec.shares.remove(share)
        if pw is not None:
            cmds.run(["userdel", name], check=False, step="userdel")
        gr = _group(rec.group)
        if gr is not None and (rec.gid < 0 or gr.gr_gid == rec.gid):
            cmds.run(["groupdel", rec.group], check=False, step="groupdel")
        elif gr is not None:
            problems.append(f"group {rec.group} has gid {gr.gr_gid}, not the recorded {rec.gid}: left alone")
        if delete_home:
            problems += _remove_home(cmds, rec, uid)
        elif not problems and os.path.isdir(rec.home):  # kept: the human's now (last, once the user is gone)
            _give_to_human(cmds, rec, uid, [rec.home])
        if not cmds.dry_run:
            if _user(name) is not None and pw is not None:
                problems.append(f"user {name} still exists (userdel failed)")
            if _group(rec.group) is not None and (rec.gid < 0 or grp.getgrnam(rec.group).gr_gid == rec.gid):
                problems.append(f"group {rec.group} still exists (groupdel failed)")
        if problems:
            _save(reg, cmds, f"record agent {name} (deleting; {len(problems)} things left)")
        else:
            del reg.agents[name]
            _save(reg, cmds, f"forget agent {name}")
    return problems


def _give_to_human(cmds: Commands, rec: AgentRecord, uid: int, places: list[str]) -> None:
    """What the agent made in its shares (and its home, when kept) becomes the human's: left to a
    deleted uid, it would belong to whichever account gets that number next."""
    places = [p for p in places if os.path.lexists(p) and not os.path.islink(p)]
    if uid < 0 or not places:
        return
    if _user(rec.human) is None:  # nothing to give them to; not a reason to keep the agent
        sys.stderr.write(f"agentcell: warning: files of {rec.name} in {', '.join(places)} keep uid {uid}: its "
                         f"human {rec.human} no longer exists\n")
        return
    owned = ["(", "-uid", str(uid), *(["-o", "-gid", str(rec.gid)] if rec.gid >= 0 else []), ")"]
    for place in places:
        cmds.run(["find", place, "-xdev", *owned, "-exec", "chown", "--no-dereference", f"{rec.human}:", "--",
                  "{}", "+"], check=False, step="reassign")


def _remove_home(cmds: Commands, rec: AgentRecord, uid: int) -> list[str]:
    try:
        st = os.lstat(rec.home)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        return [f"{rec.home} is not a directory: left alone"]
    if uid < 0 or st.st_uid != uid:
        return [f"{rec.home} is owned by uid {st.st_uid}, not the agent's {uid}: left alone"]
    cmds.run(["rm", "-rf", "--one-file-system", "--", rec.home], check=False, step="home")
    if not cmds.dry_run and os.path.lexists(rec.home):
        return [f"{rec.home} could not be removed entirely"]
    return []
