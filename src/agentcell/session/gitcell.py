"""Git in the cell: configuration agentcell owns, never the project's.

The agent runs as an account of its own (a per-session one, ``--agent``), so git refuses the human's
repository ("detected dubious ownership") unless ``safe.directory`` names it in a configuration the
repository cannot set: system, global or the command line. And a fresh home knows no one to commit as.
So each session gets a system configuration of its own, in its seed (:mod:`agentcell.harness.seed`:
made by the supervisor, bound read-only into the cell), named by ``GIT_CONFIG_SYSTEM``:

* ``safe.directory``: each declared path and each repository found below them (submodules and nested
  repositories: git of Debian 12 takes no ``path/*``);
* ``user.name``/``user.email``: the identity the agent commits under: ``--git-identity "Name <email>"``
  as given, else the human's own as git resolves it for them (the repository's config, then their
  global and the host's system configuration, each read as data: agentcell runs no git on a repository
  an agent could have prepared), marked as the agent's: ``Name (agent: HARNESS)``. The same identity is
  in ``GIT_AUTHOR_*`` and ``GIT_COMMITTER_*``, so a home kept from an earlier session (``--agent``) with
  another ``user.name`` does not decide it;
* ``include.path = /etc/gitconfig``: the host's own system configuration still applies.

A harness whose shell runs git with no system configuration (Gemini CLI sets ``GIT_CONFIG_SYSTEM=/dev/null``
and a ``GIT_CONFIG_COUNT`` of its own) gets :func:`wrapper` too: a ``git`` in the seed's ``bin/``, first
on PATH, that runs the real one with each safe directory as ``-c safe.directory=…`` (command-line scope,
which no repository can override); the identity still comes from ``GIT_AUTHOR_*``/``GIT_COMMITTER_*``.

The agent's own ``~/.gitconfig`` stays its own to write; the repository's ``.git/config`` stays
read-only in the cell (:mod:`agentcell.protect`).
"""
from __future__ import annotations

import os
import pwd
import re

from ..errors import PolicyError

FALLBACK = ("agentcell agent", "agent@agentcell.invalid")
_IDENTITY = re.compile(r"\s*(?P<name>[^<>\n]*?)\s*<(?P<email>[^<>\s]+)>\s*")
_BAD = re.compile(r"[\x00-\x1f\x7f]")


def parse_identity(text: str, field: str = "--git-identity") -> tuple[str, str]:
    """``Name <email>``, each part without control characters or angle brackets; else a PolicyError."""
    m = _IDENTITY.fullmatch(text)
    if not m or not m["name"] or _BAD.search(text):
        raise PolicyError(field, f"{text[:80]!r} is not a git identity", 'give it as "Name <email>"')
    return m["name"], m["email"]


def _parse(text: str) -> dict[tuple[str, str], str]:
    from ..protect.surface import _parse_config

    out: dict[tuple[str, str], str] = {}
    for section, key, value in _parse_config(text):
        out[(section, key)] = value
    return out


def _read(directory: str, name: str) -> dict[tuple[str, str], str]:
    from ..protect.surface import MAX_CONFIG, _read_small

    return _parse(_read_small(directory, name, MAX_CONFIG))


def human_identity(home: str | None, repo_git_dirs: list[str]) -> tuple[str, str, str] | None:
    """(name, email, where from) as git resolves them for the human: each repository's own config (the
    first of ``repo_git_dirs`` that says both), then their global configuration (``~/.gitconfig`` over
    ``~/.config/git/config``), then the host's (``/etc/gitconfig``). Includes are not followed."""
    layers: list[tuple[str, dict[tuple[str, str], str]]] = [("/etc/gitconfig", _read("/etc", "gitconfig"))]
    if home:
        layers.append((f"{home}/.config/git/config", _read(os.path.join(home, ".config", "git"), "config")))
        layers.append((f"{home}/.gitconfig", _read(home, ".gitconfig")))
    name = email = None
    where: list[str] = []
    for place, values in layers:
        if ("user", "name") in values:
            name = values[("user", "name")]
            where.append(place)
        if ("user", "email") in values:
            email = values[("user", "email")]
            where.append(place)
    for git_dir in repo_git_dirs:
        values = _read(git_dir, "config")
        if ("user", "name") in values and ("user", "email") in values and not (
                _BAD.search(values[("user", "name")]) or _BAD.search(values[("user", "email")])):
            return values[("user", "name")], values[("user", "email")], f"{git_dir}/config"
    if name and email and not (_BAD.search(name) or _BAD.search(email)):
        return name, email, where[-1]
    return None


def identity(given: str | None, human_uid: int | None, repos: list[str], harness: str) -> tuple[str, str, str]:
    """(name, email, where from) the agent commits under (see the module)."""
    if given:
        name, email = parse_identity(given)
        return name, email, "--git-identity"
    home = None
    if human_uid is not None:
        try:
            home = pwd.getpwuid(human_uid).pw_dir
        except KeyError:
            home = None
    found = human_identity(home, [os.path.join(r, ".git") for r in repos])
    if found is None:
        return FALLBACK[0], FALLBACK[1], "agentcell's default (none configured for you)"
    return f"{found[0]} (agent: {harness})", found[1], found[2]


def _quoted(value: str) -> str:
    """A git config value in double quotes, with git's escapes: a backslash, a quote, and the control
    characters git can spell (a newline, a tab, a backspace: a directory name may hold them; a raw one
    would end the line, and git would refuse the whole file)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace(
        "\t", "\\t").replace("\b", "\\b") + '"'


def system_config(safe: list[str], name: str, email: str) -> str:
    lines = ["# agentcell: this session's git configuration (read-only in the cell; GIT_CONFIG_SYSTEM)",
             "[include]", "\tpath = /etc/gitconfig", "[safe]"]
    lines += [f"\tdirectory = {_quoted(p)}" for p in dict.fromkeys(safe)]
    lines += ["[user]", f"\tname = {_quoted(name)}", f"\temail = {_quoted(email)}"]
    return "\n".join(lines) + "\n"


def _sh(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


def wrapper(real_git: str, safe: list[str]) -> str:
    """The seed's ``bin/git`` for a harness that isolates git from its configuration (see the module)."""
    args = " ".join(f"-c safe.directory={_sh(p)}" for p in dict.fromkeys(safe))
    return ("#!/bin/sh\n# agentcell: this harness runs git without the session's configuration; its safe "
            f"directories on the command line instead\nexec {_sh(real_git)} {args} \"$@\"\n")


def environment(config_path: str, name: str, email: str) -> dict[str, str]:
    return {"GIT_CONFIG_SYSTEM": config_path, "GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email,
            "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email}
