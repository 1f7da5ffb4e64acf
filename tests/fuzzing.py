"""The fuzzer (issue 13): every command and config file of agentcell, fed what an operator types by
mistake and what an agent leaves behind, through the real CLI (a subprocess per case) and the config
readers; a case fails on a traceback, a hang (its timeout), or a refusal longer than three lines.

Hypothesis draws the cases: argv from a grammar of each command's flags, values from a pool of
troublesome ones (special files, links, huge and non-UTF-8 strings, numbers out of range, paths that
name the system), config files (agentcell.toml, .env, policy TOML) from their keys and random text.
Everything a case may touch lives in one directory (:class:`Playground`); nothing mutating reaches
further (agent commands are --dry-run, no warm launcher is started, no -f follows).
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

from hypothesis import strategies as st

from conftest import AGENTCELL

HUGE = "h" * 100_000


class Playground:
    """A directory of troublesome things: a project (with a real snapshot and audit trail), a FIFO, a
    directory, links, a non-UTF-8 name, config files the cases rewrite."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="agentcell-fuzz-"))
        os.chmod(self.root, 0o755)
        self.project = self.root / "project"
        (self.project / "src").mkdir(parents=True)
        (self.project / "src" / "app.py").write_text("x = 1\n")
        self.state = self.root / "state"
        self.state.mkdir(mode=0o700)
        os.mkfifo(self.root / "fifo")
        (self.root / "dir").mkdir()
        (self.root / "link-to-dir").symlink_to(self.root / "dir")
        (self.root / "dangling").symlink_to(self.root / "nowhere")
        (self.root / "file.txt").write_text("text\n")
        odd = os.fsdecode(b"odd-\xff\xfe")
        (self.root / odd).mkdir()
        self.odd = str(self.root / odd)
        self.audit = self.state / "audit" / "audit.jsonl"
        shutil.chown(self.project, 65534, 65534)
        for p in self.project.rglob("*"):
            shutil.chown(p, 65534, 65534)
        env = self.env()
        p = subprocess.run([AGENTCELL, "snapshot", "take", str(self.project), "--store", str(self.state / "store")],
                           capture_output=True, text=True, env=env)
        self.snapshot = p.stdout.strip().splitlines()[-1] if p.returncode == 0 else "none"
        from agentcell.audit.trail import AuditLog

        log = AuditLog(str(self.audit))
        log.append("session.plan", session="fuzz-1")
        log.append("session.end", session="fuzz-1")

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(self.root / "dir"),
                "AGENTCELL_STATE_DIR": str(self.state), "AUDIT_LOG_PATH": str(self.audit),
                "BACKUP_DIR": str(self.state / "store"), **(extra or {})}

    def paths(self) -> list[str]:
        r = str(self.root)
        return [str(self.project), str(self.project / "src"), f"{r}/fifo", f"{r}/dir", f"{r}/link-to-dir",
                f"{r}/dangling", f"{r}/file.txt", f"{r}/nowhere", self.odd, "/dev/zero", "/", "//", "/.", "/etc/..",
                "/proc", "/dev", "/etc", "/root", "/home", "relative/path", "..", ".", "~", "~/x", "", HUGE,
                f"{r}/project/../project", "/proc/self/fd/0", "-", "--", "/tmp"]

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def values(pg: Playground) -> st.SearchStrategy[str]:
    """One value for a flag: a troublesome path, a number, or text (any code point, surrogates too)."""
    numbers = st.sampled_from(["0", "-1", "1", "65534", "4294967296", "1e9", "0x10", "99999999999999999999", "3.5",
                               "NaN", " 5", "5 "])
    words = st.sampled_from(["true", "none", "proxy", "loopback", "host-firewall", "low", "medium", "high", "ops1",
                             "2G", "1M", "50%", "claude_code", "codex", "shell", "scripted", "agent:root",
                             "agent:nobody", "self", "A=B", "=x", "X=", "a b", "*", "*.example", "evil.example:443",
                             "http://model.test:8080", "https://*", "10.0.0.0/8", "fe80::/10", "nobody", "root",
                             "ac-nosuch", "fuzz-1", "terminate,network=record", "\x1b[2J", "a\nb"])
    text = st.text(st.characters(codec=None, exclude_categories=("Cs",)), max_size=40)
    surrogate = st.binary(min_size=1, max_size=8).map(lambda b: os.fsdecode(b))
    # (no NUL: no command line can carry one)
    return st.one_of(st.sampled_from(pg.paths()), numbers, words, text, surrogate,
                     st.just(pg.snapshot)).filter(lambda s: "\0" not in s)


