"""Harness profiles, as data: how to launch each agent CLI in a cell, and what it needs there.

Each profile was worked out by running the real CLI (pinned in ``tests/harnesses.py``) offline against
the scripted model endpoint (:mod:`.mockmodel`) on a fake internet, as a session runs it:

* **two launch lines**: ``interactive`` (its TUI: nothing after ``--``, or harness flags that start
  with ``-``) and ``prompt`` (the words after ``--`` are one prompt: a non-interactive turn);
* **env**: every switch that stops calls to hosts other than its model API (telemetry, update checks,
  plugin installs, model lists), set in the cell;
* **files**: settings it needs from the start, written for each session (:class:`SeedFile`): into the
  cell's home where the harness insists on reading them there (copied in where absent, so a persistent
  agent home keeps what the harness changed), else kept read-only beside the cell and named by a
  variable, so the agent cannot change its own settings;
* **--api-base URL**: what the harness really reads for its API's address (``api_base_env``,
  ``api_base_args``, files with ``{api_base}``), and the key variable it then needs; the URL's host is
  added to the allow-list;
* **protected**: the project files it reads as instructions or configuration (bound read-only in the
  cell, and quarantined when the agent creates them: :mod:`agentcell.protect`);
* ``secret_env``: the API-key variables passed in from the host (environment or ``.env``) for this
  harness only; ``egress_preset``: its allow-list under ``--net proxy``.

Templates (``{api_base}``, ``{api_base_v1}``: the URL with the API's ``/v1``, ``{model}``, ``{prompt}``)
are filled in by :func:`launch`.

``shell`` runs the command given after ``--``; ``scripted`` runs the bundled fake agent (:mod:`.scripted`)
with the system's Python: the script's text is handed over on the command line, so nothing of
agentcell needs to be visible inside the cell.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
from dataclasses import dataclass, field

from ..cell.spec import DEFAULT_PATH, SYSTEM_RO_PATHS
from ..errors import PolicyError

SCRIPT_MAX_BYTES = 64 * 1024
NO_KEY = "agentcell-no-key"  # the key variable's value with --api-base and no key: local servers want none


@dataclass(frozen=True)
class SeedFile:
    path: str  # relative to the home (home=True), else a file name in the session's seed directory
    content: str  # a template (see the module's doc)
    home: bool = True  # False: read-only in the seed directory, and ``env`` names it in the cell
    env: str | None = None
    needs_api_base: bool = False  # written only with --api-base


@dataclass(frozen=True)
class Profile:
    name: str
    title: str
    binary: str | None  # looked up before anything is created (see :func:`locate`); None: from the args
    interactive: tuple[str, ...] = ()  # the TUI's launch line (after the binary)
    prompt: tuple[str, ...] = ()  # one non-interactive turn (after the binary); "{prompt}" is the words
    install: str = ""  # the fix when the binary is missing
    home_dirs: tuple[str, ...] = ()  # made in the cell's home before the harness starts
    env: dict[str, str] = field(default_factory=dict)  # set in the cell
    secret_env: tuple[str, ...] = ()  # passed through from the host (env or .env) when set
    secret_as: dict[str, str] = field(default_factory=dict)  # a secret's name in the cell, where it differs
    # A flag that takes settings (JSON) outranking the project's own: the profile's env and the base URL go
    # there too, so a repository's settings file cannot switch them back; and the key helper, if any.
    settings_flag: str | None = None
    key_helper: str | None = None  # how the harness gets its key (in those settings), when the key is there
    egress_preset: str | None = None
    network: str = "proxy"  # the default when FIREWALL_ENABLED is off and no network is given
    api: str | None = None  # the model API it speaks: anthropic | responses | chat | gemini
    api_base_env: tuple[str, ...] = ()  # set to the URL with --api-base ("NAME" or "NAME={template}")
    api_base_args: tuple[str, ...] = ()  # added before the rest with --api-base (templates)
    api_key_env: str | None = None  # must hold a key with --api-base (NO_KEY when none is given)
    model_env: str | None = None  # set to --model
    model_args: tuple[str, ...] = ()  # added with --model (templates)
    needs_model: bool = False  # with --api-base a model must be named (its provider config lists one)
    files: tuple[SeedFile, ...] = ()
    protected: tuple[str, ...] = ()  # project entries it reads as configuration (protect/surface.py's names cover them)
    fenced: bool = False  # it declares no tools: the scripted endpoint plays shell steps as fenced blocks
    stdin_null: bool = False  # a prompt-mode turn reads stdin to its end: given /dev/null
    tested: bool = True  # False: not in any registry these machines reach (cursor): from its documentation
    # Its shell runs git with no system or global configuration (Gemini CLI: GIT_CONFIG_SYSTEM=/dev/null,
    # GIT_CONFIG_NOSYSTEM, its own GIT_CONFIG_COUNT): the session's safe directories go on git's command
    # line instead, through a git of the seed's first on PATH (agentcell.session.gitcell.wrapper)
    git_config_isolated: bool = False
    # programs it downloads from the internet when they are missing (OpenCode: ripgrep, from github.com)
    needs: tuple[str, ...] = ()


# First-run onboarding (which ignores the base URL and calls platform.claude.com) and the folder-trust
# dialog done; the bypass-permissions warning skipped. An API key in ANTHROPIC_API_KEY makes the TUI ask
# whether to use it (default: no): the key reaches the cell under another name, handed over by an
# apiKeyHelper instead, so no part of it is written anywhere.
# (Trust is looked up from the working directory up: "/" covers wherever the cell starts.)
CLAUDE_JSON = json.dumps({"hasCompletedOnboarding": True, "theme": "dark", "autoUpdates": False,
                          "projects": {"/": {"hasTrustDialogAccepted": True}}}, indent=2)
CLAUDE_SETTINGS = json.dumps({"skipDangerousModePermissionPrompt": True}, indent=2)
CLAUDE_KEY = "AGENTCELL_ANTHROPIC_API_KEY"

# Commits the agent makes name it (the human's identity is not in the cell); without one, git refuses to
# commit and aider writes one into .git/config, which is read-only in a cell (it then stops).
AIDER_SWITCHES = ("--no-check-update", "--no-analytics", "--no-show-release-notes", "--no-show-model-warnings",
                  "--no-gitignore", "--no-detect-urls")
# A model aider does not know: its size (no price-table download) and an edit format in which a fenced
# shell block is a command, not a file.
AIDER_METADATA = json.dumps({"openai/{model}": {"max_input_tokens": 128000, "max_output_tokens": 8192,
                                               "input_cost_per_token": 0, "output_cost_per_token": 0,
                                               "litellm_provider": "openai", "mode": "chat"}}, indent=2)
AIDER_SETTINGS = "- name: openai/{model}\n  edit_format: diff\n"

# ssh in a proxied cell: out through the proxy (it has no proxy client of its own), and with no key but
# one you give (-i, or IdentityFile in your own config): its default identities are where the decoys lie.
SSH_CONFIG = """# agentcell: ssh reaches only what the session's allow-list names (host:22), through its proxy
Host *
    ProxyCommand /usr/bin/python3 -I -S "$AGENTCELL_SEED/ssh-connect.py" %h %p
    IdentityFile none
    IdentitiesOnly yes
