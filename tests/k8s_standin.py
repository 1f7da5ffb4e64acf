"""A stand-in for a Kubernetes API server's discovery and OpenAPI endpoints, on loopback, for kubectl's client-side
validation (tests/test_k8s.py).

No API server can run on these machines, and kubectl validates only with the documents a server gives it
(without one: "failed to download openapi"). This mock serves those documents and nothing else:

* ``/api``, ``/apis`` and each group version's resource list (discovery, as JSON: kubectl maps kinds with it);
* ``/openapi/v2`` as protobuf, the document kubectl's ``--validate=strict`` checks objects against. It holds the
  vendored CRDs' v1beta1 schemas (agent-sandbox release v0.5.6) converted as an API server publishes a CRD (metadata
  as ObjectMeta), and the vendored Kubernetes 1.32 OpenAPI v3 schemas of NetworkPolicy and ConfigMap converted to
  v2. It has no paths: kubectl asks the paths whether the server validates fields itself, and with none it
  validates on the client, as against a server without server-side field validation;
* ``/openapi/v3`` is not served (404), so kubectl asks /openapi/v2 that question.

Any request that is not a GET (a write: kubectl must send none with --dry-run=client) is answered 405 and recorded.
What passes here passed kubectl's own validation code against these schemas; it is not a cluster's admission.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

DATA = Path(__file__).parent / "data" / "k8s"
CRDS = DATA / "agent-sandbox"
GROUP, VERSION = "extensions.agents.x-k8s.io", "v1beta1"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
PROTOBUF = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"  # as an API server answers
BUILTIN = {  # vendored OpenAPI v3 document -> (group, version, kind, plural)
    "apis__networking.k8s.io__v1_openapi.json": ("networking.k8s.io", "v1", "NetworkPolicy", "networkpolicies"),
    "api__v1_openapi.configmap.json": ("", "v1", "ConfigMap", "configmaps"),
}


def crds() -> dict[str, dict[str, Any]]:
    """kind -> the CRD's v1beta1 version entry (its openAPIV3Schema under schema)."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == VERSION]
        out[crd["spec"]["names"]["kind"]] = {**version, "plural": crd["spec"]["names"]["plural"]}
    return out


def builtin_components() -> dict[str, Any]:
    """Every component schema of the vendored Kubernetes 1.32 documents, by name."""
    out: dict[str, Any] = {}
    for name in BUILTIN:
        out.update(json.loads((DATA / "kubernetes-1.32" / name).read_text())["components"]["schemas"])
    return out


def builtin_name(kind: str) -> str:
    group = next(g for g, _, k, _ in BUILTIN.values() if k == kind)
    return f"io.k8s.api.{group.split('.')[0] or 'core'}.v1.{kind}"


# ---- OpenAPI v2 as protobuf (gnostic's openapi_v2.Document, the fields kubectl reads) ------------

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _str(field: int, text: str) -> bytes:
    return _bytes(field, text.encode())


def _named_any(name: str, value: Any) -> bytes:  # NamedAny{name, Any{yaml}}: how vendor extensions travel
    return _str(1, name) + _bytes(2, _str(2, yaml.safe_dump(value)))


def _schema(s: dict[str, Any]) -> bytes:
    """A v3 (structural or built-in) schema as a v2 Schema message: what kubectl's validation looks at."""
    ref = s.get("$ref") or (s["allOf"][0].get("$ref") if len(s.get("allOf", [])) == 1 else None)
    if ref:
        return _str(1, ref.replace("#/components/schemas/", "#/definitions/"))
    if s.get("x-kubernetes-preserve-unknown-fields") or s.get("x-kubernetes-int-or-string"):
        return b""  # anything goes: v2 has no int-or-string, and kubectl reads no x-kubernetes-preserve-...
    out = b""
    if "format" in s:
        out += _str(2, s["format"])
    for name in s.get("required", []):
        out += _str(19, name)
    extra = s.get("additionalProperties")
    if isinstance(extra, dict):
        out += _bytes(21, _bytes(1, _schema(extra)))
    elif isinstance(extra, bool):
        out += _bytes(21, _varint(2 << 3) + _varint(int(extra)))
    if "type" in s:
        out += _bytes(22, _str(1, s["type"]))
    if "items" in s:
        out += _bytes(23, _bytes(1, _schema(s["items"])))
    if "properties" in s:
        out += _bytes(25, b"".join(_bytes(1, _str(1, k) + _bytes(2, _schema(v))) for k, v in s["properties"].items()))
    if "x-kubernetes-group-version-kind" in s:
        out += _bytes(31, _named_any("x-kubernetes-group-version-kind", s["x-kubernetes-group-version-kind"]))
    return out


