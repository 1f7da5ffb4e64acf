"""A session's seed directory: what its harness needs in its home from the start, made by the supervisor
and bound read-only into the cell at the same path.

``<state dir>/seeds/<session id>/`` (the parent is 0700, so no one else on the host reaches it; the
seed itself is readable in the cell, where only the agent's account runs):

* ``home/``: settings files the harness reads from its home (``~/.claude.json``, …): the account
  copies each into its home where it has none yet (:func:`agentcell.harness.profiles.launch` writes
  that step), so a persistent home keeps what the harness changed since;
* ``from/``: with ``--home-from DIR``, a copy of DIR that the account copies into its fresh home:
  walked by descriptor (no link followed, nothing but directories, regular files and the links
  themselves), bounded, without the decoy credentials' paths (a decoy lives there);
* files named by a variable (``OPENCODE_CONFIG``, …): read-only, the agent cannot change its own
  settings.

The path follows from the session id alone, so ``session recover`` removes it without a record.
"""
from __future__ import annotations

import os
import shutil
import stat

from ..errors import AgentcellError

MAX_HOME_BYTES = 256 << 20
MAX_HOME_FILES = 20_000


def seeds_dir() -> str:
    from ..hostfs import state_dir

    return os.path.join(state_dir(), "seeds")


def path(session_id: str) -> str:
    return os.path.join(seeds_dir(), session_id)


def create(session_id: str, files: list[tuple[str, str, bool]], home_from: str | None,
           owner: tuple[int, int]) -> list[str]:
    """Make the seed of ``session_id``: ``files`` as (path, content, in the home), the supervisor's
    and readable (some harnesses trust a settings file only in a chain of root's: Gemini CLI's system
    settings); ``home_from`` copied for the account (``owner``), modes kept. Returns what was left out
    of the copy."""
    parent = seeds_dir()
    os.makedirs(parent, mode=0o700, exist_ok=True)
    os.chmod(parent, 0o700)  # no one else on the host reaches a seed; in the cell only its account runs
    top = path(session_id)
    os.mkdir(top, 0o755)
    for rel, content, in_home in files:
        dest = os.path.join(top, "home", rel) if in_home else os.path.join(top, rel)
        os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
        mode = 0o755 if rel.startswith("bin/") and not in_home else 0o644  # the seed's own programs (bin/git)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        # surrogateescape: a path the host named in bytes (a project's non-UTF-8 name in the git
        # configuration's safe directories) is written back as those bytes
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(content)
    if home_from is None:
        return []
    dest = os.path.join(top, "from")
    left_out = _copy_home(home_from, dest)
    # Ours alone so far (the parent is 0700): walked by name safely, then given to the account.
    for d, dirs, names in os.walk(dest):
        for name in (*dirs, *names):
            os.lchown(os.path.join(d, name), *owner)
    os.lchown(dest, *owner)
    return left_out


def _copy_home(source: str, dest: str) -> list[str]:
    """``source`` into ``dest`` as data: by descriptor, never through a link; the decoys' paths and
    anything but directories, regular files and links left out (and said)."""
    from ..accounts.acl import Walk
    from ..cell.canary import CANARIES

    left_out: list[str] = []
    count = size = 0
    os.mkdir(dest, 0o700)
    walk = Walk(source, links=True)
    for node in walk:
        if node.rel == ".":
            continue
        target = os.path.join(dest, node.rel)
        kind = stat.S_IFMT(node.st.st_mode)
        if node.rel in CANARIES:
            left_out.append(f"~/{node.rel} (a decoy credential lives there)")
            continue
        count += 1
        if count > MAX_HOME_FILES:
            raise AgentcellError("--home-from", f"{source} holds more than {MAX_HOME_FILES:,} entries",
                                 "prepare a smaller home (settings and logins, not caches)")
        if kind == stat.S_IFDIR:
            os.mkdir(target, stat.S_IMODE(node.st.st_mode) | 0o700)
        elif kind == stat.S_IFLNK:
            assert node.parent is not None and node.name is not None
            os.symlink(os.readlink(node.name, dir_fd=node.parent), target)
        elif kind == stat.S_IFREG:
            size += node.st.st_size
            if size > MAX_HOME_BYTES:
                raise AgentcellError("--home-from", f"{source} holds more than {MAX_HOME_BYTES >> 20} MiB",
                                     "prepare a smaller home (settings and logins, not caches)")
            src = os.open(f"/proc/self/fd/{node.fd}", os.O_RDONLY | os.O_CLOEXEC)  # the very file walked
            try:
                out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                              stat.S_IMODE(node.st.st_mode) & 0o777 | 0o600)
                try:
                    while chunk := os.read(src, 1 << 20):
                        os.write(out, chunk)
                finally:
                    os.close(out)
            finally:
                os.close(src)
        else:
            left_out.append(f"~/{node.rel} (not a file, directory or link)")
    if walk.too_deep:
        left_out.append(f"what lies deeper than {walk.depth} levels in {source}")
    return left_out


def remove(session_id: str) -> list[str]:
    """Remove the seed (what could not be removed, as problems)."""
    top = path(session_id)
    if not os.path.lexists(top):
        return []
    try:
        if os.path.islink(top) or not os.path.isdir(top):
            os.unlink(top)
        else:
            shutil.rmtree(top)
    except OSError as e:
        return [f"seed {top}: {e.strerror}"]
    return []
