"""What decides execution among the changed paths (a ``.git``, hooks, ``.envrc``, harness and editor
config, ``.gitattributes``, what the project's git config points at, a directory shaped like a bare
repository): flagged in review, never applied unless named with ``--theirs``."""
from __future__ import annotations

import os
import stat
from typing import Any

from .. import hostfs
from .store import _upper
from .tree import _is_whiteout, _lstat


def control(project: str, rel: str, targets: tuple[str, ...] = (), repos: tuple[str, ...] = ()) -> str | None:
    """The entry of ``rel`` that decides what git, a shell or an agent runs, relative to the project, or
    None: a ``.git`` anywhere, hooks, ``.envrc``, harness and editor config
    (:func:`agentcell.protect.surface.protected_part`); a ``.gitattributes``, which can name filters; what the
    project's git config points git at for code (``targets``: core.hooksPath, include.path); a
    directory shaped like a bare repository (``repos``), whose config git would read there."""
    from ..protect.surface import protected_part

    part = protected_part(os.path.join(project, rel), project)
    if part is not None:
        return os.path.relpath(part, project)
    for t in (*targets, *repos):
        if hostfs.within(rel, t):
            return t
    return rel if os.path.basename(rel) == ".gitattributes" else None


def _targets(meta: dict[str, Any]) -> tuple[str, ...]:
    """What the project's own git config (the human's) points git at for code, inside the project."""
    from ..protect.surface import config_targets

    project = meta["project"]
    git_dir = os.path.join(project, ".git")
    if not os.path.isdir(git_dir):
        return ()
    return tuple(os.path.relpath(t, project) for t in config_targets(git_dir, project) if hostfs.within(t, project))


def _bare_in_view(meta: dict[str, Any], paths: list[str]) -> tuple[str, ...]:
    """The directories above ``paths`` that the agent's view shows shaped like a bare repository (a HEAD
    file, and an objects/ or refs/ directory, in the change set or in the project beneath it: a bare
    repository of the human's whose config the agent edited counts too). A layer's entry is enough:
    when unsure, the path is flagged."""
    def has(rel: str, is_dir: bool) -> bool:
        for top in (_upper(meta), meta["project"]):
            st = _lstat(os.path.join(top, rel))
            if st is not None and not _is_whiteout(st) and (stat.S_ISDIR(st.st_mode) if is_dir
                                                            else stat.S_ISREG(st.st_mode)):
                return True
        return False

    seen: dict[str, bool] = {}
    for p in paths:
        d = os.path.dirname(p)
        while d and d not in seen:
            seen[d] = has(f"{d}/HEAD", False) and (has(f"{d}/objects", True) or has(f"{d}/refs", True))
            d = os.path.dirname(d)
    return tuple(sorted(d for d, bare in seen.items() if bare))


def _bare_shaped(paths: list[str]) -> tuple[str, ...]:
    """Directories among ``paths``' parents that hold a HEAD and objects/ or refs/: git takes such a
    directory for a bare repository and reads its config."""
    heads = {os.path.dirname(p) for p in paths if os.path.basename(p) == "HEAD"}
    out = set()
    for d in heads:
        pre = f"{d}/" if d else ""
        if any(p.startswith(pre + "objects/") or p.startswith(pre + "refs/") for p in paths):
            out.add(d or ".")
    return tuple(sorted(out))