def openapi_v2() -> bytes:
    definitions: dict[str, dict[str, Any]] = dict(builtin_components())
    for kind, version in crds().items():
        root = dict(version["schema"]["openAPIV3Schema"])
        root["properties"] = {**root["properties"], "metadata": {"$ref": f"#/definitions/{OBJECT_META}"}}
        root["x-kubernetes-group-version-kind"] = [{"group": GROUP, "kind": kind, "version": VERSION}]
        definitions[f"io.x-k8s.agents.extensions.{VERSION}.{kind}"] = root
    named = b"".join(_bytes(1, _str(1, name) + _bytes(2, _schema(s))) for name, s in sorted(definitions.items()))
    info = _str(1, "Kubernetes (agentcell's test stand-in)") + _str(2, "v1.32.0")
    return _str(1, "2.0") + _bytes(2, info) + _bytes(9, named)


# ---- discovery -------------------------------------------------------------------------------

def _resources(group_version: str, kinds: list[tuple[str, str]]) -> dict[str, Any]:
    verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version,
            "resources": [{"name": plural, "singularName": kind.lower(), "namespaced": True, "kind": kind,
                           "verbs": verbs} for kind, plural in kinds]}


def documents() -> dict[str, tuple[str, bytes]]:
    """path -> (content type, body): everything the stand-in serves."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for group, version, kind, plural in BUILTIN.values():
        groups.setdefault(f"{group}/{version}".lstrip("/"), []).append((kind, plural))
    groups[f"{GROUP}/{VERSION}"] = [(kind, v["plural"]) for kind, v in crds().items()]
    named = sorted({gv.split("/")[0] for gv in groups if "/" in gv})
    docs: dict[str, Any] = {
        "/version": {"major": "1", "minor": "32", "gitVersion": "v1.32.0-agentcell-stand-in"},
        "/api": {"kind": "APIVersions", "versions": ["v1"],
                 "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]},
        "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
            {"name": g, "versions": [{"groupVersion": gv, "version": gv.split("/")[1]} for gv in groups
                                     if gv.startswith(g + "/")],
             "preferredVersion": next({"groupVersion": gv, "version": gv.split("/")[1]} for gv in groups
                                      if gv.startswith(g + "/"))} for g in named]},
    }
    for gv, kinds in groups.items():
        docs[f"/api/{gv}" if "/" not in gv else f"/apis/{gv}"] = _resources(gv, kinds)
    out = {path: ("application/json", json.dumps(body).encode()) for path, body in docs.items()}
    out["/openapi/v2"] = (PROTOBUF, openapi_v2())
    return out


class StandInAPIServer:
    """The documents above on 127.0.0.1 (a port of its own), until close()."""

    def __init__(self) -> None:
        served = documents()
        self.requests: list[tuple[str, str]] = []
        self.writes: list[tuple[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                outer.requests.append(("GET", self.path))
                if path in served:
                    self._send(200, *served[path])
                else:
                    self._send(404, "application/json", json.dumps(
                        {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                         "code": 404, "message": f"the stand-in does not serve {path}"}).encode())

            def _refuse(self) -> None:
                outer.writes.append((self.command, self.path))
                self._send(405, "application/json", b'{"kind":"Status","code":405}')

            do_POST = do_PUT = do_PATCH = do_DELETE = _refuse  # noqa: N815

            def _send(self, code: int, ctype: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="k8s-stand-in", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "stand-in", "preferences": {},
            "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
            "users": [{"name": "nobody", "user": {}}],
            "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "nobody",
                                                          "namespace": "default"}}]}))
        return path

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