"""

# OpenCode: a provider of its own for --api-base, in the config variable that outranks every file but the
# managed one (a project's opencode.json outranks OPENCODE_CONFIG); bash and the rest allowed without
# asking (in `run` a question is a refusal). It npm-installs its plugin package into a config dir that
# has no node_modules and lock file naming it: a pre-filled one stops that.
OPENCODE_CONFIG = json.dumps({
    "$schema": "https://opencode.ai/config.json",
    "provider": {"agentcell": {"npm": "@ai-sdk/openai-compatible", "name": "agentcell",
                               "options": {"baseURL": "{api_base_v1}", "apiKey": "{env:OPENAI_API_KEY}"},
                               "models": {"{model}": {"name": "{model}", "tool_call": True,
                                                      "limit": {"context": 128000, "output": 8192}}}}},
    "enabled_providers": ["agentcell"], "model": "agentcell/{model}", "small_model": "agentcell/{model}",
    "autoupdate": False, "share": "disabled"}, separators=(",", ":"))
OPENCODE_LOCK = json.dumps({"lockfileVersion": 3, "packages": {"": {"dependencies": {"@opencode-ai/plugin": "*"}}}})
OPENCODE_PERMISSION = json.dumps({"*": "allow", "external_directory": "allow", "doom_loop": "allow"})

GEMINI_SETTINGS = json.dumps({
    "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
    "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
    "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False}, "ide": {"enabled": False},
    "ui": {"showCompatibilityWarnings": False},
}, indent=2)

PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("claude_code", "Claude Code", "claude",
            interactive=("--dangerously-skip-permissions",),
            prompt=("--dangerously-skip-permissions", "-p", "{prompt}"),
            install="npm install -g @anthropic-ai/claude-code",
            home_dirs=(".claude", ".config", ".cache"),
            env={"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
                 "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
                 # its plugin marketplace: downloads.claude.ai, and a git clone from github.com over ssh
                 "CLAUDE_CODE_DISABLE_OFFICIAL_MARKETPLACE_AUTOINSTALL": "1"},
            secret_env=("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"),
            secret_as={"ANTHROPIC_API_KEY": CLAUDE_KEY}, settings_flag="--settings",
            key_helper=f"printenv {CLAUDE_KEY}",
            egress_preset="claude_code", api="anthropic", api_base_env=("ANTHROPIC_BASE_URL",),
            api_key_env="ANTHROPIC_API_KEY", model_env="ANTHROPIC_MODEL",
            files=(SeedFile(".claude.json", CLAUDE_JSON), SeedFile(".claude/settings.json", CLAUDE_SETTINGS)),
            protected=(".claude", ".mcp.json", "CLAUDE.md")),
    Profile("codex", "Codex CLI", "codex",
            interactive=("--dangerously-bypass-approvals-and-sandbox", "--disable", "plugins",
                         "-c", "analytics.enabled=false"),
            prompt=("exec", "--dangerously-bypass-approvals-and-sandbox", "--skip-git-repo-check", "--ephemeral",
                    "--disable", "plugins", "-c", "analytics.enabled=false", "{prompt}"),
            install="npm install -g @openai/codex", home_dirs=(".codex", ".cache"),
            secret_env=("OPENAI_API_KEY", "CODEX_API_KEY"), egress_preset="codex", api="responses",
            # Codex reads no base-URL variable: a provider of its own, with no WebSocket transport.
            api_base_args=("-c", "model_provider=agentcell", "-c",
                           'model_providers.agentcell={name="agentcell",base_url="{api_base_v1}",'
                           'env_key="OPENAI_API_KEY",wire_api="responses",supports_websockets=false}'),
            # Its default model through a provider of another name is sent with no tools at all: a model is named.
            api_key_env="OPENAI_API_KEY", model_args=("-m", "{model}"), needs_model=True, stdin_null=True,
            protected=(".codex", "AGENTS.md")),
    Profile("opencode", "OpenCode", "opencode", interactive=(), prompt=("run", "{prompt}"),
            install="npm install -g opencode-ai",
            home_dirs=(".local/share/opencode", ".config/opencode/node_modules", ".cache/opencode"),
            env={"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
                 "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
                 "OPENCODE_PERMISSION": OPENCODE_PERMISSION},
            secret_env=("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "OPENROUTER_API_KEY"), egress_preset="opencode",
            api="chat", api_base_env=("OPENCODE_CONFIG_CONTENT=" + OPENCODE_CONFIG,), api_key_env="OPENAI_API_KEY",
            model_args=("-m", "agentcell/{model}"), needs_model=True, stdin_null=True, needs=("rg",),
            files=(SeedFile(".config/opencode/package-lock.json", OPENCODE_LOCK),),
            protected=(".opencode", "opencode.json", "opencode.jsonc", "AGENTS.md")),
    Profile("cursor", "Cursor CLI", "cursor-agent", interactive=("--force",), prompt=("--print", "--force",
                                                                                        "{prompt}"),
            install="curl https://cursor.com/install -fsS | bash (as a system-wide install)",
            home_dirs=(".cursor", ".config/cursor"), secret_env=("CURSOR_API_KEY",), egress_preset="cursor",
            protected=(".cursor", ".cursorrules", "AGENTS.md"), tested=False),
    # --message is one model turn; its shell blocks run once answered: an empty stdin answers every
    # question with its default, Yes (--yes-always answers No to shell commands). So every question that
    # would reach a host (URLs, updates, analytics) is switched off. The base URL is a flag: aider loads
    # .env files over its environment.
    Profile("aider", "aider", "aider", interactive=AIDER_SWITCHES,
            prompt=(*AIDER_SWITCHES, "--no-fancy-input", "--message", "{prompt}"),
            install="pip install aider-chat (system-wide)", home_dirs=(".aider", ".cache"),
            env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"},
            secret_env=("OPENAI_API_KEY", "ANTHROPIC_API_KEY"), egress_preset="aider",
            api="chat", api_base_args=("--openai-api-base", "{api_base_v1}"), api_key_env="OPENAI_API_KEY",
            model_args=("--model", "openai/{model}"), needs_model=True, fenced=True, stdin_null=True,
            files=(SeedFile(".aider.model.metadata.json", AIDER_METADATA, needs_api_base=True),
                   SeedFile(".aider.model.settings.yml", AIDER_SETTINGS, needs_api_base=True)),
            protected=(".aider.conf.yml", ".aider.model.settings.yml", ".aider.model.metadata.json")),
    # API-key auth chosen in its settings (a base URL alone selects a "gateway" auth that -p refuses), usage
    # statistics off (play.googleapis.com), folder trust off (else --yolo is dropped and -p exits 55), and no
    # relaunch of itself with half the host's memory as its heap.
    Profile("gemini", "Gemini CLI", "gemini", interactive=("--yolo",), prompt=("--yolo", "-p", "{prompt}"),
            install="npm install -g @google/gemini-cli", home_dirs=(".gemini",),
            env={"GEMINI_CLI_NO_RELAUNCH": "true"},
            secret_env=("GEMINI_API_KEY", "GOOGLE_API_KEY"), egress_preset="gemini",
            api="gemini", api_base_env=("GOOGLE_GEMINI_BASE_URL",), api_key_env="GEMINI_API_KEY",
            model_args=("-m", "{model}"), files=(SeedFile(".gemini/settings.json", GEMINI_SETTINGS),),
            protected=(".gemini", "GEMINI.md"), git_config_isolated=True),
    # Its own provider mode (COPILOT_PROVIDER_*, offline: no GitHub at all) with --api-base; without, its GitHub
    # login. The update check and client telemetry go to api.github.com unless switched off.
    Profile("copilot", "GitHub Copilot CLI", "copilot",
            interactive=("--allow-all", "--no-auto-update", "--disable-client-telemetry"),
            prompt=("-p", "{prompt}", "--allow-all", "--no-auto-update", "--disable-client-telemetry"),
            install="npm install -g @github/copilot", home_dirs=(".copilot", ".cache"),
            # its own token variable only: GH_TOKEN and GITHUB_TOKEN are usually a person's or a CI's, for all of GitHub
            secret_env=("COPILOT_GITHUB_TOKEN", "COPILOT_PROVIDER_API_KEY"),
            egress_preset="copilot", api="chat",
            api_base_env=("COPILOT_PROVIDER_BASE_URL={api_base_v1}", "COPILOT_OFFLINE=true"),
            model_env="COPILOT_MODEL", needs_model=True,
            protected=(".github/copilot-instructions.md", ".copilot", "AGENTS.md")),
    Profile("shell", "a command", None, network="none"),
    Profile("scripted", "the bundled scripted agent", "python3", prompt=("-I", "-S", "-c"), network="none",
            install="apt-get install python3"),
)}

HARNESSES = tuple(n for n in PROFILES if n not in ("shell", "scripted"))

# Where each API key goes at its own provider, and in which request header: a session with the proxy
# binds it there (and to --api-base's host, in any of the headers keys travel in) and the cell holds a
# placeholder (agentcell.network.credentials). A key not listed here enters the cell as it is.
KEY_HOSTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "ANTHROPIC_API_KEY": (("api.anthropic.com",), ("x-api-key", "authorization")),
    "ANTHROPIC_AUTH_TOKEN": (("api.anthropic.com",), ("authorization",)),
    "OPENAI_API_KEY": (("api.openai.com",), ("authorization",)),
    "CODEX_API_KEY": (("api.openai.com",), ("authorization",)),
    "OPENROUTER_API_KEY": (("openrouter.ai",), ("authorization",)),
    "GEMINI_API_KEY": (("generativelanguage.googleapis.com",), ("x-goog-api-key",)),
    "GOOGLE_API_KEY": (("generativelanguage.googleapis.com",), ("x-goog-api-key",)),
    "CURSOR_API_KEY": (("api2.cursor.sh",), ("authorization",)),
    "COPILOT_GITHUB_TOKEN": (("api.githubcopilot.com", "api.github.com"), ("authorization",)),
    "COPILOT_PROVIDER_API_KEY": ((), ("authorization", "api-key")),  # its provider is --api-base's
}
KEY_HEADERS = ("authorization", "x-api-key", "x-goog-api-key", "api-key")  # what a gateway may read a key from


def key_bindings(profile: Profile, names: tuple[str, ...], api_base: str | None) -> dict[
        str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Where each of ``names`` (the session's keys, by their names on the host) may go, by the name the
    cell knows it by: its provider (KEY_HOSTS) and, with --api-base, that URL's host for every key of the
    profile (``http://HOST`` for an http:// URL: a gateway without TLS gets it over plain HTTP). Keys
    bound nowhere are left out."""
    base = None
    if api_base:
        from urllib.parse import urlsplit

        url = urlsplit(api_base.strip())
        base = ("http://" if url.scheme == "http" else "") + (url.hostname or "")
    out = {}
    for name in names:
        hosts, headers = KEY_HOSTS.get(name, ((), ()))
        if base and name in profile.secret_env:
            hosts, headers = (*hosts, base), tuple(dict.fromkeys((*headers, *KEY_HEADERS)))
        if hosts:
            out[profile.secret_as.get(name, name)] = (tuple(dict.fromkeys(hosts)), headers)
    return out


