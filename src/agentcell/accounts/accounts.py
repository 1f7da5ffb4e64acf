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
from collections.abc import Callable

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


def held_ids() -> tuple[set[int], dict[int, list[tuple[int, int]]]]:
    """One look at every live task: the uids any of them has (real, effective, saved, filesystem), and
    for each gid, the (pid, real uid) of the processes that have it (the same four, or a supplementary
    group). A process of another user that ran a setgid file of an agent's keeps the agent's group
    after the account is gone: a new account given that number would lend it its grants. Each thread
    has credentials of its own (a raw setresgid changes only its caller's), and a leader that exited
    before its threads is a zombie with live threads: those are read one by one."""
    uids: set[int] = set()
    gids: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        leader = _creds(f"/proc/{entry}/status")
        if leader is None:
            continue
        tasks = [leader]
        if leader[3] != 1 or leader[0]:  # (threads, or a zombie leader: each task's own)
            try:
                names = os.listdir(f"/proc/{entry}/task")
            except OSError:
                names = []
            tasks = [c for c in (_creds(f"/proc/{entry}/task/{t}/status") for t in names if t.isdigit()) if c]
        held: set[int] = set()
        ruid = -1
        for zombie, u, g, _threads in tasks:
            if zombie:
                continue
            uids.update(u)
            held |= g
            ruid = u[0] if u else -1
        for gid in held:
            gids.setdefault(gid, []).append((int(entry), ruid))
    return uids, gids


def _creds(path: str) -> tuple[bool, list[int], set[int], int] | None:
    """(a zombie, its uids, its gids and supplementary groups, its thread count) from a status file."""
    try:
        with open(path) as f:
            fields = dict(line.split(":", 1) for line in f
                          if line.startswith(("State:", "Uid:", "Gid:", "Groups:", "Threads:")))
        return (fields.get("State", "").strip().startswith("Z"), [int(x) for x in fields.get("Uid", "").split()],
                {int(x) for x in (fields.get("Gid", "") + " " + fields.get("Groups", "")).split()},
                int(fields.get("Threads", "1").strip() or 1))
    except (OSError, ValueError):
        return None


def group_holders(uid: int, gid: int) -> list[str]:
    """Processes of other users that hold the agent's group ``gid`` as the session ends: a line for each,
    for the human. Such a process ran a setgid file of the agent's (or was given the group by one that
    did); it has what the group is granted, this session's and, for a persistent agent, the next's. This
    sees only processes at the moment of the look: a setgid copy of its own made with the group, or
    credentials kept in an io_uring personality, are not seen (docs/status.md)."""
    holders = [(pid, owner) for pid, owner in held_ids()[1].get(gid, []) if owner != uid]
    out = []
    for pid, owner in holders[:5]:
        try:
            who = pwd.getpwuid(owner).pw_name
        except KeyError:
            who = f"uid {owner}"
        out.append(f"process {pid} of {who} holds the agent's group {gid} (it ran a setgid file of the agent's, or "
                   "was given the group by one that did): end it, and look for setgid files of that group")
    if len(holders) > 5:
        out.append(f"... and {len(holders) - 5} more processes of other users hold the agent's group {gid}")
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

FIRST_ID = 1000


