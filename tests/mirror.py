"""A test server on a fake internet: git's smart HTTP (``git http-backend``) over TLS, or plain static
files (a package registry's mirror: npm's packuments and tarballs, pip's simple index and wheels).

    python tests/mirror.py ADDR PORT git REPO_ROOT CERT KEY [TOKEN]
    python tests/mirror.py ADDR PORT files ROOT [CERT KEY]

With TOKEN, git asks for it as a GitHub-style host does: HTTP Basic (any user, the token as password);
a request without it gets 401 and a Basic challenge, one with another gets 403 (its digest on stderr).

prints ``ready`` once it listens; each request is a line on stderr.
"""
from __future__ import annotations

import http.server
import os
import ssl
import subprocess
import sys
from functools import partial


class Git(http.server.BaseHTTPRequestHandler):
    root = ""
    token = ""

    def _authorized(self) -> bool:
        if not self.token:
            return True
        import base64
        import hashlib

        given = self.headers.get("Authorization", "")
        if not given:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="agentcell test git"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return False
        scheme, _, rest = given.partition(" ")
        password = base64.b64decode(rest).decode().partition(":")[2] if scheme.lower() == "basic" else rest
        if password == self.token:
            return True
        sys.stderr.write(f"refused token {hashlib.sha256(password.encode()).hexdigest()[:16]}\n")
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()
        return False

    def _serve(self) -> None:
        if not self._authorized():
            return
        path, _, query = self.path.partition("?")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        env = {"PATH": "/usr/bin:/bin", "GIT_PROJECT_ROOT": self.root, "GIT_HTTP_EXPORT_ALL": "1",
               "REQUEST_METHOD": self.command, "PATH_INFO": path, "QUERY_STRING": query,
               "CONTENT_TYPE": self.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
               "REMOTE_ADDR": self.client_address[0], "REMOTE_USER": "agent",
               "GIT_PROTOCOL": self.headers.get("Git-Protocol", "")}
        out = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True).stdout
        head, _, payload = out.partition(b"\r\n\r\n")  # a CGI response: its headers, then the body
        status = 200
        headers = []
        for line in head.decode("latin-1").splitlines():
            key, _, value = line.partition(":")
            if key.lower() == "status":
                status = int(value.split()[0])
            elif key:
                headers.append((key, value.strip()))
        self.send_response(status)
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _serve


class Files(http.server.SimpleHTTPRequestHandler):
    """Static files, with what the real registries say of a release's files (PyPI's wheels, npm's
    tarballs, at /tarballs/ or at npm's own /NAME/-/FILE.tgz): they never change, so a client may keep them
    (pip's and npm's caches do)."""

    def end_headers(self) -> None:
        if self.path.startswith(("/packages/", "/tarballs/")) or ("/-/" in self.path and self.path.endswith(".tgz")):
            self.send_header("Cache-Control", "max-age=365000000, immutable, public")
        elif self.path.startswith("/simple/"):  # PyPI's index pages: fresh for ten minutes
            self.send_header("Cache-Control", "max-age=600, public")
        super().end_headers()


class Server(http.server.ThreadingHTTPServer):
    def server_bind(self) -> None:  # without HTTPServer's reverse lookup of its own address (no DNS here)
        import socketserver

        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


def main() -> None:
    addr, port, mode, root = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    if mode == "git":
        Git.root = root
        Git.token = sys.argv[7] if len(sys.argv) > 7 else ""
        server = Server((addr, port), Git)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(sys.argv[5], sys.argv[6])
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    else:
        server = Server((addr, port), partial(Files, directory=root))
        if len(sys.argv) > 6:  # a registry over HTTPS, as the real ones are (a test CA's leaf)
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(sys.argv[5], sys.argv[6])
            server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print("ready", flush=True)
    os.environ.clear()
    server.serve_forever()


if __name__ == "__main__":
    main()
