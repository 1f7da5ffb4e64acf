"""Canary credentials: decoys at the paths where agents (and the malware that hijacks them) look for
keys — planted in the cell's own private home, never real ones, and watched from before the command
exists. Nothing legitimate in a cell opens them: an open is an escape attempt.

PID 1 plants them after the mount tree is built (the home is the cell's tmpfs), owned by the cell's
account (so an open succeeds and is seen: the kernel reports only opens that pass permission checks),
marks them, and hands the watch out over the hand-off channel (tag ``C``):

* as root: **fanotify** ``FAN_OPEN_PERM`` inode marks on the decoys alone: the opener waits (~40 µs)
  until the monitor has recorded who it is (a host pid: the event is read in the supervisor's pid
  namespace) and what runs there, then the open goes ahead — the decoy is fake. If the monitor is
  gone, the watch is closed and the open proceeds: a dead monitor is a telemetry event anyway;
* rootless (no CAP_SYS_ADMIN): **inotify** ``IN_OPEN`` — the open is seen, not who made it.

Decoys go only where the home's own private tmpfs is: where the home is a host directory
(``--home``: a persistent agent's own home) nothing is planted, and no decoy is planted in, above or
below a path shared into the cell (``--rw ~/.config`` keeps ``~/.config/gh/hosts.yml`` out): a
decoy must never land in a host directory, where it would stay, be opened by the host's own
programs, or meet another cell. No ``~/.netrc``: libcurl (git) and Python's requests (pip) read it
on every HTTP request, even in a cell that has no network, so it would be a false alarm on ordinary
work.
"""
from __future__ import annotations

import ctypes
import os

from . import fanotify  # imported before the cell forks: after pivot_root no module can be found
from .spec import CellSpec

IN_OPEN, IN_NONBLOCK, IN_CLOEXEC = 0x20, 0o4000, 0o2000000

# Relative to the cell's home, in the order they are marked (inotify watch descriptors follow it).
CANARIES = (".ssh/id_ed25519", ".ssh/id_rsa", ".aws/credentials", ".kube/config", ".config/gh/hosts.yml")


def planned(spec: CellSpec) -> tuple[str, ...]:
    """The decoys this cell gets (absolute paths in the cell), the same on both sides of the hand-off."""
    if not spec.watch or spec.home_dir:
        return ()
    home = spec.identity.home.rstrip("/")
    shared = (*spec.rw_paths, *spec.ro_paths, *spec.masked_paths, *(spec.system_paths or ()))
    out = []
    for rel in CANARIES:
        path = f"{home}/{rel}"
        if not any(_related(path, p) for p in shared):
            out.append(path)
    return tuple(out)


def _related(a: str, b: str) -> bool:
    """One path is the other, or lies below it."""
    a, b = a.rstrip("/") or "/", b.rstrip("/") or "/"
    return a == b or a.startswith(b + "/") or b.startswith(a + "/") or b == "/"


def _decoy(rel: str, tag: str) -> str:
    """Plausible contents; every secret in them is random and carries the cell's tag."""
    r = os.urandom(16).hex()  # not the secrets module: importing it would cost every monitored cell
    if rel.startswith(".ssh/"):
        body = (f"agentcell-canary-{tag}-{r}" * 8).encode().hex()
        lines = [body[i:i + 70] for i in range(0, len(body), 70)]
        return "-----BEGIN OPENSSH PRIVATE KEY-----\n" + "\n".join(lines) + "\n-----END OPENSSH PRIVATE KEY-----\n"
    if rel == ".aws/credentials":
        return (f"[default]\naws_access_key_id = AKIA{r[:16].upper()}\n"
                f"aws_secret_access_key = {tag}{r}{os.urandom(4).hex()}\n")
    if rel == ".kube/config":
        return ("apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    server: https://kubernetes.invalid:6443\n"
                "  name: prod\nusers:\n- name: admin\n  user:\n"
                f"    token: {tag}.{r}\ncontexts:\n- context:\n    cluster: prod\n    user: admin\n  name: prod\n"
                "current-context: prod\n")
    if rel == ".config/gh/hosts.yml":
        return f"github.com:\n    oauth_token: gho_{tag}{r}\n    user: agent\n    git_protocol: https\n"
    raise ValueError(rel)


def plant_and_watch(spec: CellSpec, ctl: object) -> None:
    """PID 1 (root in the cell, before the command exists): plant the decoys, mark them, send the
    watch to the supervisor. Any failure fails the launch: a monitored cell without its canaries
    would claim a watch it does not have."""
    from . import handoff

    paths = planned(spec)
    if not paths:
        return
    uid, gid = spec.identity.uid, spec.identity.gid  # rootless: the one uid mapped 1:1, PID 1's own
    tag = spec.cell_id.removeprefix("agentcell-")[:12] or os.urandom(6).hex()
    for path in paths:
        parent = os.path.dirname(path)
        todo = []
        while parent != spec.identity.home.rstrip("/") and not os.path.isdir(parent):
            todo.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(todo):
            os.mkdir(d, 0o700)
            os.chown(d, uid, gid, follow_symlinks=False)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, _decoy(path[len(spec.identity.home.rstrip('/')) + 1:], tag).encode())
            os.fchown(fd, uid, gid)
        finally:
            os.close(fd)
    watch = _fanotify(paths) if os.geteuid() == 0 and not spec.identity.userns else None
    if watch is None:
        watch = _inotify(paths)
    try:
        handoff.send_fd(ctl, watch, b"C")  # type: ignore[arg-type]
    finally:
        os.close(watch)


def _fanotify(paths: tuple[str, ...]) -> int | None:
    try:
        fd = fanotify.init(fanotify.FAN_CLASS_CONTENT)
    except OSError:
        return None  # no CAP_SYS_ADMIN after all (a container): inotify sees the opens, not who
    try:
        for p in paths:
            fanotify.mark(fd, fanotify.FAN_OPEN_PERM, p)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _inotify(paths: tuple[str, ...]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"inotify_init1: {os.strerror(err)}")
    for i, p in enumerate(paths, 1):
        wd = libc.inotify_add_watch(fd, os.fsencode(p), IN_OPEN)
        if wd != i:  # the supervisor maps watch descriptor i to the i-th planted path
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"inotify_add_watch {p}: {os.strerror(err) if wd < 0 else 'unexpected descriptor'}")
    return int(fd)