def _fresh_id(last: int) -> int:
    """A uid (= gid) no account or group has, above every one agentcell ever gave an agent: a deleted
    agent's number is never handed to the next one (files it left anywhere stay nobody's)."""
    ident = max(last + 1, FIRST_ID)
    while True:
        try:
            pwd.getpwuid(ident)
        except KeyError:
            try:
                grp.getgrgid(ident)
            except KeyError:
                return ident
        ident += 1


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
        ident = _fresh_id(reg.last_uid)
        rec.uid = rec.gid = ident  # recorded before it exists: a crash can be cleaned up by number too
        reg.agents[name] = rec
        reg.last_uid = ident
        _save(reg, cmds, f"record agent {name} (creating, uid {ident})")
        cmds.run(["groupadd", "--gid", str(ident), group], step="groupadd")
        # Expired from its first day: no login of any kind (sshd with a key planted in the home, cron, su)
        # honours it; agentcell's own switch to the account does not ask.
        cmds.run(["useradd", "--uid", str(ident), "--gid", group, "--no-user-group", "--home-dir", home,
                  "--no-create-home", "--shell", NOLOGIN, "--expiredate", "1", "--comment", f"agentcell agent {name}",
                  name], step="useradd")
        cmds.run(["install", "-d", "-m", "2770", "-o", name, "-g", group, home], step="home")
        cmds.run(["setfacl", "-m", f"d:g:{group}:rwx", home], step="home ACL")
        cmds.run(["gpasswd", "--add", human, group], step="human")
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
        try:
            real.encode()
        except UnicodeEncodeError:
            raise AccountError("SOURCE", f"{real!r} is not valid UTF-8", "rename it, or share its parent") from None
        _idle(rec, "SOURCE")
        st = os.lstat(real)
        share = Share(real, mode, st.st_dev, st.st_ino, acl.prior_acl(real))
        rec.shares.append(share)  # recorded before granting: whatever a crash leaves, delete revokes
        _save(reg, cmds, f"record share {real} ({mode}) of agent {name}")
        try:
            complete = acl.grant(cmds, rec.group, rec.gid, real, mode)
        except BaseException as e:
            left = _unshare(cmds, rec, share)
            if not left:
                rec.shares.remove(share)
                _save(reg, cmds, f"forget share {real} of agent {name} (the grant failed)")
            if isinstance(e, OSError):
                raise AccountError("SOURCE", f"sharing {real} failed ({e.strerror}); "
                                   + ("undone" if not left else "; ".join(left)), "") from None
            raise
        if not complete:
            sys.stderr.write(f"agentcell: warning: {real} is deeper than {acl.MAX_DEPTH} levels; the deepest "
                             "entries were not shared\n")
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
    left = acl.revoke(cmds, rec.uid, rec.gid, share.source, share.prior_acl)
    if cmds.dry_run:
        return left
    found = acl.residue(rec.uid, rec.gid, share.source)
    return left + [f"ACL entries naming {rec.name} remain on {p}" for p in found[:5]] + (
        [f"... and {len(found) - 5} more"] if len(found) > 5 else [])


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
        expire = account_expiry(rec.name)
        check("no login", pw.pw_shell == NOLOGIN and expire is not None and 0 < expire <= _today(),
              f"shell {pw.pw_shell}, account {'expired' if expire and expire <= _today() else 'not expired'} "
              f"(want {NOLOGIN} and expired: usermod --expiredate 1 {rec.name})")
    gr = _group(rec.group)
    check("group", gr is not None and gr.gr_gid == rec.gid, "missing" if gr is None else f"gid {gr.gr_gid}")
    check("human in group", gr is not None and rec.human in gr.gr_mem, f"{rec.human} in {rec.group}")
    try:
        st = os.lstat(rec.home)
        mode = stat.S_IMODE(st.st_mode)
        home_ok = stat.S_ISDIR(st.st_mode) and st.st_uid == rec.uid and st.st_gid == rec.gid and mode == 0o2770
        check("home", home_ok, f"{rec.home} {oct(mode)} uid {st.st_uid} gid {st.st_gid} (want 02770 "
              f"{rec.uid}:{rec.gid}, a directory)")
        check("home default ACL", rec.gid in {i for t, p, i in acl.default_entries(rec.home)
                                              if t == acl.GROUP and p == 7}, f"default:group:{rec.group}:rwx")
    except FileNotFoundError:
        check("home", False, f"{rec.home} is missing")
    tools = [t for t in ("setfacl", "getfacl", "setpriv", "useradd", "userdel") if shutil.which(t) is None]
    check("tools", not tools, "missing: " + ", ".join(tools) if tools else "setfacl, setpriv, useradd present")
    for s in rec.shares:
        why = check_share(rec, s)
        if not why and rec.gid not in acl.named_gids(s.source):
            why = f"{s.source} no longer has the ACL entry for {rec.group}"
        check(f"share {s.source} ({s.mode})", not why, why or "valid")
    if rec.uid >= 0:
        stray = [p for p in processes(rec.uid) if not in_a_cell(p)]
        check("no stray processes", not stray, f"running outside any cell: {stray}" if stray else "none")
    return out


def cells_running(rec: AgentRecord) -> int:
    return sum(1 for p in processes(rec.uid) if in_a_cell(p)) if rec.uid >= 0 else 0