def get(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise PolicyError("harness", f"unknown harness '{name}'", "one of " + ", ".join(PROFILES)) from None


# ---- where the harness is, as the cell sees it ----------------------------------------------------

def visible(path: str) -> bool:
    """Whether the cell can see ``path`` (resolved): only the system directories are bound into it."""
    real = os.path.realpath(path)
    return any(real == d or real.startswith(d + "/") for d in SYSTEM_RO_PATHS)


def _runnable_by_others(path: str) -> bool:
    """Executable (and its directories searchable) for an account that is neither its owner nor root's
    group: the cell's account is an agent's."""
    real = os.path.realpath(path)
    try:
        if not os.stat(real).st_mode & stat.S_IXOTH:
            return False
        d = os.path.dirname(real)
        while d != "/":
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
            d = os.path.dirname(d)
    except OSError:
        return False
    return True


def _interpreter(path: str) -> list[str] | None:
    """A script's ``#!`` line, split (None: not a script)."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    return head[2:].split(b"\n", 1)[0].decode("utf-8", "replace").split()


def locate(binary: str, *, field_name: str, install: str, title: str = "", search_path: str | None = None
           ) -> tuple[str, str]:
    """Where ``binary`` is (found on the invoking user's PATH, then the cell's), checked the way the
    cell will run it: the file, its links resolved, its ``#!`` interpreter (through ``env``) all in
    what the cell sees, executable by another account. Returns (the path to run, the cell's PATH).
    Raises a one-line PolicyError naming the fix before anything is created."""
    where = ":".join(p for p in ((search_path or os.environ.get("PATH", "")).split(":") + DEFAULT_PATH.split(":"))
                     if p and os.path.isabs(p))
    found = shutil.which(binary, path=where)
    if found is None:
        named = f"{binary} ({title})" if title else binary
        raise PolicyError(field_name, f"{named} is not installed (not on PATH)", f"install it: {install}")
    path_dirs = [os.path.dirname(found), *DEFAULT_PATH.split(":")]
    chain = [found]
    interp = _interpreter(os.path.realpath(found))
    if interp:
        prog = interp[0]
        if os.path.basename(prog) == "env" and len(interp) > 1:
            name = next((a for a in interp[1:] if not a.startswith("-") and "=" not in a), "")
            prog = shutil.which(name, path=":".join(dict.fromkeys(path_dirs))) or name
            if not os.path.isabs(prog):
                raise PolicyError(field_name, f"{found} runs '{name}', which is on no PATH the cell has "
                                  f"({':'.join(dict.fromkeys(path_dirs))})", f"install {name} system-wide")
            path_dirs.append(os.path.dirname(prog))
        chain.append(prog)
    for p in chain:
        if not visible(p):
            raise PolicyError(field_name, f"{p} is {os.path.realpath(p)}, which the cell cannot see (it sees only "
                              f"{', '.join(SYSTEM_RO_PATHS)})",
                              f"install it where the cell can run it: {install}, or under /opt or /usr/local")
        if not _runnable_by_others(p):
            raise PolicyError(field_name, f"{os.path.realpath(p)} is not executable by the agent's account (it or "
                              "a directory above it has no execute bit for others)", "chmod o+rx it")
    return found, ":".join(dict.fromkeys(path_dirs))


# ---- the launch ------------------------------------------------------------------------------------

class Launch:
    """What a session runs for a harness: the argv (wrapped so the account makes its home dirs and
    copies its settings in first), the environment the profile sets, the files of the seed directory."""

    def __init__(self, argv: list[str], env: dict[str, str], files: list[SeedFile], path: str | None,
                 interactive: bool, api_host: str | None, renames: dict[str, str] | None = None,
                 notes: list[str] | None = None) -> None:
        self.argv, self.env, self.files, self.path = argv, env, files, path
        self.interactive, self.api_host = interactive, api_host
        self.renames = renames or {}  # secret name on the host -> its name in the cell
        self.notes = notes or []  # what the user should know before it starts

    def as_dict(self) -> dict[str, object]:
        """Without the argv (the session keeps that on its own)."""
        return {"env": self.env, "path": self.path, "interactive": self.interactive, "api_host": self.api_host,
                "files": [{"path": f.path, "content": f.content, "home": f.home, "env": f.env} for f in self.files]}


def api_base_parts(url: str) -> tuple[str, str]:
    """``--api-base`` checked: (the URL without a trailing slash or API version, host:port)."""
    from urllib.parse import urlsplit

    from ..network.rules import _is_ip

    try:
        u = urlsplit(url.strip())
        port = u.port
    except ValueError as e:
        raise PolicyError("--api-base", f"'{url}' is not a URL ({e})",
                          "e.g. --api-base https://gateway.example:8443") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise PolicyError("--api-base", f"'{url}' is not an http:// or https:// URL with a host",
                          "e.g. --api-base https://gateway.example:8443")
    if u.username or u.password or u.query or u.fragment:
        raise PolicyError("--api-base", "the URL carries credentials, a query or a fragment",
                          "give the bare URL; pass the key in its variable (e.g. ANTHROPIC_API_KEY)")
    # It becomes an allow-list entry, a variable, a TOML string (Codex) and JSON (OpenCode): one host by
    # its name or address, no wildcard, nothing that quotes or escapes.
    name = u.hostname
    if port == 0 or "*" in url or not all(c.isascii() and (c.isalnum() or c in ":/._-~%[]") for c in url.strip()) \
            or not (_is_ip(name) or (name.replace("-", "").replace(".", "").isalnum()
                                          and not name.replace(".", "").isdigit() and not name.startswith("0x"))):
        raise PolicyError("--api-base", f"'{url[:120]}' is not one host's URL (a name or an address; no wildcard, "
                          "no quotes or braces, a port above 0)", "e.g. --api-base https://gateway.example:8443")
    base = f"{u.scheme}://{u.netloc}{u.path}".rstrip("/")
    for suffix in ("/v1beta", "/v1"):
        base = base.removesuffix(suffix)
    host = u.hostname if ":" not in u.hostname else f"[{u.hostname}]"
    return base, f"{host}:{port or (443 if u.scheme == 'https' else 80)}"


def _fill(template: str, values: dict[str, str], *, as_json: bool = False) -> str:
    """``{name}`` replaced by its value (JSON-escaped in a JSON file); other braces stay as they are."""
    for k, v in values.items():
        template = template.replace("{" + k + "}", json.dumps(v)[1:-1] if as_json else v)
    return template


def _network_files(network: str | None, seed_dir: str) -> list[SeedFile]:
    if network != "proxy":
        return []
    from . import sshproxy

    with open(sshproxy.__file__, encoding="utf-8") as f:
        connector = f.read()
    # The config names the seed by a variable: a persistent home keeps the file, the seed moves each session.
    return [SeedFile(".ssh/config", SSH_CONFIG), SeedFile("ssh-connect.py", connector, home=False)]


def launch(profile: Profile, harness_args: tuple[str, ...] | list[str], *, seed_dir: str,
           api_base: str | None = None, model: str | None = None, secrets: tuple[str, ...] = (),
           home_from: bool = False, network: str | None = None, search_path: str | None = None) -> Launch:
    """The launch of ``profile`` with the words after ``--``. Raises PolicyError (before anything is
    created) when the harness is missing or its arguments do not fit. ``seed_dir``: where the
    session's seed directory is (in the cell too); ``home_from``: it holds a home to start from;
    ``network``: the session's (a proxied cell gets ssh's way through the proxy)."""
    args = list(harness_args)
    net_files = _network_files(network, seed_dir)
    net_env = {"AGENTCELL_SEED": seed_dir} if net_files else {}
    if profile.name == "shell":
        if not args:
            raise PolicyError("harness shell", "no command given", "put it after --, e.g. session start -- make test")
        if "/" not in args[0] and shutil.which(args[0], path=DEFAULT_PATH) is None:
            raise PolicyError("harness shell", f"{args[0]} is not on the cell's PATH ({DEFAULT_PATH})",
                              "install it system-wide, or give its path inside a declared directory")
        return Launch(_wrapped(profile, args, net_files, seed_dir, home_from=home_from), net_env, net_files, None, True,
                      None)
    assert profile.binary is not None
    if profile.name == "scripted":
        found, _ = locate(profile.binary, field_name="harness scripted", install=profile.install,
                          search_path=DEFAULT_PATH)
        argv = [found, *profile.prompt, scripted_source(), *script_args(args)]
        return Launch(_wrapped(profile, argv, net_files, seed_dir, home_from=home_from), net_env, net_files, None,
                      False, None)
    found, cell_path = locate(profile.binary, field_name=f"harness {profile.name}", install=profile.install,
                              title=profile.title, search_path=search_path)
    values = {"model": model or ""}
    env = {**profile.env, **net_env}
    extra: list[str] = []
    api_host = None
    if api_base is not None:
        if profile.api is None:
            raise PolicyError("--api-base", f"{profile.title} has no model API agentcell knows how to point",
                              "leave --api-base out")
        base, api_host = api_base_parts(api_base)
        values.update(api_base=base, api_base_v1=base + ("/v1" if profile.api in ("responses", "chat") else ""))
        for item in profile.api_base_env:
            name, eq, template = item.partition("=")
            env[name] = _fill(template, values, as_json=template.startswith("{")) if eq else base
        extra += [_fill(a, values, as_json=True) for a in profile.api_base_args]  # Codex's TOML takes JSON escapes
        if profile.needs_model and not model:
            raise PolicyError("--model", f"{profile.title} needs a model name with --api-base",
                              "name the model your endpoint serves, e.g. --model gpt-4.1")
        if profile.api_key_env and profile.api_key_env not in secrets:
            env[profile.secret_as.get(profile.api_key_env, profile.api_key_env)] = NO_KEY
    if values["model"]:
        if profile.model_env:
            env[profile.model_env] = values["model"]
        extra += [_fill(a, values) for a in profile.model_args]
    settings_file: list[SeedFile] = []
    if profile.settings_flag:  # a file of the seed: read-only, and not on a command line any local user reads
        key = profile.secret_as.get(profile.api_key_env or "", profile.api_key_env)
        settings: dict[str, object] = {"env": {k: v for k, v in env.items() if k != key}}
        if profile.key_helper and (profile.api_key_env in secrets or api_base is not None):
            settings["apiKeyHelper"] = profile.key_helper
        settings_file = [SeedFile(f"{profile.name}-settings.json", json.dumps(settings, indent=2), home=False)]
        extra += [profile.settings_flag, os.path.join(seed_dir, settings_file[0].path)]
    files = [SeedFile(f.path, _fill(f.content, values, as_json=f.path.endswith(".json")), f.home, f.env)
             for f in profile.files if api_base is not None or not f.needs_api_base] + net_files + settings_file
    for f in files:
        if not f.home and f.env:
            env[f.env] = os.path.join(seed_dir, f.path)
    interactive = not args or args[0].startswith("-")
    if interactive:
        argv = [found, *extra, *profile.interactive, *args]
    else:
        words = " ".join(args)
        argv = [found, *extra, *(words if a == "{prompt}" else a for a in profile.prompt)]
    wrapped = _wrapped(profile, argv, files, seed_dir, home_from=home_from,
                       stdin_null=profile.stdin_null and not interactive)
    notes = [f"{profile.title} downloads {need} from the internet when it is missing (the session ends there "
             f"if its host is not allowed): install {need} system-wide" for need in profile.needs
             if shutil.which(need, path=cell_path) is None]
    return Launch(wrapped, env, files, cell_path if cell_path != DEFAULT_PATH else None, interactive, api_host,
                  {k: v for k, v in profile.secret_as.items() if k in secrets}, notes)


def _wrapped(profile: Profile, argv: list[str], files: list[SeedFile], seed_dir: str, *, home_from: bool,
             stdin_null: bool = False) -> list[str]:
    """The account itself, in its own home, just before the harness starts: copies in the home it
    starts from (``--home-from``), makes the profile's directories and copies in the settings files
    it does not have yet (a persistent home keeps what the harness changed)."""
    lines = []
    if home_from:
        lines.append(f'cp -Rp {shlex.quote(os.path.join(seed_dir, "from"))}/. "$HOME"/')
    if profile.home_dirs:
        lines.append("mkdir -p " + " ".join(f'"$HOME"/{shlex.quote(d)}' for d in profile.home_dirs))
    for f in files:
        if f.home:
            src, dst = shlex.quote(os.path.join(seed_dir, "home", f.path)), f'"$HOME"/{shlex.quote(f.path)}'
            lines.append(f'{{ [ -e {dst} ] || {{ mkdir -p "$(dirname {dst})" && cp {src} {dst}; }}; }}')
    if not lines and not stdin_null:
        return argv
    lines.append('exec "$@"' + (" </dev/null" if stdin_null else ""))
    return ["/bin/sh", "-c", " && ".join(lines), profile.name, *argv]


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
    from ..hostfs import read_regular

    text = read_regular(args[0], "harness scripted", "give a small script file (not a link)",
                        SCRIPT_MAX_BYTES).decode("utf-8", errors="replace")
    return ["--text", text]
