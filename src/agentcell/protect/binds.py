"""What the policy adds to a cell's mount plan (:func:`agentcell.cell.mounts.plan`), so the mechanism
layer knows no policy: the protected entries of the writable paths (:mod:`.surface`: hooks,
git config and harness config bound read-only onto themselves, ``.git`` directories pinned in place so
they cannot be swapped for a rebuilt one, entries ``allow_write`` lifts writable on top), and the
places a warm launcher or a named live cell of ours may listen, hidden like the host's secrets (a
rootless cell has its owner's uid and could otherwise talk to them).

Computed when the cell is prepared (the warm launcher's pre-warmed cell: when it was prepared), from
the filesystem as it is then; what appears later is the protected-path check's (:mod:`.check`).
"""
from __future__ import annotations

from .. import hostfs
from ..cell.spec import TYPE_CHECKING
from . import surface

if TYPE_CHECKING:
    from ..cell.spec import CellSpec


Binds = tuple[tuple[tuple[str, bool], ...], tuple[str, ...]]


def _scanned(spec: CellSpec) -> tuple[str, ...]:
    """The writable paths whose protected entries are bound: not a copy-on-write workspace, whose
    writes never reach the project (what the agent changed there is reviewed before it is applied)."""
    ws = spec.workspace
    return tuple(p for p in spec.rw_paths if ws is None or p != ws.project)


def for_cell(spec: CellSpec) -> Binds:
    """(guarded, hidden) for ``spec``: the arguments :func:`agentcell.cell.mounts.plan` takes."""
    return _for_scan(spec, surface.Scan(_scanned(spec)))


def for_watched_cell(spec: CellSpec) -> tuple[Binds, tuple[str, ...]]:
    """:func:`for_cell`'s, and the protected entries that do not exist yet (the monitor watches their
    directories: what the command creates there is reported as it happens), from one scan."""
    scan = surface.Scan(_scanned(spec))
    return _for_scan(spec, scan), surface.creatable(scan, spec.allow_write)


def _for_scan(spec: CellSpec, scan: surface.Scan) -> Binds:
    guarded = [(p, False) for p in surface.pinned_paths(scan)]
    protected = surface.protected_paths(scan, spec.allow_write)
    guarded += [(p, True) for p in protected]
    # A lifted entry inside a protected directory: writable on top of the directory's read-only bind.
    guarded += [(a, False) for a in surface.lifted_inside(protected, spec.allow_write)]
    return tuple(guarded), tuple(hostfs.socket_dirs(spec.identity.uid, spec.identity.home))
