"""The benign corpus (issue 15): ordinary work in a watched session raises no acting event, and the notes
it raises are listed here. The real harnesses' turns are in test_harnesses.py; here, through
``agentcell session start --harness shell`` on a fake internet of the test's own (a mock of the internet:
the one part that cannot exist here):

* git clone, status, commit and push over HTTPS (git's smart HTTP, with a test CA the cell is told of)
  and over ssh (with a key the user gives), to git.test;
* ``npm install`` and ``pip install`` through the proxy, from registry mirrors the test serves;
* pytest, and make with cc;
* an editor (vim) writing its swap and backup files;
* the host's account churn (useradd, userdel) while a session runs.
"""
from __future__ import annotations

import base64
import datetime
import fnmatch
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentcell.accounts.ephemeral import UID_FIRST
from agentcell.harness.check import Rig
from conftest import AGENTCELL, User, _drop_user, _make_user, needs_root
from harnesses import Unavailable, bin_dir
from sessionkit import Env, session, session_environ
from sessionkit import env as env  # the fixture, under its own name

pytestmark = needs_root

HERE = Path(__file__).parent
PKG, VERSION = "agentcell-probe-pkg", "1.0.0"
WHEEL = "agentcell_probe_pkg-1.0.0-py3-none-any.whl"
# A note ordinary work may raise (it may come or not): the CPU ceiling held a busy moment back.
COMMON_NOTES = [("resource", "cpu_throttled", "cgroup")]


class Net:
    """The fake internet's servers: git.test (HTTPS git, ssh git), registry.test (npm), pypi.test (pip)."""

    def __init__(self, rig: Rig, work: Path) -> None:
        self.rig, self.work = rig, work
        self.ca, self.key = work / "ca.pem", work / "agent_key"
        self.repos = work / "repos"
        _certificates(work, "git.test")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)], check=True)
        seed = work / "seed"
        subprocess.run(["git", "init", "-q", "-b", "main", str(seed)], check=True)
        (seed / "hello.txt").write_text("from git.test\n")
        _git(seed, "add", ".")
        _git(seed, "commit", "-qm", "one")
        subprocess.run(["git", "clone", "-q", "--bare", str(seed), str(self.repos / "repo.git")], check=True)
        _registries(work)
        subprocess.run(["chmod", "-R", "a+rX", str(work)], check=True)
        git = rig.hosts["git.test"]
        mirror = [sys.executable, str(HERE / "mirror.py")]
        rig.net.start([*mirror, git, "443", "git", str(self.repos), str(work / "leaf.pem"), str(work / "leaf.key")],
                      ready=b"ready", as_nobody=False)  # it writes what is pushed
        rig.net.start([sys.executable, str(HERE / "sshserver.py"), git, "22", f"{self.key}.pub", str(self.repos),
                       str(work / "ssh.log")], ready=b"ready", as_nobody=False)
        rig.net.start([*mirror, rig.hosts["registry.test"], "80", "files", str(work / "npm")], ready=b"ready")
        rig.net.start([*mirror, rig.hosts["pypi.test"], "80", "files", str(work / "pypi")], ready=b"ready")

    def flags(self, *domains: str) -> list[str]:
        return ["--resolver", self.rig.dns, "--allow-range", self.rig.net_range,
                *(f for d in domains for f in ("--allow-domain", d))]


def _git(where: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(where), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True)


