"""Credentials that never enter the cell, end to end: ``agentcell run --secret`` with real curl in a real
cell, the real proxy, and an HTTPS server of the test's own on the fake internet (api.test, with a
test CA standing in for the public ones). The value is the test's; nothing here is a real key."""
from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentcell.network.tlsca import SessionCA
from conftest import User, agentcell_run, needs_root
from fakenet import API4, DNS4, FakeInternet, leftovers

pytestmark = needs_root

KEY = "sk-ant-api03-" + secrets.token_urlsafe(60) + "AA"  # a fresh value per run: a hit is this run's
GH = "ghp_" + secrets.token_hex(18)
BASE = ["--net", "proxy", "--resolver", DNS4, "--allow-range", "198.18.0.0/15", "--allow-domain", "api.test",
        "--allow-domain", "good.test"]

SERVER = r'''
import http.server, json, ssl, sys
cert, key, log = sys.argv[1:4]
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        with open(log, "a") as f:
            f.write(json.dumps([self.path, dict(self.headers.items())]) + "\n")
        body = b"data: hello\n\n"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_POST = do_GET
    def log_message(self, *a):
        pass
import threading
plain = http.server.ThreadingHTTPServer(("198.18.1.30", 80), H)  # (a gateway without TLS)
threading.Thread(target=plain.serve_forever, daemon=True).start()
srv = http.server.ThreadingHTTPServer(("198.18.1.30", 443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
print("ready", flush=True)
srv.serve_forever()
'''


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """The fake internet with an HTTPS api.test; yields the public CA's file and the server's request log."""
    work = tmp_path_factory.mktemp("api")
    work.chmod(0o755)
    public = SessionCA("test-public-ca", ("api.test",))
    chain, key = public.leaf("api.test")
    (work / "chain.pem").write_bytes(chain)
    (work / "key.pem").write_bytes(key)
    (work / "ca.pem").write_bytes(public.pem)
    log = work / "requests.log"
    log.write_text("")
    fake = FakeInternet(work)
    server = None
    try:
        server = fake.run_in([sys.executable, "-c", SERVER, str(work / "chain.pem"), str(work / "key.pem"), str(log)],
                             stdout=subprocess.PIPE)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield {"ca": str(work / "ca.pem"), "log": log, "inet": fake}
    finally:
        if server is not None:
            server.kill()
            server.wait()
        fake.close()
        assert leftovers(fake) == []


def requests(api: dict[str, object]) -> list[tuple[str, dict[str, str]]]:
    log = api["log"]
    assert isinstance(log, Path)
    out = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    log.write_text("")
    return out  # type: ignore[return-value]


def run(user: User, api: dict[str, object], script: str, *extra: str) -> tuple[int, str, str, dict[str, object]]:
    r = agentcell_run(["--as", str(user.uid), *BASE, "--secret", "ANTHROPIC_API_KEY",
                       "--secret-host", "ANTHROPIC_API_KEY=api.test:x-api-key,authorization",
                       "--upstream-ca", str(api["ca"]), *extra, "--", "sh", "-c", script],
                      env={"ANTHROPIC_API_KEY": KEY}, timeout=90)
    return r.rc, r.out, r.err, r.result


def test_the_host_gets_the_real_key_and_the_cell_holds_only_the_placeholder(user: User, api: dict[str, object]) -> None:
    script = ('echo "env=$ANTHROPIC_API_KEY"; cat /proc/self/environ | tr "\\0" "\\n" | grep -c sk-ant-; '
              'curl -sS -H "x-api-key: $ANTHROPIC_API_KEY" https://api.test/v1/messages; '
              'python3 -c "import urllib.request, os; r = urllib.request.Request(\'https://api.test/py\', '
              'headers={\'authorization\': \'Bearer \' + os.environ[\'ANTHROPIC_API_KEY\']}); '
              'print(urllib.request.urlopen(r).read().decode())"')
    rc, out, err, result = run(user, api, script)
    assert KEY not in out and KEY not in err and KEY not in json.dumps(result), "the real value reached the cell"
    lines = out.splitlines()
    placeholder = lines[0].removeprefix("env=")
    assert placeholder.startswith("sk-ant-api03-") and len(placeholder) == len(KEY) and placeholder != KEY
    assert lines[1] == "1"  # the environment holds the placeholder, once
    seen = requests(api)
    assert [p for p, _ in seen] == ["/v1/messages", "/py"], (seen, out, err)
    assert seen[0][1]["x-api-key"] == KEY and seen[1][1]["Authorization"] == f"Bearer {KEY}"
    assert lines.count("data: hello") == 2, out
    assert rc == 0, err


def test_the_placeholder_in_a_url_or_to_another_host_is_refused_and_ends_the_cell(user: User,
                                                                                  api: dict[str, object]) -> None:
    for script, why in (
            ('curl -sS "https://api.test/v1/messages?key=$ANTHROPIC_API_KEY"; sleep 5; echo survived', "in the URL"),
            ('curl -sS -H "x-api-key: $ANTHROPIC_API_KEY" http://good.test/; sleep 5; echo survived',
             "plain-HTTP request"),
            ('curl -sS -H "x-other: $ANTHROPIC_API_KEY" https://api.test/; sleep 5; echo survived',
             "in the header x-other")):
        rc, out, err, result = run(user, api, script, "--monitor")
        assert "survived" not in out and rc == 137, (script, out, err)
        events = result["events"]
        assert isinstance(events, list) and events, result
        assert events[0]["source"] == "proxy" and why in events[0]["reason"], events
        assert KEY not in out + err + json.dumps(result)
    assert requests(api) == []  # nothing of it went out


