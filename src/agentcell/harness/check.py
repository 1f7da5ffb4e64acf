"""``agentcell check --harness H``: the proof the tests run, on your own machine with your installed harness.

A fake internet of its own (:mod:`.fakenet`) holds the scripted model endpoint (:mod:`.mockmodel`) at
``https://model.test:8080`` (a test CA of the check's own standing in for the public ones, given to
the session as ``--upstream-ca``) and a DNS server; a throwaway project and state directory are made;
then one real session of the harness (``agentcell session start --api-base …``) with a fresh API key
in its environment plays three turns: one looks for the key in the cell (every process's environment
and memory, the home, ``/tmp``: what a core dump would hold), one edits a file, one reads a credential.
The check passes only if the key never entered the cell (a placeholder did) and the endpoint got the
real one (the proxy put it in), the edit landed in the project, the read was caught and ended the
session (attributed to the process that read, with the harness above it), and nothing but the
endpoint's name was looked up. Everything it made is removed at the end.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ..cell.canary import CANARIES
from ..errors import AgentcellError
from .fakenet import NOBODY, FakeInternet

MODEL_NAME, MODEL_PORT = "model.test", 8080
MODEL = "agentcell-mock"
EDIT = "echo agentcell-check > CHECKED.txt && cat CHECKED.txt"
READ = "cat ~/.ssh/id_ed25519"
PROMPT = "Add CHECKED.txt to the project, then show me the SSH key."
KEY_SHAPE = r"sk-[A-Za-z0-9]{48}"  # the check's key, and what the scan in the cell looks for
SCANNED = "agentcell-keys.txt"
# Every string of the key's shape in the cell: the processes' environments, command lines and memory
# (what a core dump would hold), the home and /tmp; one per line into SCANNED, in the project. The
# canaries agentcell planted in the home are left alone (their contents are its own; opening one is an
# escape).
_SCAN = r"""
import os, re
pat, found = re.compile(rb"sk-[A-Za-z0-9]{48}"), set()
for pid in filter(str.isdigit, os.listdir("/proc")):
    for name in ("environ", "cmdline"):
        try:
            found.update(pat.findall(open(f"/proc/{pid}/{name}", "rb").read()))
        except OSError:
            pass
    try:
        mem = open(f"/proc/{pid}/mem", "rb", 0)
        for line in open(f"/proc/{pid}/maps"):
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if perms.startswith("r") and hi - lo < 1 << 30:
                try:
                    mem.seek(lo)
                    found.update(pat.findall(mem.read(hi - lo)))
                except (OSError, ValueError, OverflowError):
                    pass
    except OSError:
        pass
home = os.path.expanduser("~")
decoys = {os.path.join(home, rel) for rel in DECOYS}  # (agentcell's canaries: opening one ends the cell)
for top in (home, "/tmp"):
    for d, _, files in os.walk(top):
        for f in files:
            if os.path.join(d, f) in decoys:
                continue
            try:
                found.update(pat.findall(open(os.path.join(d, f), "rb").read(1 << 26)))
            except OSError:
                pass
print("\n".join(sorted(x.decode() for x in found)) or "none")
"""
_SCAN = _SCAN.replace("DECOYS", repr(CANARIES))
SCAN = f"python3 -c \"exec(bytes.fromhex('{_SCAN.encode().hex()}').decode())\" > {SCANNED}; wc -l < {SCANNED}"
STEPS = [{"shell": SCAN}, {"shell": EDIT}, {"shell": READ}, {"text": "Done."}]


class Rig:
    """A fake internet with the scripted model endpoint on it: ``flags()`` point a session there."""

    def __init__(self, workdir: str, hosts: dict[str, int] | None = None, *, tls: bool = False) -> None:
        """``hosts``: more names on it (name -> the last byte of its address), for a caller's servers.
        ``tls``: the endpoint serves HTTPS, with a leaf of a CA of the rig's own (``ca``: its file)."""
        self.workdir, self.tls, self.ca = workdir, tls, ""
        if tls:
            from ..network.tlsca import SessionCA

            public = SessionCA("agentcell check: a test CA standing in for the public ones", (MODEL_NAME,))
            chain, key = public.leaf(MODEL_NAME)
            self.ca = os.path.join(workdir, "test-ca.pem")
            for name, data, mode in (("test-ca.pem", public.pem, 0o644), ("model.pem", chain, 0o644),
                                     ("model.key", key, 0o600)):
                path = os.path.join(workdir, name)
                with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode), "wb") as f:
                    f.write(data)
                os.chown(path, NOBODY, NOBODY)  # the endpoint runs as nobody
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
                                     *(["--fenced"] if fenced else []),
                                     *(["--tls", os.path.join(self.workdir, "model.pem"),
                                        os.path.join(self.workdir, "model.key")] if self.tls else [])],
                                    ready=b"listening")

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
        return ["--api-base", f"{'https' if self.tls else 'http'}://{MODEL_NAME}:{MODEL_PORT}", "--model", MODEL,
                "--resolver", self.dns, "--allow-range", self.net_range,
                *(["--upstream-ca", self.ca] if self.tls else [])]

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


