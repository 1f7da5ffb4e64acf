"""What this machine supports, probed for real: the data behind ``agentcell doctor``.

Every check returns plain data (:class:`Check`, :class:`Report`) and prints nothing; where a mechanism
has a probe of its own (Landlock's ABI, the audit status, the proc connector, the eBPF programs), the
check asks that one. :mod:`.checks` holds the machine's checks, :mod:`.namespaces` the forked probes of
user namespaces and the cell's namespaces, :mod:`.cgroupfs` the cgroup checks, :mod:`.report` the modes
and the whole report.

Nothing here changes the machine: no sysctl, no audit state, no cgroup, no nftables table is written.
"""
from __future__ import annotations

from .report import IDENTITY_MODES, NEEDABLE_MODES, Mode, Report, run

__all__ = ["IDENTITY_MODES", "NEEDABLE_MODES", "Mode", "Report", "run"]
