"""Resource ceilings as the user writes them (``--memory 2G``, ``--cpu 50``, ``--pids 256``, ``--limits
ops1``) and a session's defaults by risk. Plain parsing, no I/O but the machine's size: ``agentcell
run`` imports this.

Defaults by the plan's ``risk`` (every level bounds a fork bomb, a runaway allocation and a spinner on
every CPU; the flags win):

======== ============================== ============================== =========
risk     memory                         CPU (percent of one CPU)       tasks
======== ============================== ============================== =========
low      1/8 of RAM (at least 2 GiB)    75 % of the machine's CPUs     1024
medium   1/12 of RAM (at least 1.5 GiB) 50 % of the machine's CPUs     512
high     1 GiB                          50 % of one CPU                256
======== ============================== ============================== =========

``ops1`` is OPS-1's own: 2 GiB, 50 % of one CPU, 64 tasks. The harnesses are multi-threaded (each
thread is a task): 64 is too few for most of them, so no risk level goes that low.
"""
from __future__ import annotations

import os

from .errors import AgentcellError

RISKS = ("low", "medium", "high")
OPS1 = (2 << 30, 50, 64)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def cpus() -> int:
    return len(os.sched_getaffinity(0)) or os.cpu_count() or 1


def for_risk(risk: str) -> tuple[int, int, int]:
    """(memory bytes, CPU percent of one CPU, tasks) for a risk level."""
    ram, n = ram_bytes(), cpus()
    if risk == "low":
        return max(2 << 30, ram // 8), max(50, 75 * n), 1024
    if risk == "medium":
        return max(3 << 29, ram // 12), max(50, 50 * n), 512
    if risk == "high":
        return 1 << 30, 50, 256
    raise AgentcellError("risk", f"'{risk}' is not a risk level", "one of " + ", ".join(RISKS))


def parse_size(text: str, flag: str = "--memory") -> int:
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = _UNITS.get(value[-1:], 1)
    number = value[:-1] if value[-1:] in _UNITS else value
    if not number.isdigit() or int(number) * unit < (1 << 20):
        raise AgentcellError(flag, f"'{text}' is not a size of at least 1M", f"e.g. {flag} 2G")
    return int(number) * unit


def parse_cpu(text: str, flag: str = "--cpu") -> int:
    value = text.strip().rstrip("%")
    if not value.isdigit() or not 1 <= int(value) <= 100 * cpus():
        raise AgentcellError(flag, f"'{text}' is not a percentage of one CPU (1 to {100 * cpus()} here)",
                             f"e.g. {flag} 50")
    return int(value)


def parse_pids(text: str, flag: str = "--pids") -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise AgentcellError(flag, f"'{text}' is not a positive number of tasks", f"e.g. {flag} 256")
    return int(text)


def parse(memory: str | None, cpu: str | None, pids: str | None, preset: str | None,
          base: tuple[int | None, int | None, int | None] = (None, None, None),
          ) -> tuple[int | None, int | None, int | None]:
    """The ceilings: ``base`` (a risk level's, or none), then ``preset`` (``ops1``), then each flag."""
    if preset not in (None, "ops1"):
        raise AgentcellError("--limits", f"unknown profile '{preset}'", "the one profile is ops1")
    mem, cpu_pct, tasks = OPS1 if preset == "ops1" else base
    if memory is not None:
        mem = parse_size(memory)
    if cpu is not None:
        cpu_pct = parse_cpu(cpu)
    if pids is not None:
        tasks = parse_pids(pids)
    return mem, cpu_pct, tasks


def describe(memory: int | None, cpu: int | None, pids: int | None) -> str:
    def size(n: int) -> str:
        return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"

    return (f"memory {size(memory) if memory else 'not capped'}, "
            f"cpu {f'{cpu}% of one CPU' if cpu else 'not capped'}, tasks {pids or 'not capped'}")