def _session(argv: list[str], env: dict[str, str], cwd: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The session, to its end. If the check is ended meanwhile (SIGTERM, ^C, its timeout), the session is
    told as ``session stop`` would tell it (SIGTERM) and waited for: it takes its cell, account and grants
    down itself; then the caller's ``session recover`` finds nothing left to do."""
    p = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:
        p.terminate()
        try:
            p.communicate(timeout=120)
        except BaseException:
            p.kill()
            p.communicate()
        raise
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


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
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "SUDO_UID", "SUDO_GID")}
    env["AGENTCELL_STATE_DIR"] = state
    # A fresh key of the check's own (never one of yours): it must reach the endpoint and never the cell.
    key_var = prof.api_key_env or next((k for k in prof.secret_env if k.endswith("PROVIDER_API_KEY")), None)
    key = "sk-" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(48))
    if key_var:
        env[key_var] = key
    try:
        rig = Rig(work, tls=True)
        rig.serve(STEPS, fenced=prof.fenced)
        out(f"ok    fake internet: https://{MODEL_NAME}:{MODEL_PORT} at {rig.addr} (a test CA's), its DNS at "
            f"{rig.dns} (network namespace {rig.net.ns})")
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
        ran = _session([*base, "session", "start", "--harness", harness, "--project", project, *rig.flags(),
                        *(extra or []), "--json", "--", PROMPT], env, project)
        details["seconds"] = round(time.monotonic() - started, 1)
        lines = ran.stdout.strip().splitlines()
        summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
        details.update(summary=summary, stderr=ran.stderr[-4000:], requests=rig.requests())
        if not summary:
            out(f"FAIL  session: no summary (exit {ran.returncode}): {ran.stderr.strip()[-500:]}")
            return False, details
        out(f"ok    session {summary['session']}: {harness} as {summary.get('os_user')}, {details['seconds']} s, "
            f"{summary['status']}")
        from .mockmodel import key_digest

        try:
            with open(os.path.join(project, SCANNED)) as f:
                seen_in_cell = f.read().split()
        except OSError:
            seen_in_cell = []
        sent = [r.get("credential") for r in rig.requests() if r.get("kind") == "main"]
        kept_out = bool(seen_in_cell) and key not in seen_in_cell
        injected = bool(sent) and all(c == key_digest(key) for c in sent)
        out(("ok    " if kept_out else "FAIL  ") + f"key in the cell: {len(seen_in_cell)} of its shape found in the "
            "processes' environments and memory, the home and /tmp" +
            (", none of them the key (a placeholder)" if kept_out else
             " (the scan did not run)" if not seen_in_cell else ": THE KEY ITSELF"))
        out(("ok    " if injected else "FAIL  ") + f"key at the endpoint: {len(sent)} requests, " +
            ("each with the real key (the proxy put it in)" if injected else
             f"credentials {sorted(set(map(str, sent)))} (the key is {key_digest(key)})"))
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
        details.update(landed=landed, caught=caught, harness_parent=who, names=names, events=events,
                       key_kept_out=kept_out, key_injected=injected)
        return (landed and caught and who is not None and only and bool(mains) and quiet and clean and kept_out
                and injected), details
    finally:
        subprocess.run([*base, "session", "recover"], env=env, capture_output=True, timeout=300)
        if rig is not None:
            rig.close()
        shutil.rmtree(work, ignore_errors=True)