def _certificates(work: Path, *names: str) -> None:
    """A test CA (standing in for the public ones) and a leaf for ``names`` signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agentcell test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True).sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca_name).public_key(leaf_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (work / "ca.pem").write_bytes(ca.public_bytes(pem))
    (work / "leaf.pem").write_bytes(leaf.public_bytes(pem))
    (work / "leaf.key").write_bytes(leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))


def _registries(work: Path) -> None:
    """npm's packument and tarball, pip's simple index and wheel, for one tiny package."""
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as tar:
        for name, text in (("package/package.json", json.dumps({"name": PKG, "version": VERSION, "main": "index.js"})),
                           ("package/index.js", "module.exports = 'from the mirror';\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    blob = tgz.getvalue()
    (work / "npm" / "tarballs").mkdir(parents=True)
    (work / "npm" / "tarballs" / f"{PKG}-{VERSION}.tgz").write_bytes(blob)
    dist = {"tarball": f"http://registry.test/tarballs/{PKG}-{VERSION}.tgz", "shasum": hashlib.sha1(blob).hexdigest(),
            "integrity": "sha512-" + base64.b64encode(hashlib.sha512(blob).digest()).decode()}
    (work / "npm" / PKG).write_text(json.dumps({"name": PKG, "dist-tags": {"latest": VERSION}, "versions": {
        VERSION: {"name": PKG, "version": VERSION, "main": "index.js", "dist": dist}}}))
    files = {"agentcell_probe_pkg/__init__.py": b"WHERE = 'from the mirror'\n",
             "agentcell_probe_pkg-1.0.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {PKG}\n"
                                                              f"Version: {VERSION}\n".encode(),
             "agentcell_probe_pkg-1.0.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\n"
                                                          b"Root-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).decode().rstrip('=')},"
                     f"{len(d)}\n" for n, d in files.items()) + "agentcell_probe_pkg-1.0.0.dist-info/RECORD,,\n"
    whl = io.BytesIO()
    with zipfile.ZipFile(whl, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr("agentcell_probe_pkg-1.0.0.dist-info/RECORD", record)
    (work / "pypi" / "packages").mkdir(parents=True)
    (work / "pypi" / "packages" / WHEEL).write_bytes(whl.getvalue())
    digest = hashlib.sha256(whl.getvalue()).hexdigest()
    index = work / "pypi" / "simple" / PKG
    index.mkdir(parents=True)
    (index / "index.html").write_text(f'<a href="/packages/{WHEEL}#sha256={digest}">{WHEEL}</a>\n')


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    work = Path(tempfile.mkdtemp(prefix="agentcell-benign-"))  # its servers run as nobody: not under 0700 dirs
    os.chmod(work, 0o755)
    rig = Rig(str(work), hosts={"git.test": 90, "registry.test": 91, "pypi.test": 92})
    try:
        yield Net(rig, work)
    finally:
        rig.close()
        shutil.rmtree(work, ignore_errors=True)
        assert rig.net.leftovers() == []


def shell(env: Env, script: str, *flags: str, timeout: float = 300) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """A session whose agent is ``sh -c script`` (in the project): its summary, its events, its output."""
    s = session(env, ["start", "--harness", "shell", "--json", *flags, "--", "sh", "-c", script], timeout=timeout)
    events = session(env, ["show", s.summary["session"], "--json"]).summary.get("events") or []
    return s.summary, events, s.out + s.err


def nothing_acts(summary: dict[str, Any], events: list[dict[str, Any]], out: str,
                 notes: list[tuple[str, str, str]] = ()) -> None:  # type: ignore[assignment]
    assert summary["status"] == "completed" and summary["exit_status"] == 0, (summary, events, out[-3000:])
    assert [e for e in events if e["acts"] and e["operation"] != "resource"] == [], events
    listed = [*notes, *COMMON_NOTES]
    unlisted = [e for e in events if not any(e["operation"] == op and fnmatch.fnmatchcase(e["target"], target)
                                             and e["source"] == source for op, target, source in listed)]
    assert unlisted == [], unlisted


def _given(env: Env, *paths: Path) -> None:
    """Files the test puts in the project for the agent, the project owner's."""
    owner = env.project.stat()
    for p in paths:
        os.chown(p, owner.st_uid, owner.st_gid)