def _flags(pg: Playground, spec: dict[str, bool]) -> st.SearchStrategy[list[str]]:
    """Some of ``spec``'s flags (name -> takes a value), each with a value drawn from :func:`values`."""
    def one(flag: str) -> st.SearchStrategy[list[str]]:
        return values(pg).map(lambda v: [flag, v]) if spec[flag] else st.just([flag])

    return st.lists(st.sampled_from(sorted(spec)).flatmap(one), max_size=5).map(lambda xs: [a for x in xs for a in x])


RUN = {"--rw": True, "--ro": True, "--mask": True, "--allow-write": True, "--scratch": True, "--home": True,
       "--net": True, "--allow-domain": True, "--deny-domain": True, "--allow-preset": True, "--allow-range": True,
       "--resolver": True, "--allow-egress": True, "--allow-loopback": False, "--as": True, "--env": True,
       "--keep-env": True, "--cwd": True, "--timeout": True, "--allow-unsafe-path": False, "--explain": False,
       "--json": False, "--memory": True, "--cpu": True, "--pids": True, "--limits": True, "--landlock": True,
       "--no-warm": False, "--monitor": False, "--on-escape": True, "--tmpfs-scratch": False, "--vault-ro": True}
SESSION_START = {"--harness": True, "--agent": True, "--rw": True, "--project": True, "--env-file": True,
                 "--wall-clock": True, "--backup-dir": True, "--audit-log": True, "--firewall": False, "--net": True,
                 "--allow-domain": True, "--deny-domain": True, "--allow-preset": True, "--allow-range": True,
                 "--resolver": True, "--api-base": True, "--model": True, "--env": True, "--keep-env": True,
                 "--risk": True, "--memory": True, "--cpu": True, "--pids": True, "--limits": True,
                 "--home-from": True, "--explain": False, "--json": False}
QUICK = [["true"], ["false"], ["echo", "hi"], ["sh", "-c", "exit 3"], ["cat", "/etc/shadow"], ["nosuchcommand"]]


def argv(pg: Playground) -> st.SearchStrategy[list[str]]:
    """A whole command line (after ``agentcell``)."""
    v = values(pg)
    cmds = [
        _flags(pg, RUN).flatmap(lambda f: st.sampled_from(QUICK).map(lambda c: ["run", *f, "--", *c])),
        _flags(pg, RUN).map(lambda f: ["run", *f]),
        _flags(pg, SESSION_START).flatmap(lambda f: st.sampled_from([[], *QUICK]).map(
            lambda c: ["session", "start", "--wall-clock", "20", *f, *(["--", *c] if c else [])])),
        st.tuples(st.sampled_from(["show", "stop", "restore", "diff"]), v).map(lambda t: ["session", t[0], t[1]]),
        st.sampled_from([["session", "list"], ["session", "list", "--json"], ["session", "recover"]]),
        st.tuples(st.sampled_from(["verify", "show", "tail"]), v, st.booleans()).map(
            lambda t: ["audit", t[0], t[1], *(["--json"] if t[2] and t[0] != "tail" else [])]),
        st.tuples(st.sampled_from(["new", "delete", "info"]), v, v).map(
            lambda t: ["agent", t[0], t[1], *(["--human", t[2], "--dry-run"] if t[0] == "new" else
                                              ["--dry-run"] if t[0] == "delete" else [])]),
        st.tuples(st.sampled_from(["add", "remove"]), v, v).map(
            lambda t: ["agent", "mount", t[0], "--rw", t[1], "--agent", t[2], "--dry-run"]),
        st.tuples(v, st.sampled_from(QUICK)).map(lambda t: ["agent", "run", "--agent", t[0], "--", *t[1]]),
        st.just(["agent", "list"]),
        st.tuples(v, v).map(lambda t: ["snapshot", "take", t[0], "--store", t[1]]),
        st.tuples(st.sampled_from(["verify", "diff"]), v).map(lambda t: ["snapshot", t[0], t[1]]),
        st.tuples(v, v).map(lambda t: ["snapshot", "restore", t[0], "--to", t[1]]),
        v.map(lambda k: ["snapshot", "prune", "--keep", k]),
        st.just(["snapshot", "list"]),
        v.map(lambda h: ["check", "--harness", h]),
        st.sampled_from([["warm", "status"], ["warm", "stop"], ["doctor", "--json"], ["--help"], ["nosuch"]]),
        st.lists(v, max_size=4).map(lambda xs: ["run", *xs]),
        st.lists(v, max_size=4).map(lambda xs: ["session", *xs]),
    ]
    return st.one_of(cmds)