# ---- delete -------------------------------------------------------------------------------------

# Entries of a home through which the host's own services act as its account, outside any cell: sshd's
# keys and rc, the mail system's forwards and filters (delivery ignores an account's expiry), Kerberos
# and rsh trust, PAM's environment. At the top of the home, by name or prefix; in ~/.ssh, by prefix.
HOST_LOGINS = (".forward", ".qmail", ".procmailrc", ".mailfilter", ".k5login", ".k5users", ".rhosts", ".shosts",
               ".pam_environment")
SSH_LOGINS = ("authorized_keys", "rc", "environment")


def defuse_home(home: str, uid: int, gid: int) -> list[str]:
    """After a run in an agent's own home: what it planted for the host's services is renamed out of
    their way (``NAME.agentcell-disabled``; a ``~/.ssh`` that is not a directory, the link itself),
    the home's mode put back (2770: its human reads it through the group) and any named ACL entry but
    its group's removed (an entry for another account would hand the home to it). Works on descriptors:
    the names are the agent's. Returns what it did."""
    from . import acl

    out: list[str] = []
    try:
        fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return [f"{home}: cannot be checked ({e.strerror})"]
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            return [f"{home} is not the agent's (uid {st.st_uid}): left alone"]
        if stat.S_IMODE(st.st_mode) != 0o2770:
            os.fchown(fd, uid, gid)
            os.fchmod(fd, 0o2770)
            out.append(f"the agent changed the mode of its home {home} to {oct(stat.S_IMODE(st.st_mode))}: put "
                       "back to 02770")
        entries = acl.get(fd) or []
        kept = [e for e in entries if e[0] not in acl.NAMED or (e[0] == acl.GROUP and e[2] == gid)]
        if kept != entries:
            acl.put(fd, acl.ACCESS, kept)
            out.append(f"the agent gave other accounts access to its home {home} (ACL): removed")
        out += _disable(fd, home, "", lambda n: n.startswith(HOST_LOGINS))
        try:
            ssh = os.stat(".ssh", dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return out
        if not stat.S_ISDIR(ssh.st_mode):
            out += _disable(fd, home, "", lambda n: n == ".ssh")
            return out
        try:
            sfd = os.open(".ssh", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError as e:
            return [*out, f"{home}/.ssh: cannot be checked ({e.strerror}): look at it"]
        try:
            out += _disable(sfd, home, ".ssh/", lambda n: n.startswith(SSH_LOGINS))
        finally:
            os.close(sfd)
    finally:
        os.close(fd)
    return out


def _disable(dfd: int, home: str, where: str, planted: Callable[[str], bool]) -> list[str]:
    out = []
    for name in sorted(n for n in os.listdir(dfd) if planted(n) and DISABLED not in n):
        target = name + DISABLED
        try:
            os.stat(target, dir_fd=dfd, follow_symlinks=False)
            target += "-" + os.urandom(6).hex()  # one the agent could not have made in advance
        except FileNotFoundError:
            pass
        try:
            os.rename(name, target, src_dir_fd=dfd, dst_dir_fd=dfd)
            out.append(f"the agent made {home}/{where}{name}, through which the host's services would act as its "
                       f"account outside any cell: renamed to {target}")
        except OSError as e:
            out.append(f"{home}/{where}{name}: could not be renamed ({e.strerror}): remove it")
    return out


DISABLED = ".agentcell-disabled"


def account_expiry(name: str) -> int | None:
    """The account's expiry day (days since 1970) from /etc/shadow; None: none set, or unreadable."""
    try:
        with open("/etc/shadow") as f:
            for line in f:
                fields = line.rstrip("\n").split(":")
                if fields[0] == name and len(fields) > 7:
                    return int(fields[7]) if fields[7].isdigit() else None
    except OSError:
        pass
    return None


def _today() -> int:
    return int(time.time() // 86400)


def delete(name: str, *, delete_home: bool, cmds: Commands) -> list[str]:
    """Remove agent NAME from whatever state it is in. Returns what could not be removed (empty: all
    gone, and the record with it); the record stays, state ``deleting``, until everything is. Each
    step runs whatever the previous ones did: a failure is recorded as a problem, never a traceback."""
    need_root("agent delete")
    problems: list[str] = []

    def step(what: str, fn: Callable[[], list[str] | None]) -> None:
        try:
            problems.extend(fn() or [])
        except Exception as e:  # noqa: BLE001 - resilience is the point: say what failed, go on
            problems.append(f"{what}: {e}")

    with open_registry(write=True) as reg:
        rec = reg.get(name)
        rec.state = "deleting"
        _save(reg, cmds, f"record agent {name} (deleting)")
        pw = _user(name)
        if pw is not None and rec.uid >= 0 and pw.pw_uid != rec.uid:
            problems.append(f"user {name} has uid {pw.pw_uid}, not the recorded {rec.uid}: left alone")
            pw = None
        uid = pw.pw_uid if pw is not None else rec.uid
        if pw is None and uid >= 0 and _uid_taken(uid):
            problems.append(f"uid {uid} now belongs to {_uid_taken(uid)}: its processes and files were left alone")
            uid = -1
        gid = rec.gid if rec.gid >= 0 else (pw.pw_gid if pw is not None else -1)
        if uid >= 0:
            step("kill", lambda: [f"processes of {name} still run: {left}"]
                 if (left := kill_all(cmds, uid, gid if gid >= 0 else 65534)) else [])
        human = _user(rec.human)
        places = [s.source for s in rec.shares]
        for share in list(rec.shares):
            def unshare(share: Share = share) -> list[str]:
                left = _unshare(cmds, rec, share) if rec.gid >= 0 else []
                if not left:
                    rec.shares.remove(share)
                return left
            step(f"share {share.source}", unshare)
        if uid >= 0:
            step("files", lambda: _give_to_human(cmds, rec, uid, gid, human, places))
        if pw is not None:
            step("userdel", lambda: _opt(cmds.run(["userdel", name], check=False, step="userdel")))
        gr = _group(rec.group)
        if gr is not None and (rec.gid < 0 or gr.gr_gid == rec.gid):
            step("groupdel", lambda: _opt(cmds.run(["groupdel", rec.group], check=False, step="groupdel")))
        elif gr is not None:
            problems.append(f"group {rec.group} has gid {gr.gr_gid}, not the recorded {rec.gid}: left alone")
        if delete_home:
            step("home", lambda: _remove_home(cmds, rec, uid))
        elif not problems and uid >= 0 and os.path.isdir(rec.home) and not os.path.islink(rec.home):
            # Kept: the human's from now on, without entries naming a number that is free now. Last, and
            # only when all else is gone: a delete to be repeated still finds the home as the agent's.
            step("home ACL", lambda: acl.revoke(cmds, uid, gid, rec.home, []))
            step("home files", lambda: _give_to_human(cmds, rec, uid, gid, human, [rec.home]))
        if not cmds.dry_run:
            if pw is not None and _user(name) is not None:
                problems.append(f"user {name} still exists (userdel failed)")
            gr = _group(rec.group)
            if gr is not None and (rec.gid < 0 or gr.gr_gid == rec.gid):
                problems.append(f"group {rec.group} still exists (groupdel failed)")
        if problems:
            _save(reg, cmds, f"record agent {name} (deleting; {len(problems)} things left)")
        else:
            del reg.agents[name]
            _save(reg, cmds, f"forget agent {name}")
    return problems


def _opt(_result: object) -> None:
    return None


def _uid_taken(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return ""


def _give_to_human(cmds: Commands, rec: AgentRecord, uid: int, gid: int, human: pwd.struct_passwd | None,
                   places: list[str]) -> list[str]:
    """What the agent made in its shares (and its home, when kept) becomes the human's: left to a
    deleted uid, it would be nobody's, or the next account's that gets the number."""
    places = [p for p in places if os.path.lexists(p) and not os.path.islink(p)]
    if not places:
        return []
    if human is None:  # nothing to give them to; not a reason to keep the agent
        sys.stderr.write(f"agentcell: warning: files of {rec.name} in {', '.join(places)} keep uid {uid}: its "
                         f"human {rec.human} no longer exists\n")
        return []
    left: list[str] = []
    for place in places:
        left += acl.reassign(cmds, uid, gid, human.pw_uid, human.pw_gid, place)
    return left


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
