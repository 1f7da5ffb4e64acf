"""Named allow-lists (``--allow-preset NAME``, repeatable; they add up with --allow-domain).

Each harness gets what it needs to reach its model API and sign in; each toolchain its registry.
Ports are 443 unless said. These are starting points kept in one place: a harness that moves its
endpoints shows up as a ``blocked:`` line naming the host to add.
"""
from __future__ import annotations

from ..errors import PolicyError

PRESETS: dict[str, tuple[str, ...]] = {
    # harnesses
    "claude_code": ("api.anthropic.com:443", "console.anthropic.com:443", "claude.ai:443",
                    "platform.claude.com:443"),  # the API; a subscription's login
    "codex": ("api.openai.com:443", "auth.openai.com:443", "chatgpt.com:443"),
    "opencode": ("opencode.ai:443", "models.dev:443", "api.anthropic.com:443", "api.openai.com:443",
                 "openrouter.ai:443"),
    "cursor": ("*.cursor.sh:443", "cursor.com:443", "*.cursor.com:443"),
    "aider": ("api.openai.com:443", "api.anthropic.com:443", "openrouter.ai:443"),
    "gemini": ("generativelanguage.googleapis.com:443", "cloudcode-pa.googleapis.com:443",
               "oauth2.googleapis.com:443", "accounts.google.com:443"),
    "copilot": ("github.com:443", "api.github.com:443", "api.githubcopilot.com:443", "*.githubcopilot.com:443",
                "api.mcp.github.com:443"),
    # toolchains
    "pypi": ("pypi.org:443", "files.pythonhosted.org:443"),
    "npm": ("registry.npmjs.org:443", "registry.yarnpkg.com:443"),
    "crates": ("crates.io:443", "index.crates.io:443", "static.crates.io:443"),
    "go": ("proxy.golang.org:443", "sum.golang.org:443", "storage.googleapis.com:443"),
    "github": ("github.com:443", "api.github.com:443", "codeload.github.com:443",
               "objects.githubusercontent.com:443", "raw.githubusercontent.com:443"),
}


def expand(names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        patterns = PRESETS.get(name.strip().lower())
        if patterns is None:
            raise PolicyError("--allow-preset", f"unknown preset '{name}'", "one of " + ", ".join(sorted(PRESETS)))
        out += patterns
    return out
