"""The real harness CLIs the tests and benches run, pinned, installed from their registries into a
directory the cell can see (/opt is bound read-only into every cell) and kept there between runs.

``bin_dir(name)`` installs one if it is not there yet and returns the directory to put first on PATH;
a registry that cannot be reached raises :class:`Unavailable` (the tests skip with its reason). An
install is complete only once its stamp is written, so one cut short is made again.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(os.environ.get("AGENTCELL_HARNESS_CACHE", "/opt/agentcell-test/harnesses"))
# name: (registry, package, version, binary)
PINS: dict[str, tuple[str, str, str, str]] = {
    "claude_code": ("npm", "@anthropic-ai/claude-code", "2.1.197", "claude"),
    "codex": ("npm", "@openai/codex", "0.171.0", "codex"),
    "opencode": ("npm", "opencode-ai", "1.18.33", "opencode"),
    "gemini": ("npm", "@google/gemini-cli", "0.61.0", "gemini"),
    "copilot": ("npm", "@github/copilot", "1.0.102", "copilot"),
    "aider": ("pypi", "aider-chat", "0.86.2", "aider"),
}
REAL = tuple(PINS)
# Tools the benign corpus runs in a cell (tests/test_benign.py), kept the same way.
TOOLS: dict[str, tuple[str, str, str, str]] = {"pytest": ("pypi", "pytest", "8.3.4", "pytest"),
                                               "uv": ("pypi", "uv", "0.13.9", "uv")}


class Unavailable(Exception):
    """The harness cannot be installed here (its registry is out of reach, npm is missing)."""


def home(name: str) -> Path:
    registry, package, version, _ = {**PINS, **TOOLS}[name]
    return ROOT / f"{registry}-{package.replace('@', '').replace('/', '_')}-{version}"


def bin_dir(name: str) -> Path:
    registry, package, version, binary = {**PINS, **TOOLS}[name]
    where = home(name)
    stamp = where / ".agentcell-installed"
    bindir = where / ("node_modules/.bin" if registry == "npm" else "bin")
    if stamp.exists() and (bindir / binary).exists():
        return bindir
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True, mode=0o755)
    os.chmod(ROOT, 0o755)
    if registry == "npm":
        if shutil.which("npm") is None:
            raise Unavailable("npm is not installed (test.sh installs it)")
        cmd = ["npm", "install", "--prefix", str(where), "--no-audit", "--no-fund", "--loglevel=error",
               f"{package}@{version}"]
    else:  # a venv of the system's Python: the cell runs /usr/bin/python3, never an interpreter under /root
        made = subprocess.run(["/usr/bin/python3", "-m", "venv", str(where)], capture_output=True, text=True)
        if made.returncode != 0:
            raise Unavailable(f"python3 -m venv failed: {made.stderr.strip()[-300:]}")
        cmd = [str(where / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", f"{package}=={version}"]
    # Installers and the postinstall checks they run (opencode --version makes /tmp/opencode) write their
    # scratch in a directory of the install's own, removed after it: nothing is left in /tmp.
    scratch = tempfile.mkdtemp(prefix="agentcell-install-")
    env = {**os.environ, "TMPDIR": scratch}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
        if p.returncode != 0:
            shutil.rmtree(where, ignore_errors=True)
            tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
            raise Unavailable(f"{registry} install of {package}@{version} failed (registry out of reach?): "
                              + " | ".join(tail))
        if name == "copilot":  # it unpacks its 235 MB runtime into HOME at every start unless it finds it here
            subprocess.run([str(bindir / binary), "--version"], env={**env, "COPILOT_PKG_CACHE_HOME":
                                                                      str(copilot_pkg(name))},
                           capture_output=True, timeout=300, check=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    subprocess.run(["chmod", "-R", "a+rX", str(where)], check=True)
    stamp.write_text(f"{package}@{version}\n")
    return bindir


def copilot_pkg(name: str = "copilot") -> Path:
    return home(name) / "pkg"


def session_env(name: str) -> list[str]:
    """What a session of ``name`` is given beyond the profile on this machine (``--env`` flags)."""
    return ["--env", f"COPILOT_PKG_CACHE_HOME={copilot_pkg()}"] if name == "copilot" else []
