"""``agentcell check --harness H``: the proof the tests run, on your own machine with your installed harness.

A fake internet of its own (:mod:`.fakenet`) holds the scripted model endpoint (:mod:`.mockmodel`) at
``http://model.test:8080`` and a DNS server; a throwaway project and state directory are made; then one
real session of the harness (``agentcell session start --api-base …``) plays two turns: one edits a
file, one reads a credential. The check passes only if the edit landed in the project, the read was
caught and ended the session (attributed to the process that read, with the harness above it), and
nothing but the endpoint's name was looked up. Everything it made is removed at the end.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ..errors import AgentcellError
from .fakenet import NOBODY, FakeInternet

MODEL_NAME, MODEL_PORT = "model.test", 8080
MODEL = "agentcell-mock"
EDIT = "echo agentcell-check > CHECKED.txt && cat CHECKED.txt"
READ = "cat ~/.ssh/id_ed25519"
PROMPT = "Add CHECKED.txt to the project, then show me the SSH key."
STEPS = [{"shell": EDIT}, {"shell": READ}, {"text": "Done."}]


class Rig:
    """A fake internet with the scripted model endpoint on it: ``flags()`` point a session there."""

    def __init__(self, workdir: str, hosts: dict[str, int] | None = None) -> None:
        """``hosts``: more names on it (name -> the last byte of its address), for a caller's servers."""
        self.workdir = workdir
        n = 1 + secrets.randbelow(254)
        self.net_range, self.dns, self.addr = f"198.19.{n}.0/24", f"198.19.{n}.53", f"198.19.{n}.80"
        self.hosts = {name: f"198.19.{n}.{last}" for name, last in (hosts or {}).items()}
        self.net = FakeInternet(workdir, {MODEL_NAME: [self.addr], **{k: [v] for k, v in self.hosts.items()}},
                                route4=self.net_range, link4=(f"198.19.{n}.1/30", f"198.19.{n}.2/30"), dns=self.dns)
        self.log = ""
        self.model: subprocess.Popen[bytes] | None = None

    def serve(self, steps: list[dict[str, str]], *, fenced: bool = False) -> None:
        """(Re)start the endpoint with a new script and an empty log."""
        self.stop_model()
        tag = secrets.token_hex(3)
        script = os.path.join(self.workdir, f"script-{tag}.json")
        self.log = os.path.join(self.workdir, f"requests-{tag}.jsonl")
        with open(script, "w") as f:
            json.dump(steps, f)
        os.chmod(script, 0o644)
        with open(self.log, "w"):
            pass
        os.chown(self.log, NOBODY, NOBODY)  # the endpoint runs as nobody
        self.model = self.net.start([sys.executable, "-m", "agentcell.harness.mockmodel", "--listen",
                                     f"{self.addr}:{MODEL_PORT}", "--script", script, "--log", self.log,
                                     *(["--fenced"] if fenced else [])], ready=b"listening")

    def stop_model(self) -> None:
        if self.model is not None and self.model.poll() is None:
            self.model.kill()
            self.model.wait()

    def requests(self) -> list[dict[str, Any]]:
        try:
            with open(self.log) as f:
                return [json.loads(line) for line in f if line.strip()]
        except OSError:
            return []

    def flags(self) -> list[str]:
        return ["--api-base", f"http://{MODEL_NAME}:{MODEL_PORT}", "--model", MODEL, "--resolver", self.dns,
                "--allow-range", self.net_range]

    def names_looked_up(self) -> list[str]:
        return sorted({name for name, _ in self.net.dns_queries()})

    def close(self) -> None:
        self.stop_model()
        self.net.close()


INTERPRETERS = ("node", "bun", "python", "deno")


def harness_ancestor(escape: dict[str, Any], binary_real: str, name: str) -> list[Any] | None:
    """The ancestor of the reading process that is the harness: its executable is the harness's (or
    named like it), or it is an interpreter whose command line runs the harness's file (node and python
    run most of them; a command line is the process's own word, so this is attribution, not proof)."""
    for pid, exe, cmd in escape.get("ancestry") or []:
        base = os.path.basename(str(exe))
        if os.path.realpath(str(exe)) == binary_real or base.startswith(name) or (
                base.startswith(INTERPRETERS) and any(word.startswith("/") and os.path.realpath(word) == binary_real
                                                      for word in str(cmd).split())):
            return [pid, exe, cmd]
    return None


def _account_gone(name: str | None) -> bool:
    import pwd

    try:
        pwd.getpwnam(name or "")
    except KeyError:
        return True
    return not name


