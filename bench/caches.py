"""Toolchain caches benchmark (issue 26): a project's second session installs the same dependencies from
its cache at /cache, against the first session's install from the registries, and against the same two
installs on the host (its own pip and npm, a fresh cache then the warm one): the peer.

    .venv/bin/python bench/caches.py [--rounds N] [--json]

Real pip and npm against the real registries (PyPI, the npm registry), through the session's proxy
(``--allow-preset pypi --allow-preset npm``): the only traffic that leaves this machine. Each round uses a
new project (so a new cache) owned by a throwaway user; the session is ``agentcell session start
--harness shell`` as root (a per-session account), given the machine's CPUs (``--cpu``), as the host's own
install has them. What is timed is the install command inside the cell
(``date +%s%N`` around it), not the session's set-up; npm installs with ``npm ci`` from a lockfile resolved
once on the host. The project's ``lib/`` and ``node_modules`` are removed between the two sessions, so the
second one installs again, from the cache. Where this machine reaches the registries through a gateway at
an address that is not public, that address is allowed with --allow-range (the proxy refuses it otherwise).
Everything made is removed at the end.

``--link MBIT``: the same installs from registry stand-ins on a fake internet of the bench's own (a mock
of the internet), behind a link of MBIT Mbit/s (a token bucket on its veth): the wheels and
tarballs the real registries gave are fetched once on the host (``pip download``, ``npm pack``) and served
there (a PEP 503 index; npm's tarball paths, which ``npm ci`` asks for by the lockfile's names and
versions). That is a machine whose installs wait on the network, as a laptop's or an office's do; the host's
own installs go over the same link.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from rig import AGENTCELL, throwaway  # (bench/rig.py, beside this file)

PIP_PKGS = ["requests==2.32.3", "rich==13.9.4", "pydantic==2.10.4", "attrs==24.3.0"]
UV_PKG = "uv==0.13.9"
TOOLS = ("pip", "uv", "npm")
NPM_PKGS = ["express@4.21.2", "lodash@4.17.21", "typescript@5.7.2", "chalk@5.4.1", "webpack@5.97.1"]


def pip_binary() -> str:
    """A pip the cell can run: a venv of the system's Python under /opt (the harness tests' own, or made)."""
    cands = ["/opt/agentcell-test/harnesses/pytest/bin/pip", "/opt/agentcell-bench/pip-venv/bin/pip"]
    for c in cands:
        if os.access(c, os.X_OK):
            return c
    subprocess.run(["/usr/bin/python3", "-m", "venv",
                    "/opt/agentcell-bench/pip-venv"], check=True)
    return cands[1]


def uv_binary(pip: str) -> str:
    """uv, installed with pip into the same venv (from PyPI)."""
    uv = str(Path(pip).parent / "uv")
    if not os.access(uv, os.X_OK):
        subprocess.run([pip, "install", "-q", "--disable-pip-version-check", UV_PKG], check=True, timeout=900)
    return uv


def script(pip: str, what: str, link: Link, host: bool = False) -> str:
    if what == "pip":
        args = link.host_pip_args if host else link.pip_args
        cmd = f"{pip} install -q --disable-pip-version-check {' '.join(args)} --target lib {' '.join(PIP_PKGS)}"
    elif what == "uv":  # the same dependencies; uv keeps them unpacked in its cache and copies them out
        args = link.host_uv_args if host else link.uv_args
        cmd = (f"{Path(pip).parent / 'uv'} pip install -q --python /usr/bin/python3 {' '.join(args)} --target lib "
               f"{' '.join(PIP_PKGS)}")
    elif what == "pip-offline":
        cmd = (f"{pip} install -q --disable-pip-version-check --no-index --find-links {link.wheels} --target lib "
               f"{' '.join(PIP_PKGS)}")
    else:  # from the project's lockfile, as an agent's "npm ci" is
        args = link.host_npm_args if host else link.npm_args
        cmd = f"npm ci -q --no-audit --no-fund --no-update-notifier {' '.join(args)} >/dev/null"
    return f"set -e; a=$(date +%s%N); {cmd}; b=$(date +%s%N); echo TOOK=$(( (b - a) / 1000000 ))"


def gateway_ranges() -> list[str]:
    """Where this machine reaches the registries at an address that is not public (a gateway: the
    proxy refuses such addresses unless a range allows them), that address, as --allow-range flags."""
    import ipaddress
    import socket

    out: list[str] = []
    for host in ("pypi.org", "files.pythonhosted.org", "registry.npmjs.org"):
        try:
            addrs = {ai[4][0] for ai in socket.getaddrinfo(host, 443, proto=socket.IPPROTO_TCP)}
        except OSError:
            continue
        for a in sorted(addrs):
            ip = ipaddress.ip_address(a)
            if not ip.is_global and f"{a}/{ip.max_prefixlen}" not in out:
                out += ["--allow-range", f"{a}/{ip.max_prefixlen}"]
    return out


class Link:
    """Where the installs fetch from: the real registries, or stand-ins behind an emulated link."""

    def __init__(self) -> None:
        self.flags = ["--allow-preset", "pypi", "--allow-preset", "npm", *gateway_ranges()]
        self.pip_args: list[str] = []
        # uv trusts its own bundled roots unless told: the system's store is the one a registry gateway's
        # certificate authority (as this machine has) is added to, for pip and npm as well
        self.uv_args: list[str] = ["--system-certs"]
        self.host_uv_args: list[str] = ["--system-certs"]
        self.npm_args: list[str] = []
        self.host_pip_args: list[str] = []  # (the host resolves no name of the fake internet: its addresses)
        self.host_npm_args: list[str] = []
        self.rig: Any = None
        self.wheels: Path | None = None  # (emulated) the wheels themselves, for pip's own floor

    def emulate(self, base: Path, mbit: int, pip: str, lock: Path) -> None:
        from agentcell.harness.check import Rig

        files = base / "registries"
        wheels = files / "pypi" / "packages"
        wheels.mkdir(parents=True)
        self.wheels = wheels
        subprocess.run([pip, "download", "-q", "--disable-pip-version-check", "-d", str(wheels), *PIP_PKGS],
                       check=True, env={"PATH": "/usr/bin:/bin", "HOME": str(base)}, timeout=900)
        for whl in sorted(wheels.iterdir()):
            name = re.sub(r"[-_.]+", "-", whl.name.split("-")[0]).lower()
            page = files / "pypi" / "simple" / name
            page.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256(whl.read_bytes()).hexdigest()
            with open(page / "index.html", "a") as f:
                f.write(f'<a href="/packages/{whl.name}#sha256={digest}">{whl.name}</a>\n')
        packed = files / "packed"
        packed.mkdir()
        locked = json.loads((lock / "package-lock.json").read_text())["packages"]
        specs = sorted({f"{v.get('name') or k.rsplit('node_modules/', 1)[1]}@{v['version']}"
                        for k, v in locked.items() if k})
        subprocess.run(["npm", "pack", "-q", "--pack-destination", str(packed), *specs], check=True, cwd=packed,
                       env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(base),
                            "npm_config_cache": str(base / "npm-pack-cache")}, capture_output=True, timeout=900)
        for spec in specs:
            name, version = spec.rsplit("@", 1)
            short = name.rsplit("/", 1)[-1]
            tgz = packed / f"{name.replace('@', '').replace('/', '-')}-{version}.tgz"
            dest = files / "npm" / name / "-" / f"{short}-{version}.tgz"
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(tgz, dest)
        subprocess.run(["chmod", "-R", "a+rX", str(base)], check=True)
        self.rig = Rig(str(base), hosts={"registry.test": 91, "pypi.test": 92})
        mirror = [sys.executable, str(Path(__file__).resolve().parent.parent / "tests" / "mirror.py")]
        self.rig.net.start([*mirror, self.rig.hosts["registry.test"], "80", "files", str(files / "npm")],
                           ready=b"ready")
        self.rig.net.start([*mirror, self.rig.hosts["pypi.test"], "80", "files", str(files / "pypi")],
                           ready=b"ready")
        # (a token bucket: these kernels have tbf, not netem, so the link has a rate and no added delay)
        subprocess.run(["ip", "netns", "exec", self.rig.net.ns, "tc", "qdisc", "add", "dev", self.rig.net.ns_if,
                        "root", "tbf", "rate", f"{mbit}mbit", "burst", "64kb", "latency", "400ms"], check=True)
        self.flags = ["--resolver", self.rig.dns, "--allow-range", self.rig.net_range,
                      "--allow-domain", "pypi.test:80", "--allow-domain", "registry.test:80"]
        self.pip_args = ["--index-url", "http://pypi.test/simple/", "--trusted-host", "pypi.test"]
        self.uv_args = ["--index-url", "http://pypi.test/simple/"]
        self.npm_args = ["--registry", "http://registry.test/"]
        pypi, npm = self.rig.hosts["pypi.test"], self.rig.hosts["registry.test"]
        self.host_pip_args = ["--index-url", f"http://{pypi}/simple/", "--trusted-host", pypi]
        self.host_uv_args = ["--index-url", f"http://{pypi}/simple/"]
        self.host_npm_args = ["--registry", f"http://{npm}/"]

    def close(self) -> None:
        if self.rig is not None:
            self.rig.close()


def in_session(project: Path, state: Path, what: str, pip: str, link: Link) -> float:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "AGENTCELL_STATE_DIR": str(state)}
    p = subprocess.run([AGENTCELL, "session", "start", "--harness", "shell", "--project", str(project),
                        *link.flags, "--cpu", str(100 * (os.cpu_count() or 1)), "--wall-clock", "900", "--json", "--",
                        "sh", "-c", script(pip, what, link)], capture_output=True, text=True, env=env, cwd=project,
                       timeout=1200, stdin=subprocess.DEVNULL)
    m = re.search(r"TOOK=(\d+)", p.stdout)
    if p.returncode != 0 or not m:
        raise SystemExit(f"session failed ({p.returncode}): {p.stdout[-1500:]} {p.stderr[-1500:]}")
    return int(m.group(1)) / 1000


def on_host(project: Path, cache: Path, what: str, pip: str, link: Link) -> float:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(project), "PIP_CACHE_DIR": str(cache / "pip"),
           "UV_CACHE_DIR": str(cache / "uv"), "npm_config_cache": str(cache / "npm")}
    p = subprocess.run(["sh", "-c", script(pip, what, link, host=True)], capture_output=True, text=True, env=env,
                       cwd=project, timeout=1200)
    m = re.search(r"TOOK=(\d+)", p.stdout)
    if p.returncode != 0 or not m:
        raise SystemExit(f"host install failed: {p.stdout[-1500:]} {p.stderr[-1500:]}")
    return int(m.group(1)) / 1000


def fresh_project(base: Path, uid: int, gid: int, lock: Path) -> Path:
    d = base / ("p" + secrets.token_hex(3))
    d.mkdir()
    for name in ("package.json", "package-lock.json"):
        shutil.copy(lock / name, d / name)
        os.chown(d / name, uid, gid)
    os.chown(d, uid, gid)
    return d


def lockfile(base: Path) -> Path:
    """package.json and its package-lock.json for NPM_PKGS, resolved once on the host (no install)."""
    d = base / "lock"
    d.mkdir()
    (d / "package.json").write_text(json.dumps({"name": "bench", "version": "1.0.0", "private": True}))
    subprocess.run(["npm", "install", "-q", "--package-lock-only", "--no-audit", "--no-fund", *NPM_PKGS], cwd=d,
                   env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(d), "npm_config_cache": str(d / "c")},
                   check=True, capture_output=True, timeout=600)
    shutil.rmtree(d / "c", ignore_errors=True)
    return d


def clean(project: Path) -> None:
    for name in ("lib", "node_modules"):
        p = project / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--link", type=int, metavar="MBIT", help="registry stand-ins behind an emulated link")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (a session makes a per-session account; the project is a throwaway user's)")
    pip = pip_binary()
    uv_binary(pip)
    rows: dict[str, list[float]] = {f"{where}{what} {t}": [] for where in ("", "host ") for what in TOOLS
                                    for t in ("cold", "warm")}
    cache_info: dict[str, dict[str, Any]] = {}
    with throwaway("ac-tbench", "caches") as (pw, base, state):
        link = Link()
        try:
            lock = lockfile(base)
            if args.link:
                link.emulate(base, args.link, pip, lock)
            for _ in range(args.rounds):
                for what in TOOLS:
                    project = fresh_project(base, pw.pw_uid, pw.pw_gid, lock)
                    rows[f"{what} cold"].append(in_session(project, state, what, pip, link))
                    clean(project)
                    rows[f"{what} warm"].append(in_session(project, state, what, pip, link))
                    listed = json.loads(subprocess.run([AGENTCELL, "cache", "list", "--json"], capture_output=True,
                                                       text=True, env={"AGENTCELL_STATE_DIR": str(state)}).stdout)
                    cache_info[what] = next(e for e in listed if e["project"] == str(project))
                    host = fresh_project(base, 0, 0, lock)
                    cache = base / ("hostcache" + secrets.token_hex(2))
                    rows[f"host {what} cold"].append(on_host(host, cache, what, pip, link))
                    clean(host)
                    rows[f"host {what} warm"].append(on_host(host, cache, what, pip, link))
                    if what == "pip" and link.wheels is not None:  # pip's own work, with no network at all
                        clean(host)
                        rows.setdefault("host pip offline", []).append(on_host(host, cache, "pip-offline", pip, link))
        finally:
            link.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    out = {"seconds": med, "rounds": args.rounds, "link": f"{args.link} Mbit/s (stand-ins)"
           if args.link else "the real registries", "pip": PIP_PKGS, "uv": UV_PKG, "npm": NPM_PKGS,
           "session_warm_over_cold": {w: round(med[f"{w} warm"] / med[f"{w} cold"], 3) for w in TOOLS},
           "host_warm_over_cold": {w: round(med[f"host {w} warm"] / med[f"host {w} cold"], 3)
                                   for w in TOOLS},
           "cache": {w: {k: c.get(k) for k in ("path", "owner", "bytes", "tools")} for w, c in cache_info.items()}}
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in med.items():
            print(f"{k:<16} {v:7.2f} s")
        for w in TOOLS:
            print(f"{w}: second session / first = {out['session_warm_over_cold'][w]:.2f} "
                  f"(the host's own warm / cold: {out['host_warm_over_cold'][w]:.2f})")
        if "host pip offline" in med:
            off = med["host pip offline"]
            print(f"pip with no network at all (--no-index, its own unpacking and compiling): {off:.2f} s, "
                  f"{off / med['host pip cold']:.2f} of a cold install")
        for w, c in cache_info.items():
            print(f"{w}'s cache (between sessions): {c.get('path')}, owner {c.get('owner')}, {c.get('bytes')} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