def toml_files(pg: Playground) -> st.SearchStrategy[str]:
    """An agentcell.toml: known keys with wrong or troublesome values, unknown keys, broken syntax."""
    from agentcell.session.sources import TOML_KEYS

    key = st.one_of(st.sampled_from(TOML_KEYS), st.text(min_size=1, max_size=12))
    val = st.one_of(values(pg).map(lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'),
                    st.sampled_from(["1", "-5", "true", "[]", '["src", "/etc"]', "{ A = \"b\" }", "{ PATH = \"x\" }",
                                     "1.5", "[1, 2]", "{}", '"' + HUGE + '"']))
    line = st.tuples(key, val).map(lambda t: f"{t[0]} = {t[1]}")
    junk = st.text(max_size=60)
    return st.lists(st.one_of(line, junk), max_size=6).map(lambda ls: "[session]\n" + "\n".join(ls) + "\n")


def dotenv_files(pg: Playground) -> st.SearchStrategy[str]:
    from agentcell.session.config import ENV_NAMES

    key = st.one_of(st.sampled_from([*ENV_NAMES, "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "export X"]),
                    st.text(min_size=1, max_size=12))
    line = st.tuples(key, values(pg)).map(lambda t: f"{t[0]}={t[1]}")
    return st.lists(st.one_of(line, st.text(max_size=40)), max_size=6).map("\n".join)


def policy_files(pg: Playground) -> st.SearchStrategy[str]:
    """A policy TOML for load_plan/compile_plan (the Python API's config file)."""
    from agentcell.policy.models import SessionPlan

    key = st.one_of(st.sampled_from(sorted(SessionPlan.model_fields)), st.text(min_size=1, max_size=10))
    val = st.one_of(values(pg).map(lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'),
                    st.sampled_from(["1", "0", "-1", "true", "[]", '["src"]', '["/", "/etc"]', "{}", "3.5",
                                     "{ memory_bytes = -1 }", "{ pids = true }", '"agent:root"', '"0"']))
    head = st.just('harness = "shell"\ndeclared_paths = ["project"]\n')
    return st.tuples(head, st.lists(st.tuples(key, val).map(lambda t: f"{t[0]} = {t[1]}"), max_size=6)).map(
        lambda t: t[0] + "\n".join(t[1]) + "\n")


def host_state() -> dict[str, object]:
    """What a case must never change outside its playground: accounts, groups, network namespaces,
    nftables tables, cgroups, mounts, agentcell's own state, the top of /, /tmp, /home, /var/lib, /opt
    and /root (a store or a trail put among the system's directories: '--store //' once made /objects)."""
    def out(*cmd: str) -> str:
        return subprocess.run(cmd, capture_output=True, text=True).stdout

    def listing(d: str) -> list[str]:
        try:
            return sorted(x for x in os.listdir(d) if not x.startswith(("agentcell-fuzz-", "pytest-")))
        except OSError:
            return []

    return {"passwd": out("getent", "passwd"), "group": out("getent", "group"), "netns": out("ip", "netns", "list"),
            "nft": out("nft", "list", "tables"),
            "cgroups": sorted(str(p) for p in Path("/sys/fs/cgroup").glob("**/agentcell*")),
            "mounts": [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if "agentcell" in line],
            "var": listing("/var/lib/agentcell"), "run": listing("/run/agentcell"), "tmp": listing("/tmp"),
            "home": listing("/home"), "root": listing("/"), "var/lib": listing("/var/lib"), "opt": listing("/opt"),
            "~root": listing("/root")}


def token() -> str:
    return secrets.token_hex(3)