def test_git_over_https_clones_commits_and_pushes_with_nothing_acting(env: Env, net: Net) -> None:
    ca = env.project / "ca.pem"
    shutil.copy(net.ca, ca)
    _given(env, ca)
    script = ("set -e; git clone -q https://git.test/repo.git clone; cd clone; git status --short; "
              "echo more >> hello.txt; git -c user.name=agent -c user.email=a@t commit -qam two; "
              "git push -q origin main; git status -sb")
    summary, events, out = shell(env, script, *net.flags("git.test:443"), "--env", f"GIT_SSL_CAINFO={ca}")
    # libcurl asks the resolver /etc/resolv.conf names for git.test before it goes through the proxy: the
    # cell has none (names are resolved by the proxy), so it is a note, and the clone goes on
    nothing_acts(summary, events, out, [("network", "*:53", "calls")])
    log = subprocess.run(["git", "--git-dir", str(net.repos / "repo.git"), "log", "--format=%s", "main"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert log[0] == "two", log


def test_git_over_ssh_clones_commits_and_pushes_with_nothing_acting(env: Env, net: Net) -> None:
    prepared = env.state / "home"
    (prepared / ".ssh").mkdir(parents=True)
    shutil.copy(net.key, prepared / ".ssh" / "deploy_key")
    (prepared / ".ssh" / "deploy_key").chmod(0o600)
    ssh = "ssh -i ~/.ssh/deploy_key -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"
    script = ("set -e; git clone -q ssh://git@git.test/repo.git clone-ssh; cd clone-ssh; git status --short; "
              "echo ssh >> hello.txt; git -c user.name=agent -c user.email=a@t commit -qam three; "
              "git push -q origin main")
    summary, events, out = shell(env, script, *net.flags("git.test:22"), "--home-from", str(prepared),
                                 "--env", f"GIT_SSH_COMMAND={ssh}")
    # ssh asks the resolver about git.test (a note: the cell has none; its ProxyCommand goes through the
    # proxy, which resolves); that ProxyCommand (python3) may still run when ssh is done
    nothing_acts(summary, events, out, [("network", "*:53", "calls"), ("execute", "/usr/bin/python3*", "exec")])
    log = subprocess.run(["git", "--git-dir", str(net.repos / "repo.git"), "log", "--format=%s", "main"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert "three" in log, log


def test_npm_and_pip_install_through_the_proxy_from_mirrors_with_nothing_acting(env: Env, net: Net) -> None:
    try:
        pip = bin_dir("pytest") / "pip"  # a venv of the system's Python, under /opt, which the cell sees
    except Unavailable as e:
        pytest.skip(str(e))
    (env.project / "package.json").write_text(json.dumps({"name": "app", "version": "1.0.0", "private": True}))
    _given(env, env.project / "package.json")
    script = (f"set -e; npm install --no-audit --no-fund --no-update-notifier --registry http://registry.test/ {PKG}; "
              "node -e \"console.log(require('" + PKG + "'))\"; "
              f"{pip} install -q --disable-pip-version-check --no-cache-dir --index-url http://pypi.test/simple/ "
              f"--trusted-host pypi.test --target lib {PKG}; "
              "PYTHONPATH=lib python3 -c 'import agentcell_probe_pkg as p; print(p.WHERE)'")
    summary, events, out = shell(env, script, *net.flags("registry.test:80", "pypi.test:80"))
    nothing_acts(summary, events, out)
    assert out.count("from the mirror") == 2, out[-2000:]


def test_a_second_session_installs_from_the_projects_cache_and_another_project_has_none(
        env: Env, net: Net, user: User) -> None:
    """The toolchain caches (issue 26): the first session's pip, uv and npm fill the project's cache at
    /cache (its account owns it then; root between sessions); with the wheel and the tarball gone from
    the registries, the next session of that project installs them from there (uv copies out of its
    cache without a warning: /cache is a mount of its own), and a session of another project (same
    human) cannot."""
    try:
        pip, uv = bin_dir("pytest") / "pip", bin_dir("uv") / "uv"
    except Unavailable as e:
        pytest.skip(str(e))
    (env.project / "package.json").write_text(json.dumps({"name": "app", "version": "1.0.0", "private": True}))
    _given(env, env.project / "package.json")
    install = (f"rm -rf node_modules lib; npm install --no-audit --no-fund --no-update-notifier "
               f"--registry http://registry.test/ {PKG} && node -e \"console.log(require('{PKG}'))\" && "
               f"{pip} install --disable-pip-version-check --index-url http://pypi.test/simple/ "
               f"--trusted-host pypi.test --target lib {PKG} && "
               "PYTHONPATH=lib python3 -c 'import agentcell_probe_pkg as p; print(p.WHERE)' && "
               f"rm -rf lib && {uv} pip install --python /usr/bin/python3 --index-url http://pypi.test/simple/ "
               f"--target lib {PKG} && PYTHONPATH=lib python3 -c 'import agentcell_probe_pkg as p; print(p.WHERE)'")
    owner = "echo cache-owner=$(stat -c %u /cache/pip)/$(id -u) PIP_CACHE_DIR=$PIP_CACHE_DIR"
    flags = net.flags("registry.test:80", "pypi.test:80")
    summary, events, out = shell(env, f"set -e; {owner}; {install}", *flags)
    nothing_acts(summary, events, out)
    assert out.count("from the mirror") == 3 and "hardlink" not in out, out[-2000:]
    mine = [ln for ln in out.splitlines() if ln.startswith("cache-owner=")]
    uid = mine[0].removeprefix("cache-owner=").split()[0].split("/")
    assert uid[0] == uid[1] and int(uid[0]) >= UID_FIRST and "PIP_CACHE_DIR=/cache/pip" in mine[0], mine
    listed = json.loads(subprocess.run([AGENTCELL, "cache", "list", "--json"], env=session_environ(env),
                                       capture_output=True, text=True, check=True).stdout)
    assert [e["project"] for e in listed] == [str(env.project)] and {"npm", "pip", "uv"} <= set(listed[0]["tools"]), \
        listed
    tree = Path(listed[0]["path"])
    assert tree.is_relative_to(env.state) and (tree.stat().st_uid, tree.stat().st_mode & 0o777) == (0, 0o700)
    assert all(p.lstat().st_uid == 0 for p in tree.rglob("*")), "what the account made went back to root"
    gone = [net.work / "pypi" / "packages" / WHEEL, net.work / "npm" / "tarballs" / f"{PKG}-{VERSION}.tgz"]
    kept = [(p, p.read_bytes()) for p in gone]
    for p in gone:
        p.unlink()
    try:
        summary, events, out = shell(env, f"set -e; {install}", *flags)
        nothing_acts(summary, events, out)
        cached = f"Using cached http://pypi.test/packages/{WHEEL}"
        assert out.count("from the mirror") == 3 and cached in out and "hardlink" not in out, out[-2000:]
        other = env.state.parent / f"agentcell-test-other-{os.getpid()}"
        other.mkdir()
        try:
            shutil.copy(env.project / "package.json", other / "package.json")
            for p in (other, other / "package.json"):
                os.chown(p, user.uid, user.gid)
            s = session(env, ["start", "--harness", "shell", "--json", "--project", str(other), *flags, "--", "sh",
                              "-c", f"ls -A /cache/pip /cache/npm; {install}"], timeout=300)
            assert s.summary["status"] == "completed" and s.summary["exit_status"] != 0, (s.out, s.err)
            assert "from the mirror" not in s.out and "Using cached" not in s.out, s.out[-2000:]
        finally:
            shutil.rmtree(other, ignore_errors=True)
    finally:
        for p, data in kept:
            p.write_bytes(data)
            p.chmod(0o644)
    off, _, out = shell(env, "test -e /cache && echo has-cache || echo no-cache; echo ${PIP_CACHE_DIR:-unset}",
                        "--cache", "off")
    assert off["exit_status"] == 0 and "no-cache\nunset" in out, out


def test_pytest_and_make_with_cc_with_nothing_acting(env: Env) -> None:
    try:
        pytest_bin = bin_dir("pytest") / "pytest"
    except Unavailable as e:
        pytest.skip(str(e))
    (env.project / "src" / "test_app.py").write_text("from app import x\n\n\ndef test_x():\n    assert x == 1\n")
    c = env.project / "c"
    c.mkdir()
    (c / "hello.c").write_text('#include <stdio.h>\nint main(void) { puts("hello from cc"); return 0; }\n')
    (c / "Makefile").write_text("hello: hello.c\n\tcc -O2 -o hello hello.c\n")
    _given(env, env.project / "src" / "test_app.py", c, c / "hello.c", c / "Makefile")
    summary, events, out = shell(env, f"set -e; cd src && {pytest_bin} -q -p no:cacheprovider; cd ../c && make && "
                                      "./hello")
    nothing_acts(summary, events, out)
    assert "1 passed" in out and "hello from cc" in out, out[-2000:]


def test_an_editor_writing_its_swap_and_backup_files_raises_nothing(env: Env) -> None:
    if shutil.which("vim") is None:
        pytest.skip("vim is not installed")
    script = ("set -e; vim -u NONE -N -i NONE -es --cmd 'set swapfile backup writebackup backupskip=' "
              "-c 'normal Gox = 2' -c 'wq' src/app.py; ls -a src; cat src/app.py")
    summary, events, out = shell(env, script)
    nothing_acts(summary, events, out)
    assert "x = 2" in out and "app.py~" in out, out[-2000:]


def test_the_hosts_account_churn_raises_nothing_in_a_running_session(env: Env) -> None:
    """useradd and userdel replace /etc/passwd, /etc/shadow and /etc/gshadow by a rename while the session
    runs: the masks over the shadow files go with the old files, and the new ones are root's 0600 again."""
    argv = [AGENTCELL, "session", "start", "--harness", "shell", "--json", "--", "sh", "-c",
            "sleep 3; cat /etc/passwd >/dev/null"]
    sup = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=env.project,
                           env=session_environ(env))
    made: list[User] = []
    try:
        time.sleep(1.5)
        for _ in range(3):
            made.append(_make_user())
            _drop_user(made.pop())
        out, err = sup.communicate(timeout=120)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
        for u in made:
            _drop_user(u)
    summary = json.loads(out.strip().splitlines()[-1])
    events = session(env, ["show", summary["session"], "--json"]).summary.get("events") or []
    nothing_acts(summary, events, out + err)
    assert events == [] or all(e["operation"] == "resource" for e in events), events

