"""Harness profiles, as data: how to launch each agent CLI in a cell and what it needs there.

Facts from FIELD_NOTES.md ("Harness facts"): each harness writes config and state under HOME (the cell's
home is a private tmpfs the account owns, so these are writable; a profile names the dirs it creates
there), some need a writable ``/tmp`` (the cell has one), and each has settings that stop calls to hosts
other than its model API (set here as environment variables). The API-key variables are passed into
the cell only for the harness that reads them. ``egress_preset`` is the domain allow-list
(:mod:`agentcell.network.presets`) used when the session's network is ``proxy``.

``shell`` runs the command given after ``--``; ``scripted`` runs the bundled fake agent
(:mod:`.scripted`) with system Python: the script's text is handed over on the command line, so nothing
of agentcell needs to be visible inside the cell.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

from ..cell.spec import DEFAULT_PATH, SYSTEM_RO_PATHS
from ..errors import PolicyError

SCRIPT_MAX_BYTES = 64 * 1024


@dataclass(frozen=True)
class Profile:
    name: str
    title: str
    binary: str | None  # looked up on the cell's PATH before anything is created; None: from the args
    argv: tuple[str, ...]  # the launch command before the harness args
    install: str = ""  # the fix when the binary is missing
    home_dirs: tuple[str, ...] = ()  # made in the cell's home before the harness starts
    env: dict[str, str] = field(default_factory=dict)  # set in the cell
    secret_env: tuple[str, ...] = ()  # passed through from the host (env or .env) when set
    egress_preset: str | None = None
    network: str = "proxy"  # the default when FIREWALL_ENABLED is off and no network is given


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("claude_code", "Claude Code", "claude", ("claude", "--dangerously-skip-permissions"),
            install="npm install -g @anthropic-ai/claude-code",
            home_dirs=(".claude", ".config", ".cache"),
            env={"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"},
            secret_env=("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL"),
            egress_preset="claude_code"),
    Profile("codex", "Codex CLI", "codex",
            ("codex", "exec", "--dangerously-bypass-approvals-and-sandbox", "--disable", "plugins",
             "-c", "analytics.enabled=false"),
            install="npm install -g @openai/codex", home_dirs=(".codex", ".cache"),
            secret_env=("OPENAI_API_KEY", "OPENAI_BASE_URL"), egress_preset="codex"),
    Profile("opencode", "OpenCode", "opencode", ("opencode", "run"), install="npm install -g opencode-ai",
            home_dirs=(".local/share/opencode", ".config/opencode", ".cache/opencode"),
            env={"OPENCODE_DISABLE_MODELS_FETCH": "1"},
            secret_env=("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "OPENROUTER_API_KEY"), egress_preset="opencode"),
    Profile("cursor", "Cursor CLI", "cursor-agent", ("cursor-agent", "--print", "--force"),
            install="curl https://cursor.com/install -fsS | bash (as a system-wide install)",
            home_dirs=(".cursor", ".config/cursor"), secret_env=("CURSOR_API_KEY",), egress_preset="cursor"),
    Profile("aider", "aider", "aider", ("aider", "--yes-always", "--no-check-update", "--no-show-release-notes"),
            install="pip install aider-chat (system-wide)", home_dirs=(".aider", ".cache"),
            secret_env=("OPENAI_API_KEY", "OPENAI_API_BASE", "ANTHROPIC_API_KEY"), egress_preset="aider"),
    Profile("gemini", "Gemini CLI", "gemini", ("gemini", "--yolo"), install="npm install -g @google/gemini-cli",
            home_dirs=(".gemini",), secret_env=("GEMINI_API_KEY", "GOOGLE_API_KEY", "GOOGLE_GEMINI_BASE_URL"),
            egress_preset="gemini"),
    Profile("shell", "a command", None, (), network="none"),
    Profile("scripted", "the bundled scripted agent", "python3", ("python3", "-I", "-S", "-c"), network="none",
            install="apt-get install python3"),
)}


def get(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise PolicyError("harness", f"unknown harness '{name}'", "one of " + ", ".join(PROFILES)) from None


def cell_which(binary: str) -> str | None:
    """Where ``binary`` is on the cell's PATH, if the cell can see it (system directories only)."""
    found = shutil.which(binary, path=DEFAULT_PATH)
    if found is None:
        return None
    real = os.path.realpath(found)
    visible = any(real == d or real.startswith(d + "/") for d in SYSTEM_RO_PATHS)
    return found if visible else None


def command(profile: Profile, harness_args: tuple[str, ...] | list[str]) -> list[str]:
    """The argv the cell runs. Raises PolicyError (before anything is created) when the harness is
    missing or its arguments do not fit."""
    args = list(harness_args)
    if profile.name == "shell":
        if not args:
            raise PolicyError("harness shell", "no command given", "put it after --, e.g. session start -- make test")
        if "/" not in args[0] and cell_which(args[0]) is None:
            raise PolicyError("harness shell", f"{args[0]} is not on the cell's PATH ({DEFAULT_PATH})",
                              "install it system-wide, or give its path inside a declared directory")
        return args
    assert profile.binary is not None
    if cell_which(profile.binary) is None:
        raise PolicyError(f"harness {profile.name}", f"{profile.binary} ({profile.title}) is not installed where the "
                          f"cell can run it (the cell's PATH: {DEFAULT_PATH})", f"install it: {profile.install}")
    if profile.name == "scripted":
        return [*profile.argv, scripted_source(), *script_args(args)]
    argv = [*profile.argv, *args]
    if profile.home_dirs:  # made by the account itself, in its own home, just before the harness starts
        dirs = " ".join(f'"$HOME/{d}"' for d in profile.home_dirs)
        argv = ["/bin/sh", "-c", f'mkdir -p {dirs} && exec "$@"', profile.name, *argv]
    return argv


def scripted_source() -> str:
    from . import scripted

    with open(scripted.__file__, encoding="utf-8") as f:
        return f.read()


def script_args(args: list[str]) -> list[str]:
    """``SCRIPT`` (a file read here, its text handed over) or ``--text STEPS``."""
    if args[:1] == ["--text"] and len(args) == 2:
        return ["--text", args[1]]
    if len(args) != 1:
        raise PolicyError("harness scripted", "expects one script file after --",
                          "e.g. session start --harness scripted -- steps.txt")
    path = args[0]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise PolicyError("harness scripted", f"cannot open the script {path}: {e.strerror}",
                          "give a readable script file (not a symlink)") from None
    try:
        st = os.fstat(fd)
        import stat

        if not stat.S_ISREG(st.st_mode) or st.st_size > SCRIPT_MAX_BYTES:
            raise PolicyError("harness scripted", f"{path} is not a regular file of at most {SCRIPT_MAX_BYTES} bytes",
                              "give a small script file")
        text = os.read(fd, SCRIPT_MAX_BYTES + 1).decode("utf-8", errors="replace")
    finally:
        os.close(fd)
    return ["--text", text]
