"""Reading a file by a path a user or an agent names, as agentcell (often root) must: never through a
link at its end, never a FIFO to block on (opened non-blocking), a directory, a device or /dev/zero
(regular files only), never more than a bound. Every refusal is one :class:`AgentcellError` line naming
the field and the fix; a path that is not text (bytes that are not UTF-8) is refused the same way.

It also decides "only you or root can change this" (:func:`changeable_only_by` by mode,
:func:`only_ours` with the ACL and the link count), owns the state directories (:func:`private_dir`,
:func:`run_dir`, :func:`state_dir`) and reads ACLs (:func:`acl_entries`). The descriptor walk of a tree
is ``accounts/acl.Walk``, beside the ACL grants it was written for (snapshots and seeding use it too).
"""
from __future__ import annotations

import os
import stat

from .errors import AgentcellError, printable

MAX_FILE = 1 << 20  # a configuration file, a script


def within(path: str, top: str) -> bool:
    """``path`` is ``top`` or lies below it (as written: neither is resolved)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def shown(path: str, limit: int = 200) -> str:
    """A path (or any value) as an error line may show it: printable, and at most ``limit`` characters."""
    text = printable(path)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def _it(path: str, field: str) -> str:
    """How a refusal names the file: by its path, or as "it" when the field is that path already."""
    return "it" if field == path else shown(path)


def check_text(path: str, field: str) -> str:
    """``path``, refused when it is not text (a name with bytes that are not UTF-8 cannot be recorded)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise AgentcellError(field, f"{shown(path)} is not UTF-8 text", "rename it, or give another path") from None
    if "\0" in path:
        raise AgentcellError(field, "the path holds a NUL byte", "give another path")
    return path


def open_regular(path: str, field: str, fix: str) -> int:
    """``path`` opened for reading: a regular file, not through a link. The caller closes the fd."""
    check_text(path, field)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise AgentcellError(field, f"{_it(path, field)} does not exist", fix) from None
    except OSError as e:
        what = "is a link (give the file itself)" if e.errno == 40 else f"cannot be read ({e.strerror})"
        raise AgentcellError(field, f"{_it(path, field)} {what}", fix) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else \
            "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file"
        raise AgentcellError(field, f"{_it(path, field)} is {kind}", fix)
    os.set_blocking(fd, True)
    return fd


def read_fd(fd: int, path: str, field: str, fix: str, limit: int = MAX_FILE) -> bytes:
    """What ``fd`` holds, whole: a regular file of at most ``limit`` bytes."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        raise AgentcellError(field, f"{_it(path, field)} is not a regular file of at most {limit:,} bytes", fix)
    with os.fdopen(os.dup(fd), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise AgentcellError(field, f"{_it(path, field)} grew past {limit:,} bytes while it was read", fix)
    return data


def read_regular(path: str, field: str, fix: str, limit: int = MAX_FILE) -> bytes:
    fd = open_regular(path, field, fix)
    try:
        return read_fd(fd, path, field, fix, limit)
    finally:
        os.close(fd)


# ---- state directories ------------------------------------------------------------------------------

RUN = "/run/agentcell"  # root's runtime state: records of what exists now (cgroups, tables, readers)


def private_dir(path: str, field: str = "state") -> str:
    """``path``, a directory only we may enter: made with mode 0700 (and its parents as needed), or
    found already as a real directory of ours, whose mode is tightened to 0700 if wider (a release
    before this one made ``/run/agentcell`` 0755 as the parent of its first record). Anything else (a
    link, another owner's directory, a file) is refused: state kept there could be read or replaced."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise AgentcellError(field, f"cannot create {shown(path)}: {e.strerror}",
                             "fix its parent's ownership, or set XDG_RUNTIME_DIR / XDG_STATE_HOME") from None
    what = ""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        what = "a link" if e.errno == 40 else "not a directory" if e.errno == 20 else f"unusable ({e.strerror})"
    else:
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                what = f"owned by uid {st.st_uid}"
            elif st.st_mode & 0o077:
                os.fchmod(fd, 0o700)  # by descriptor: the name may have been swapped since
        finally:
            os.close(fd)
    if what:
        raise AgentcellError(field, f"{shown(path)} is {what}, not a directory of ours",
                             f"remove it (agentcell makes it again), e.g. rm -r {shown(path)}")
    return path


def run_dir(name: str = "") -> str:
    """``/run/agentcell[/NAME]`` for root's records, both 0700."""
    private_dir(RUN)
    return private_dir(os.path.join(RUN, name)) if name else RUN


# ---- who can change a file: "only you or root" ------------------------------------------------------

ROOT = frozenset({0})
ACL_ACCESS = "system.posix_acl_access"
ACL_USER, ACL_GROUP, ACL_MASK = 0x02, 0x08, 0x10  # tags of the named entries and the mask


def acl_decode(raw: bytes) -> list[tuple[int, int, int]] | None:
    """A POSIX ACL xattr as (tag, perm, id) entries; None if it is not one."""
    import struct

    if len(raw) < 4 or (len(raw) - 4) % 8:
        return None
    return [struct.unpack_from("<HHI", raw, off) for off in range(4, len(raw), 8)]


def acl_entries(fd: int, which: str = ACL_ACCESS) -> list[tuple[int, int, int]] | None:
    """The ACL of the file held by ``fd`` (an O_PATH fd is enough), or None without one."""
    import errno

    try:
        return acl_decode(os.getxattr(f"/proc/self/fd/{fd}", which))
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise


def changeable_only_by(st: os.stat_result, owners: frozenset[int] | set[int], *, sticky_ok: bool = False) -> bool:
    """Only ``owners`` can change (write, or replace what is in) what ``st`` describes, by its mode:
    not a symlink, owned by one of them, no group or other write bit. ``sticky_ok``: a sticky
    directory's write bits are fine (others can add names there, not replace ours: /tmp)."""
    if stat.S_ISLNK(st.st_mode) or st.st_uid not in owners:
        return False
    if st.st_mode & 0o022:
        return sticky_ok and stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_ISVTX)
    return True


def only_ours(fd: int, owners: frozenset[int] | set[int] | None = None, *, sticky_ok: bool = False) -> bool:
    """The file held by ``fd`` can be changed only by ``owners`` (default: root and us): by its mode
    (:func:`changeable_only_by`), by its ACL (no entry naming anyone else with write through the mask)
    and, for a file, by its one name (a hard link made elsewhere, e.g. by an agent in a project, is
    the same file)."""
    st = os.fstat(fd)
    allowed = owners if owners is not None else {0, os.geteuid()}
    if not changeable_only_by(st, allowed, sticky_ok=sticky_ok):
        return False
    if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and sticky_ok:
        return True
    if not stat.S_ISDIR(st.st_mode) and st.st_nlink != 1:
        return False
    entries = acl_entries(fd) or []
    mask = next((perm for tag, perm, _ in entries if tag == ACL_MASK), 7)
    return not any(tag in (ACL_USER, ACL_GROUP) and perm & mask & 2 for tag, perm, _ in entries)


def only_ours_at(path: str, owners: frozenset[int] | set[int] | None = None, *, directory: bool = False) -> bool:
    """:func:`only_ours` of ``path`` itself (a link at its end is refused, never followed; with
    ``directory``, anything but a directory too: one lookup decides both)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0))
    except OSError:
        return False
    try:
        return only_ours(fd, owners)
    finally:
        os.close(fd)


class host_lock:  # (lower case: used as a function, ``with hostfs.host_lock("acl.lock"):``)
    """An exclusive lock of this host's, ``<run dir>/NAME`` (flock: let go if its holder dies). A class,
    not contextlib's (this module is on ``agentcell run``'s path, which does not import contextlib)."""

    def __init__(self, name: str) -> None:
        self.path, self.fd = os.path.join(run_dir(), name), -1

    def __enter__(self) -> None:
        import fcntl

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self.fd)
            raise

    def __exit__(self, *_exc: object) -> None:
        os.close(self.fd)


def replace_file(path: str, data: bytes) -> None:
    """Put ``data`` at ``path`` whole or not at all: written to a new file beside it (never through a
    link), synced, then renamed over it. Readers see the old content or the new, never part of either."""
    tmp = f"{path}.tmp-{os.urandom(6).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)


def state_dir() -> str:
    """AGENTCELL_STATE_DIR, else /var/lib/agentcell for root and the XDG state dir for anyone else (a
    rootless user's sessions, snapshots and trail are theirs, and /var/lib is not theirs to write)."""
    given = os.environ.get("AGENTCELL_STATE_DIR")
    if given:
        return given
    if os.geteuid() == 0:
        return "/var/lib/agentcell"
    xdg = os.environ.get("XDG_STATE_HOME")
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "agentcell")


def socket_dirs(uid: int, home: str) -> list[str]:
    """Every place a warm launcher of ours (or of the cell's identity ``uid`` with ``home``) may
    listen, whatever this process's environment says: cells get each one masked."""
    dirs = {"/run/agentcell", socket_dir(), f"/run/user/{os.getuid()}/agentcell", f"/run/user/{uid}/agentcell",
            os.path.join(home, ".local", "state", "agentcell")}
    try:
        import pwd

        dirs.add(os.path.join(pwd.getpwuid(os.getuid()).pw_dir, ".local", "state", "agentcell"))
    except KeyError:
        pass
    return sorted({os.path.realpath(d) for d in dirs})


def warm_wanted() -> bool:
    """False when the environment says AGENTCELL_WARM=off: nothing is handed to the user's warm launcher
    (``agentcell run`` as with --no-warm, a session's cell in a host started for it, and the compiled
    front runs the Python CLI)."""
    return os.environ.get("AGENTCELL_WARM", "") != "off"


def socket_dir() -> str:
    """Where our warm launcher listens: a directory only its owner may enter."""
    if os.geteuid() == 0:
        return "/run/agentcell"
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg):
        return os.path.join(xdg, "agentcell")
    state = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(state):
        state = os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "agentcell")


def read_proc(path: str, size: int = 4096) -> bytes:
    """The start of a /proc file, in one read: open, read, close (a Python file object makes seven calls
    of it, each a chance for the host's loop to take the GIL from the monitor's and give it back)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


def proc_stat(pid: int | str) -> list[bytes]:
    """``/proc/PID/stat``'s fields after the command's name (which may hold spaces and parentheses: the
    fields begin after its last ``)``), in one read: [0] the state, [1] the parent's pid, [6] the flags,
    [19] the start time (clock ticks since boot). ``pid`` may be ``self/task/TID``. OSError if the process
    is gone; a short or odd file raises IndexError or ValueError where a field is taken."""
    return read_proc(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()


def start_time(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since boot: with the pid, it names one process (errors
    as :func:`proc_stat`)."""
    return int(proc_stat(pid)[19])
