"""A session's options beyond its project, paths and network: the model endpoint and name, the risk and
the ceilings, the caches, the workspace, the cell's environment (what a file in the project may not set
there), the home an ephemeral account starts from, the identity the agent commits as."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import PolicyError
from .sources import FLAGS, _inside

# What configures a harness or the programs it runs, by the prefixes their variables share: a file in
# the project sets none of them (where keys go, config directories, endpoints, TLS trust, preloads).
HARNESS_PREFIXES = ("CLAUDE", "ANTHROPIC", "CODEX", "OPENAI", "OPENCODE", "GEMINI", "GOOGLE", "COPILOT", "GH_",
                    "GITHUB", "AIDER", "LITELLM", "CURSOR", "OTEL", "NODE", "NPM_", "LD_", "GIT_", "SSL_", "SSH_",
                    "PYTHON", "AGENTCELL", "XDG_", "AWS_", "AZURE_", "VERTEX", "OPENROUTER", "OPENSSL", "GLIBC_",
                    "JAVA_", "_JAVA", "CURL_", "REQUESTS_", "PERL5", "RUBY", "BASH_FUNC")
CELL_NAMES = ("PATH", "HOME", "USER", "SHELL", "TMPDIR", "ENV", "BASH_ENV", "CDPATH", "IFS", "PS4", "TERM",
              "HOSTALIASES", "SHELLOPTS", "BASHOPTS", "LOCALDOMAIN", "RES_OPTIONS")


def _configures_harness(name: str, profile: Any) -> bool:
    """What a file in the project may not set in the cell: how the harness is configured (its keys,
    base URLs, model, proxies, config directories, the switches its profile sets), how the programs it
    runs are (node, python, git, ssh, TLS, the loader), and the cell's own variables."""
    upper = name.upper()
    own = {*profile.secret_env, *profile.env, *(e.partition("=")[0] for e in profile.api_base_env),
           *(v for v in (profile.api_key_env, profile.model_env) if v), *(f.env for f in profile.files if f.env)}
    return upper != "NODE_ENV" and (
        name in own or upper in CELL_NAMES or upper.startswith(HARNESS_PREFIXES) or upper.endswith("_PROXY")
        or "BASE_URL" in upper or "API_BASE" in upper or "ENDPOINT" in upper or upper.endswith("_API_KEY"))


