"""Plans (a plain one, compiled into a cell spec; a session's, compiled into a sandbox policy) and escape events.

The names below are imported lazily: ``agentcell run`` imports :mod:`agentcell.policy.resolve`
through this package and must not pay for pydantic.
"""
from __future__ import annotations

TYPE_CHECKING = False  # not from typing: it costs ~10 ms on the agentcell run path (see cell/spec.py)
if TYPE_CHECKING:
    from typing import Any

    from .compile import FIREWALL_RULES, compile_plan, explain, load_plan
    from .models import EscapeEvent, IdentityModel, Limits, SandboxPolicy, SessionPlan
    from .plan import Plan, compile_spec

_WHERE = {
    "EscapeEvent": "models",
    "IdentityModel": "models",
    "Limits": "models",
    "SandboxPolicy": "models",
    "SessionPlan": "models",
    "FIREWALL_RULES": "compile",
    "compile_plan": "compile",
    "explain": "compile",
    "load_plan": "compile",
    "Plan": "plan",
    "compile_spec": "plan",
}

__all__ = [
    "FIREWALL_RULES",
    "EscapeEvent",
    "IdentityModel",
    "Limits",
    "Plan",
    "SandboxPolicy",
    "SessionPlan",
    "compile_plan",
    "compile_spec",
    "explain",
    "load_plan",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(__import__(f"{__name__}.{module}", fromlist=[name]), name)  # importlib: ~0.6 ms
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