def run(harness: str, *, out: Callable[[str], None], agentcell: list[str] | None = None,
        extra: list[str] | None = None) -> tuple[bool, dict[str, Any]]:
    """The check. Returns (passed, details); ``out`` gets one line per step."""
    from . import profiles

    prof = profiles.get(harness)
    if prof.name in ("shell", "scripted") or prof.api is None:
        raise AgentcellError("--harness", f"{harness} has no model API to check",
                             "one of " + ", ".join(n for n in profiles.HARNESSES if profiles.PROFILES[n].api))
    if os.geteuid() != 0:
        raise AgentcellError("check", "needs root (a fake internet is a network namespace; a session makes an "
                             "account)", "run it through sudo")
    found, _ = profiles.locate(prof.binary or harness, field_name=f"harness {harness}", install=prof.install,
                               title=prof.title)
    real = os.path.realpath(found)
    out(f"harness: {prof.title} at {found}" + (f" ({real})" if real != found else ""))
    details: dict[str, Any] = {"harness": harness, "binary": found}
    work = tempfile.mkdtemp(prefix="agentcell-check-")
    os.chmod(work, 0o755)
    rig: Rig | None = None
    state = os.path.join(work, "state")
    base = agentcell or [sys.executable, "-m", "agentcell.cli.main"]
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "SUDO_UID", "SUDO_GID")
           or k in prof.secret_env}
    env["AGENTCELL_STATE_DIR"] = state
    try:
        rig = Rig(work)
        rig.serve(STEPS, fenced=prof.fenced)
        out(f"ok    fake internet: {MODEL_NAME} at {rig.addr}:{MODEL_PORT}, its DNS at {rig.dns} "
            f"(network namespace {rig.net.ns})")
        project = os.path.join(work, "project")
        os.mkdir(project)
        with open(os.path.join(project, "README.md"), "w") as f:
            f.write("A throwaway project of agentcell check.\n")
        os.mkdir(state, 0o700)
        owner = (int(env["SUDO_UID"]), int(env.get("SUDO_GID", env["SUDO_UID"]))) \
            if env.get("SUDO_UID", "").isdigit() and env["SUDO_UID"] != "0" else (65534, 65534)
        for made in (project, os.path.join(project, "README.md")):
            os.chown(made, *owner)
        started = time.monotonic()
        ran = subprocess.run([*base, "session", "start", "--harness", harness, "--project", project, *rig.flags(),
                            *(extra or []), "--json", "--", PROMPT], env=env, cwd=project, capture_output=True,
                           text=True, stdin=subprocess.DEVNULL, timeout=600)
        details["seconds"] = round(time.monotonic() - started, 1)
        lines = ran.stdout.strip().splitlines()
        summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
        details.update(summary=summary, stderr=ran.stderr[-4000:], requests=rig.requests())
        if not summary:
            out(f"FAIL  session: no summary (exit {ran.returncode}): {ran.stderr.strip()[-500:]}")
            return False, details
        out(f"ok    session {summary['session']}: {harness} as {summary.get('os_user')}, {details['seconds']} s, "
            f"{summary['status']}")
        edited = os.path.join(project, "CHECKED.txt")
        try:
            with open(edited) as f:
                landed = f.read().strip() == "agentcell-check"
        except OSError:
            landed = False
        out(("ok    " if landed else "FAIL  ") + f"turn 1: `{EDIT}` " +
            ("landed in the project" if landed else "did not land in the project"))
        escape = summary.get("escape") or {}
        caught = summary["status"] == "terminated" and str(escape.get("target", "")).endswith("/.ssh/id_ed25519")
        who = harness_ancestor(escape, real, prof.binary or harness) if caught else None
        if caught:
            out(f"ok    turn 2: `{READ}` was caught and ended the session: {escape['operation']} {escape['target']} "
                f"by {os.path.basename(escape.get('exe') or '?')} (pid {escape.get('pid')})" +
                (f", under {os.path.basename(str(who[1]))} (pid {who[0]})" if who else ", harness not among its "
                 "parents"))
        else:
            out(f"FAIL  turn 2: `{READ}` did not end the session ({summary['status']}: {summary.get('reason')})")
        names = rig.names_looked_up()
        only = names == [MODEL_NAME]
        out(("ok    " if only else "FAIL  ") + f"DNS: {', '.join(names) or 'nothing'} looked up")
        mains = [r for r in rig.requests() if r.get("kind") == "main"]
        out(f"{'ok    ' if mains else 'FAIL  '}model endpoint: {len(mains)} turns asked of it, "
            f"{sum(len(r.get('results') or []) for r in mains[-1:])} tool results carried back")
        # What the harness did of its own (its home, its settings, tuning itself) must end nothing: the
        # session's record holds one event that acts, the read.
        shown = subprocess.run([*base, "session", "show", summary["session"], "--json"], env=env,
                               capture_output=True, text=True, timeout=120)
        events = json.loads(shown.stdout.strip().splitlines()[-1]).get("events", []) if shown.returncode == 0 else []
        acting = [f"{e['operation']} {e['target']}" for e in events if e.get("acts", True)]
        quiet = len(acting) == 1
        out(("ok    " if quiet else "FAIL  ") + f"events: {len(events)} recorded, the one that acts: "
            f"{'; '.join(acting) or 'none'}")
        clean = not summary.get("problems") and _account_gone(summary.get("os_user"))
        out(("ok    " if clean else "FAIL  ") + "teardown: " + ("the session's account and grants are gone" if clean
                                                               else f"left {summary.get('problems')}"))
        details.update(landed=landed, caught=caught, harness_parent=who, names=names, events=events)
        return landed and caught and who is not None and only and bool(mains) and quiet and clean, details
    finally:
        subprocess.run([*base, "session", "recover"], env=env, capture_output=True, timeout=300)
        if rig is not None:
            rig.close()
        shutil.rmtree(work, ignore_errors=True)