def _harness_knobs(values: dict[str, Any], sources: dict[str, str], flags: Mapping[str, Any], pick: Any,
                   by_file: Any, toml: dict[str, Any], toml_where: str, profile: Any, root: str) -> None:
    """--api-base, --model, --risk and the ceilings, --env and [session] env, --keep-env, --home-from."""
    from .. import limits
    from ..errors import AgentcellError
    from ..harness.profiles import api_base_parts
    from ..policy.resolve import is_env_name

    if (got := pick("api_base", "AGENT_API_BASE")) is not None:
        value, where = got
        try:
            api_base_parts(str(value))
        except PolicyError as e:
            raise PolicyError(where, e.problem, e.fix) from None
        values["api_base"], sources["api_base"] = str(value).strip(), where
    if (got := pick("model", "AGENT_MODEL")) is not None:
        value, where = got
        text = str(value).strip()
        # It lands in harness configs (OpenCode's JSON expands {env:…}; Codex's -c is TOML): plain names only.
        if not text or text.startswith("-") or len(text) > 200 or \
                not all(c.isascii() and (c.isalnum() or c in "._:/@+-") for c in text):
            raise PolicyError(where, f"{text[:80]!r} is not a model name (letters, digits and ._:/@+- only)",
                              "e.g. --model claude-sonnet-4-5")
        values["model"], sources["model"] = text, where
    if (got := pick("risk", "AGENT_RISK")) is not None:
        value, where = got
        if value not in limits.RISKS:
            raise PolicyError(where, f"'{value}' is not a risk level", "one of " + ", ".join(limits.RISKS))
        if by_file(where) and limits.RISKS.index(str(value)) < limits.RISKS.index("medium"):
            raise PolicyError(where, "a file in the project may raise the risk level, never lower it",
                              f"give --risk {value} on the command line")
        values["risk"], sources["risk"] = str(value), where
    risk = values.get("risk", "medium")
    try:
        values["limits"] = limits.parse(flags.get("memory"), flags.get("cpu"), flags.get("pids"), flags.get("limits"),
                                        limits.for_risk(risk))
    except AgentcellError as e:
        raise PolicyError(e.field, e.problem, e.fix) from None
    given = [FLAGS[k] for k in ("limits", "memory", "cpu", "pids") if flags.get(k)]
    sources["limits"] = ", ".join(given) + f" over risk {risk}" if given else f"risk {risk}"
    if flags.get("ceilings") not in (None, "on", "off"):
        raise PolicyError("--ceilings", f"'{flags['ceilings']}' is neither on nor off", "--ceilings off runs without "
                          "any (said in the audit trail and the summary)")
    if flags.get("ceilings") == "off":  # (a flag only: no file in the project weakens them)
        if given:
            raise PolicyError("--ceilings", f"off contradicts {', '.join(given)}", "drop one of them")
        values["limits"], values["ceilings"], sources["limits"] = (None, None, None), False, "--ceilings off"
    if flags.get("cache") not in (None, "on", "off"):
        raise PolicyError("--cache", f"'{flags['cache']}' is neither on nor off", "--cache off starts the "
                          "toolchains with empty caches")
    if flags.get("cache") == "off":  # a flag only: the project's files do not decide what persists
        values["cache"], sources["cache"] = False, "--cache off"
    if flags.get("workspace") not in (None, "direct", "copy"):
        raise PolicyError("--workspace", f"'{flags['workspace']}' is neither direct nor copy", "--workspace copy "
                          "gives the agent a copy-on-write view; 'session apply' lands its work")
    if flags.get("workspace") == "copy":  # a flag only
        values["workspace"], sources["workspace"] = "copy", "--workspace copy"
    include = list(flags.get("workspace_include") or [])
    for inc in include:
        parts = inc.strip("/").split("/")
        if not inc.strip("/") or inc.startswith("/") or ".." in parts or parts[0] == ".git" or "\0" in inc:
            raise PolicyError("--workspace-include", f"'{inc}' is not a path inside the project",
                              "name it relative to the project, e.g. --workspace-include .env")
    if include:
        if values.get("workspace") != "copy":
            raise PolicyError("--workspace-include", "applies to --workspace copy only", "add --workspace copy")
        values["workspace_include"] = tuple(i.strip("/") for i in include)
    env: dict[str, str] = {}
    if "env" in toml:
        table = toml["env"]
        if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
            raise PolicyError(toml_where + "env", "is not a table of strings", 'write it as env = { DEBUG = "1" }')
        for name, value in table.items():
            if not is_env_name(name):
                raise PolicyError(f"{toml_where}env.{name}", "is not a variable name", "e.g. DEBUG")
            if _configures_harness(name, profile):
                raise PolicyError(f"{toml_where}env.{name}", f"a file in the project may not set what configures "
                                  f"{profile.title} or the cell (keys, base URLs, proxies, its own switches)",
                                  f"give --env {name}=... on the command line")
            env[name] = value
        sources["env"] = toml_where + "env"
    for kv in flags.get("env") or []:
        name, eq, value = str(kv).partition("=")
        if not eq or not is_env_name(name):
            raise PolicyError("--env", f"'{kv}' is not NAME=VALUE", "e.g. --env DEBUG=1")
        env[name] = value
        sources["env"] = "--env" if "env" not in sources or sources["env"] == "--env" else sources["env"] + ", --env"
    values["env"] = tuple(env.items())
    keep = []
    for name in flags.get("keep_env") or []:
        if not is_env_name(str(name)):
            raise PolicyError("--keep-env", f"'{name}' is not a variable name", "e.g. --keep-env EDITOR")
        keep.append(str(name))
    values["keep_env"] = tuple(dict.fromkeys(keep))
    if flags.get("home_from"):
        home_from = os.path.abspath(str(flags["home_from"]))
        if not os.path.isdir(home_from):
            raise PolicyError("--home-from", f"{home_from} is not a directory", "name the home you prepared")
        if _inside(home_from, [root, *values.get("declared_paths", ())]):
            raise PolicyError("--home-from", f"{home_from} lies where the agent works (an agent may have written it)",
                              "prepare the home outside the project")
        if values.get("agent"):
            raise PolicyError("--home-from", "a persistent agent keeps its own home",
                              "leave out --agent or --home-from")
        values["home_from"], sources["home_from"] = home_from, "--home-from"
    if flags.get("git_identity"):
        from .gitcell import parse_identity

        name, email = parse_identity(str(flags["git_identity"]))
        values["git_identity"], sources["git_identity"] = f"{name} <{email}>", "--git-identity"