def test_git_push_over_https_authenticates_with_the_injected_token(user: User, api: dict[str, object],
                                                                   tmp_path: Path) -> None:
    """A GitHub-style host: git's smart HTTP asks for Basic credentials; git gets the placeholder from a
    credential helper (as from GH_TOKEN), the proxy puts the token in, inside the Basic credentials."""
    root = tmp_path / "repos"
    root.mkdir()
    subprocess.run(["git", "init", "-q", "--bare", str(root / "r.git")], check=True)
    subprocess.run(["git", "-C", str(root / "r.git"), "config", "http.receivepack", "true"], check=True)
    subprocess.run(["chmod", "-R", "a+rwX", str(tmp_path)], check=True)
    fake = api["inet"]
    assert isinstance(fake, FakeInternet)
    work = Path(str(api["ca"])).parent
    server = fake.run_in([sys.executable, str(Path(__file__).parent / "mirror.py"), API4, "8443", "git", str(root),
                          str(work / "chain.pem"), str(work / "key.pem"), GH], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        script = ('cd /tmp && git init -q w && cd w && echo hi > f && git add f && '
                  'git -c user.name=a -c user.email=a@a.invalid commit -qm one && '
                  'git -c credential.helper="!f() { echo username=x-access-token; echo password=$GH_TOKEN; }; f" '
                  'push -q https://api.test:8443/r.git HEAD:main 2>&1; echo "pushed=$?"')
        r = agentcell_run(["--as", str(user.uid), *BASE, "--allow-domain", "api.test:8443", "--secret", "GH_TOKEN",
                           "--secret-host", "GH_TOKEN=api.test:authorization", "--upstream-ca", str(api["ca"]), "--",
                           "sh", "-c", script], env={"GH_TOKEN": GH}, timeout=120)
    finally:
        server.kill()
        _, err = server.communicate()
    assert "pushed=0" in r.out, (r.out, r.err, err[-2000:])
    log = subprocess.run(["git", "-C", str(root / "r.git"), "log", "--format=%s", "main"], capture_output=True,
                         text=True, check=True).stdout
    assert log.strip() == "one"
    assert "refused token" not in err and GH not in r.out + r.err


def test_a_gateway_without_tls_gets_the_key_only_where_it_is_bound_over_plain_http(user: User,
                                                                                  api: dict[str, object]) -> None:
    script = ('curl -sS -H "x-api-key: $GW_KEY" http://api.test/gw; '
              'curl -sS -H "x-api-key: $GW_KEY" http://good.test/; sleep 5; echo survived')
    r = agentcell_run(["--as", str(user.uid), *BASE, "--secret", "GW_KEY", "--secret-host", "GW_KEY=http://api.test",
                       "--upstream-ca", str(api["ca"]), "--monitor", "--", "sh", "-c", script],
                      env={"GW_KEY": GH}, timeout=90)
    seen = requests(api)
    assert [(p, h["x-api-key"]) for p, h in seen] == [("/gw", GH)], (seen, r.out, r.err)
    # to another host over plain HTTP: a placeholder where it does not belong (over HTTPS to api.test it
    # would be a tunnel the proxy never opens: not bound over HTTPS, not intercepted)
    assert "survived" not in r.out and r.rc == 137, (r.out, r.err)
    events = r.result["events"]
    assert isinstance(events, list) and "sent over plain HTTP to good.test" in events[0]["reason"], events
    assert GH not in r.out + r.err


def test_secret_flags_are_checked_before_anything_runs(user: User, api: dict[str, object]) -> None:
    for args, env, want in (
            (["--secret", "K"], {}, "--secret: K is not set in the environment"),
            (["--secret", "K", "--secret-host", "K=elsewhere.test"], {"K": GH},
             "--secret-host: elsewhere.test is not on the allow-list"),
            (["--secret-host", "K=api.test"], {}, "--secret-host: says where a --secret goes"),
            (["--secret", "K", "--secret-host", "K=api.test", "--upstream-ca", "/nonexistent"], {"K": GH},
             "--upstream-ca: /nonexistent does not exist")):
        r = agentcell_run(["--as", str(user.uid), *BASE, *args, "--", "true"], env=env, timeout=30)
        assert r.rc == 125 and r.err.strip().endswith(")") and want in r.err and r.err.count("\n") == 1, (args, r.err)
        assert GH not in r.err
    r = agentcell_run(["--as", str(user.uid), "--net", "none", "--secret", "K", "--secret-host", "K=api.test", "--",
                       "true"], env={"K": GH}, timeout=30)
    assert r.rc == 125 and "--secret: credentials are injected by the egress proxy" in r.err, r.err

