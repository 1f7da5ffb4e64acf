"""Per-session accounts: made for one session, deleted at its end, nothing left behind.

``create_ephemeral(session_id)`` makes user and group ``ac-s<12 hex of the session id's SHA-256>``
with a uid (= gid) drawn at random from a reserved range, 1,900,000,000 to 1,900,065,535: above
systemd's container range (524288-1879048191) and its dynamic users, below 2^31, so it collides
with no account a distribution or systemd hands out. The account has no home on the host (the cell
gives it a private one), no password, ``nologin`` as its shell and no lastlog entry.

Each account is recorded in ``<state dir>/ephemeral/NAME`` *before* it is made, so a crashed session
can be cleaned up: :func:`leftovers` lists them and :func:`delete` removes any of them.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import secrets
from collections.abc import Iterator, Sequence

from .. import hostfs
from ..errors import AgentcellError
from ..hostfs import state_dir
from . import acl
from .accounts import NOLOGIN, AccountError, _group, _uid_taken, _user, held_ids, kill_all, processes
from .commands import Commands, need_root

UID_FIRST, UID_LAST = 1_900_000_000, 1_900_065_535
PREFIX = "ac-s"


class Account:
    """A per-session account, as :func:`create_ephemeral` made it."""

    __slots__ = ("name", "uid", "gid", "home", "session_id")

    def __init__(self, name: str, uid: int, gid: int, session_id: str) -> None:
        self.name, self.uid, self.gid, self.session_id = name, uid, gid, session_id
        self.home = f"/home/{name}"

    def __repr__(self) -> str:
        return f"Account({self.name!r}, uid={self.uid})"


def _records_dir() -> str:
    d = os.path.join(state_dir(), "ephemeral")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return d


def name_for(session_id: str) -> str:
    if not session_id or not session_id.isprintable() or len(session_id) > 256:
        raise AccountError("session_id", f"{session_id!r} is not a usable session id",
                           "a printable string of at most 256 characters")
    return PREFIX + hashlib.sha256(session_id.encode()).hexdigest()[:12]


def _free_uid() -> int:
    """A uid of the range that no account, group or record of ours names (a record whose account a crash
    left unmade still holds its uid: another session's account with that uid would be taken for its), and
    that no live process has as a uid or a group."""
    import grp

    recorded = {a.uid for a in leftovers()}
    held, groups = held_ids()  # (a process that kept an old account's group keeps the number: never lent again)
    for _ in range(64):
        uid = UID_FIRST + secrets.randbelow(UID_LAST - UID_FIRST + 1)
        if uid in recorded or uid in held or uid in groups:
            continue
        try:
            pwd.getpwuid(uid)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(uid)
            continue
        except KeyError:
            return uid
    raise AccountError("ephemeral", f"no free uid found in {UID_FIRST}-{UID_LAST}",
                       "delete leftover session accounts (agentcell agent list)")


def _write_record(path: str, account: Account) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, f"{account.name}\n{account.uid}\n{account.session_id}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def create_ephemeral(session_id: str, cmds: Commands | None = None) -> Account:
    """Make the session's account; refused if the session already has one."""
    need_root("ephemeral account")
    cmds = cmds or Commands()
    name = name_for(session_id)
    record = os.path.join(_records_dir(), name)
    if os.path.lexists(record) or _user(name) is not None or _group(name) is not None:
        raise AccountError("session_id", f"session {session_id!r} already has an account ({name})",
                           "delete it first, or use a new session id")
    with _range_lock():  # pick, record and make: two sessions never take one uid (model/lifecycle.pml)
        uid = _free_uid()
        account = Account(name, uid, uid, session_id)
        _write_record(record, account)
        try:
            # One command for user and group: its group by its name, given the uid as its gid (useradd takes a
            # free preferred gid within GID_MIN..GID_MAX, here our range alone), checked below.
            span = [f"-K{k}_{m}={v}" for k in ("UID", "GID") for m, v in (("MIN", UID_FIRST), ("MAX", UID_LAST))]
            cmds.run(["useradd", *span, "--uid", str(uid), "--user-group", "--no-create-home", "--no-log-init",
                      "--home-dir", account.home, "--shell", NOLOGIN, "--expiredate", "1",
                      "--comment", "agentcell session account", name], step="useradd")
            if not cmds.dry_run:
                pw, gr = _user(name), _group(name)
                if pw is None or gr is None or (pw.pw_uid, pw.pw_gid, gr.gr_gid) != (uid, uid, uid):
                    raise AccountError("ephemeral", f"{name} was made with uid:gid {pw and pw.pw_uid}:"
                                       f"{gr and gr.gr_gid}, not {uid}:{uid} (another account took the number)",
                                       "start the session again")
        except AgentcellError:
            delete(account, cmds)
            raise
    return account


@contextlib.contextmanager
def _range_lock() -> Iterator[None]:
    """The range's lock, from the pick of a uid to its account (flock: let go if its holder dies). Without
    it, two sessions could pick one free uid; the second's useradd fails, and its account's record then
    names a uid that is the first's: its cleanup leaves the record behind ("uid now belongs to ...") after
    revoking, by number, the first session's grants. The lifecycle model found it (REVERT_UID_UNLOCKED)."""
    with hostfs.host_lock("uids.lock"):
        yield


def vouch(account: Account) -> pwd.struct_passwd | None:
    """That ``account`` is a per-session account this module made, or raise :class:`AccountError` saying
    why not; its user's entry (None once deleted). Whatever asks (a checkpoint read back by 'session
    recover', say), no other account is touched: its name follows from the session id, its uid from the
    range, and a user of that name (or, without one, whoever has that uid now) must agree."""
    if account.name != name_for(account.session_id) or not UID_FIRST <= account.uid <= UID_LAST:
        raise AccountError("account", f"{account.name!r} (uid {account.uid}) is not the per-session account of "
                           f"session {account.session_id!r}", "nothing was deleted")
    need_root("ephemeral account")
    pw = _user(account.name)
    if pw is not None and pw.pw_uid != account.uid:
        raise AccountError("ephemeral", f"user {account.name} has uid {pw.pw_uid}, not {account.uid}: left alone")
    if pw is None and _uid_taken(account.uid):
        raise AccountError("ephemeral", f"uid {account.uid} now belongs to {_uid_taken(account.uid)}: left alone")
    return pw


def delete(account: Account, cmds: Commands | None = None, *, paths: Sequence[str] = (),
           give_to: tuple[int, int] | None = None, given: bool = False) -> None:
    """Kill the account's processes, remove user, group and record; raise naming what is left.

    ``paths`` are the session's writable paths: what the account made there is given to ``give_to``
    (uid, gid: the session's human), or, without it, is an error to report — a file left to a deleted
    uid would belong to whichever account gets the number next (a setuid bit is cleared by chown).
    ``given``: that was done already (in the revoke's walk, :func:`acl.revoke`): each path is walked once
    more only to check, and given again where something is still the account's."""
    pw = vouch(account)
    cmds = cmds or Commands()
    problems: list[str] = []
    running = kill_all(cmds, account.uid, account.gid)
    if running:
        problems.append(f"processes still run: {running}")
    for place in paths:
        try:
            left = acl.owned_by(account.uid, account.gid, place) if give_to is None or given else []
            if give_to is not None and (left or not given):
                problems += acl.reassign(cmds, account.uid, account.gid, give_to[0], give_to[1], place)
            else:
                problems += left
        except (OSError, AgentcellError) as e:
            problems.append(f"{place}: {e}")
    if pw is not None:
        cmds.run(["userdel", account.name], check=False, step="userdel")
    gr = _group(account.name)
    if gr is not None and gr.gr_gid == account.gid:
        cmds.run(["groupdel", account.name], check=False, step="groupdel")
    if _user(account.name) is not None:
        problems.append(f"user {account.name} still exists")
    if _group(account.name) is not None:
        problems.append(f"group {account.name} still exists")
    if processes(account.uid):
        problems.append("processes still run")
    if problems:
        raise AccountError("ephemeral", f"{account.name}: " + "; ".join(problems), "see 'agentcell agent list'")
    try:
        os.unlink(os.path.join(_records_dir(), account.name))
    except FileNotFoundError:
        pass


def leftovers() -> list[Account]:
    """Session accounts whose session did not delete them (a crash): each can be passed to delete()."""
    out = []
    d = _records_dir()
    for name in sorted(os.listdir(d)):
        try:
            with open(os.path.join(d, name)) as f:
                rec_name, uid, session_id = f.read().split("\n")[:3]
            if rec_name == name and name.startswith(PREFIX):
                out.append(Account(name, int(uid), int(uid), session_id))
        except (OSError, ValueError):
            continue
    return out
