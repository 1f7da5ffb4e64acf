"""agentcell k8s render: the rendered resources checked against kubernetes-sigs/agent-sandbox's CRD schemas (release
v0.5.6, vendored in tests/data/k8s) with jsonschema, and by kubectl's own client-side validation.

No Kubernetes API server can run on these machines, and kubectl validates only with documents a server serves. The
kubectl tests therefore run against k8s_standin.StandInAPIServer: a mock of an API server's discovery and OpenAPI
endpoints (nothing else), on loopback, built from the same vendored schemas. What passes there passed kubectl's
validation code; whether a cluster admits the resources and agent-sandbox's controllers run the pod as described is
not tested here.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from agentcell.fleet import plan as plans
from agentcell.k8s import image, render
from k8s_standin import OBJECT_META, StandInAPIServer, builtin_components, builtin_name, crds

AGENTCELL = str(Path(sys.executable).parent / "agentcell")
ROOT = Path(__file__).resolve().parent.parent
IMAGE = "registry.example/agentcell:0.1.0"

PLANS: dict[str, dict[str, Any]] = {p["name"]: p for p in [
    {"name": "files-none", "project": {"files": {"app.py": "print(1)\n", "src/lib/util.py": "X = 2\n"}},
     "harness": "scripted", "script": "edit app.py 1 2\nrun python3 app.py", "wall_clock_s": 120, "network": "none"},
    {"name": "git-proxy", "project": {"git": "https://git.example/org/repo.git", "ref": "v1.2"}, "harness": "shell",
     "args": ["sh", "-c", "pip download requests"], "env": {"LANG": "C.UTF-8"},
     "allow_domains": ["pypi.org", "*.pythonhosted.org", "git.internal.example:8443"],
     "allow_ranges": ["10.1.2.0/24"], "resolver": "10.1.2.53"},
    {"name": "presets-any-port", "project": {"git": "git@git.example:org/repo.git"}, "harness": "shell",
     "args": ["true"], "network": "proxy", "allow_presets": ["pypi"], "allow_domains": ["*.example.com:*"]},
    {"name": "loopback-git", "project": {"git": "ssh://git.example:2222/repo.git"}, "harness": "shell",
     "args": ["true"], "network": "loopback", "memory": "2G", "cpu": 50, "pids": 64, "risk": "high"},
    {"name": "host-firewall", "project": {"files": {"a.txt": "a\n"}}, "harness": "shell", "args": ["true"],
     "network": "host-firewall"},
    {"name": "harness-default", "project": {"files": {}}, "harness": "claude_code", "prompt": "fix the tests",
     "api_base": "http://gateway.example:8080", "model": "m"},
]}
# These plans are the operator's own: their network fields and gateway are trusted (--trust-plan-network,
# --allow-api-base); test_a_plan_is_held_to_the_operators_caps has the refusals.
TRUSTED = plans.Caps(plan_network=True, api_bases=("http://gateway.example:8080",))
TRUST_FLAGS = ["--trust-plan-network", "--allow-api-base", "http://gateway.example:8080"]
OPTIONS = {
    "plain": render.Options(image=IMAGE, caps=TRUSTED),
    "gvisor-no-claim": render.Options(image=IMAGE, namespace="agents", runtime_class="gvisor", warm=0, claim=False,
                                      env_secret="harness-keys", caps=TRUSTED),
    "own-namespaces": render.Options(image=IMAGE, runtime_class="kata", warm=3, host_namespaces=False, caps=TRUSTED),
}


def _docs(name: str, opts: render.Options = OPTIONS["plain"]) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in render.render(plans.parse(PLANS[name]), opts)}


# ---- jsonschema against the vendored schemas ---------------------------------------------------

def _strict(s: Any) -> Any:
    """Unknown fields refused, as an API server's strict field validation does (a structural schema would prune
    them silently; the CRDs say nothing of additionalProperties)."""
    if isinstance(s, list):
        return [_strict(v) for v in s]
    if not isinstance(s, dict):
        return s
    out = {k: _strict(v) for k, v in s.items()}
    if "properties" in s and "additionalProperties" not in s and not s.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validators() -> dict[str, jsonschema.Draft7Validator]:
    components = {"schemas": _strict(builtin_components())}
    out = {}
    for kind, version in crds().items():
        root = copy.deepcopy(version["schema"]["openAPIV3Schema"])
        root["properties"]["metadata"] = {"$ref": f"#/components/schemas/{OBJECT_META}"}  # as the server checks it
        out[kind] = jsonschema.Draft7Validator({**_strict(root), "components": components})
    for kind in ("NetworkPolicy", "ConfigMap"):
        out[kind] = jsonschema.Draft7Validator({"$ref": f"#/components/schemas/{builtin_name(kind)}",
                                                "components": components})
    return out


def _errors(validators: dict[str, jsonschema.Draft7Validator], doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validators[doc["kind"]].iter_errors(doc)]


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("name", PLANS)
def test_every_rendered_resource_validates_against_the_vendored_schemas(
        validators: dict[str, jsonschema.Draft7Validator], name: str, opts: str) -> None:
    docs = render.render(plans.parse(PLANS[name]), OPTIONS[opts])
    kinds = [d["kind"] for d in docs]
    assert kinds[-4 if OPTIONS[opts].claim else -3:] == ["NetworkPolicy", "SandboxTemplate", "SandboxWarmPool",
                                                         *(["SandboxClaim"] if OPTIONS[opts].claim else [])]
    assert ("ConfigMap" in kinds) == ("files" in PLANS[name]["project"])
    for doc in docs:
        assert _errors(validators, doc) == [], doc["kind"]
        assert re.fullmatch(render.DNS_SUBDOMAIN, doc["metadata"]["name"])
        assert doc["apiVersion"] == {"NetworkPolicy": "networking.k8s.io/v1", "ConfigMap": "v1"}.get(
            doc["kind"], "extensions.agents.x-k8s.io/v1beta1")


def _broken() -> list[tuple[str, dict[str, Any]]]:
    """One resource of each kind made wrong: an unknown field, a wrong type, a missing required field."""
    d = _docs("files-none")
    cases: list[tuple[str, dict[str, Any]]] = []

    def case(label: str, kind: str, change: Any) -> None:
        doc = copy.deepcopy(d[kind])
        change(doc)
        cases.append((label, doc))

    case("template: an unknown container field", "SandboxTemplate",
         lambda t: t["spec"]["podTemplate"]["spec"]["containers"][0].update(privilegd=True))
    case("template: hostPID as text", "SandboxTemplate",
         lambda t: t["spec"]["podTemplate"]["spec"].update(hostPID="yes"))
    case("pool: replicas as text", "SandboxWarmPool", lambda p: p["spec"].update(replicas="two"))
    case("pool: no template", "SandboxWarmPool", lambda p: p["spec"].pop("sandboxTemplateRef"))
    case("claim: warmPool for warmPoolRef", "SandboxClaim", lambda c: c.update(spec={"warmPool": {"name": "x"}}))
    case("policy: an unknown spec field", "NetworkPolicy", lambda n: n["spec"].update(egres=[]))
    case("policy: endPort as text", "NetworkPolicy",
         lambda n: n["spec"].update(egress=[{"ports": [{"port": 80, "endPort": "high"}]}]))
    case("configmap: immutable as text", "ConfigMap", lambda c: c.update(immutable="yes"))
    case("metadata: an unknown field", "SandboxClaim", lambda c: c["metadata"].update(labelz={}))
    return cases


@pytest.mark.parametrize("label,doc", _broken(), ids=[label for label, _ in _broken()])
def test_a_broken_resource_is_refused_by_the_schemas(
        validators: dict[str, jsonschema.Draft7Validator], label: str, doc: dict[str, Any]) -> None:
    assert _errors(validators, doc), label


# ---- kubectl's client-side validation, against the stand-in ------------------------------------

@pytest.fixture
def apiserver(tmp_path: Path) -> Iterator[StandInAPIServer]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (test.sh installs Debian's kubernetes-client where it is missing)")
    server = StandInAPIServer()
    try:
        yield server
    finally:
        server.close()


def _kubectl_validate(server: StandInAPIServer, tmp_path: Path, manifest: str) -> subprocess.CompletedProcess[str]:
    kubeconfig = server.kubeconfig(tmp_path / "kubeconfig")
    (tmp_path / "manifest.yaml").write_text(manifest)
    version = subprocess.run(["kubectl", "version", "--client", "-o", "json"], capture_output=True, text=True,
                             timeout=60)
    minor = int(re.sub(r"\D.*", "", json.loads(version.stdout)["clientVersion"]["minor"]))
    validate = "--validate=strict" if minor >= 25 else "--validate=true"  # Debian 12's kubectl is 1.20
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}  # no proxy, no user's config
    return subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig), "--cache-dir", str(tmp_path / "cache"),
                           "create", "--dry-run=client", validate, "-o", "name", "-f", str(tmp_path / "manifest.yaml")],
                          capture_output=True, text=True, env=env, timeout=120)


def test_kubectl_validates_every_rendered_resource(apiserver: StandInAPIServer, tmp_path: Path) -> None:
    manifest = "".join(render.dump(render.render(plans.parse(p), opts))
                       for p in PLANS.values() for opts in OPTIONS.values())
    p = _kubectl_validate(apiserver, tmp_path, manifest)
    assert p.returncode == 0, p.stderr
    created = p.stdout.split()
    assert len(created) == manifest.count("\nkind: ") and created[0] == "configmap/files-none-project"
    assert {c.split("/")[0] for c in created} == {
        "configmap", "networkpolicy.networking.k8s.io", *(f"{k}.extensions.agents.x-k8s.io" for k in (
            "sandboxtemplate", "sandboxwarmpool", "sandboxclaim"))}
    assert ("GET", "/openapi/v2") in [(m, path.split("?")[0]) for m, path in apiserver.requests]  # it did validate
    assert apiserver.writes == []  # a client dry run sends nothing


@pytest.mark.parametrize("label,doc", _broken(), ids=[label for label, _ in _broken()])
def test_kubectl_refuses_a_broken_resource(apiserver: StandInAPIServer, tmp_path: Path, label: str,
                                           doc: dict[str, Any]) -> None:
    p = _kubectl_validate(apiserver, tmp_path, render.dump([doc]))
    assert p.returncode != 0, label
    assert "error validating data" in p.stderr and "ValidationError" in p.stderr, p.stderr
    assert apiserver.writes == []


def test_kubectl_lets_a_number_stand_for_a_string_where_jsonschema_does_not(
        validators: dict[str, jsonschema.Draft7Validator], apiserver: StandInAPIServer, tmp_path: Path) -> None:
    """kubectl's validation takes any value where a string is expected (its own rule); the schemas do not."""
    doc = copy.deepcopy(_docs("files-none")["NetworkPolicy"])
    doc["spec"]["egress"] = [{"to": [{"ipBlock": {"cidr": 5}}]}]
    assert _errors(validators, doc)
    assert _kubectl_validate(apiserver, tmp_path, render.dump([doc])).returncode == 0


# ---- what the resources say ----------------------------------------------------------------------

def _egress(name: str) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = _docs(name)["NetworkPolicy"]["spec"]["egress"]
    return rules


def _ports(rule: dict[str, Any]) -> list[int] | None:
    return [p["port"] for p in rule["ports"]] if "ports" in rule else None


def test_network_policy_denies_ingress_and_follows_the_network_mode() -> None:
    for name in PLANS:
        spec = _docs(name)["NetworkPolicy"]["spec"]
        assert spec["policyTypes"] == ["Ingress", "Egress"] and spec["ingress"] == []
        assert spec["podSelector"] == {"matchLabels": {"agentcell/plan": name}}
    assert _egress("files-none") == []  # none: nothing leaves the pod
    dns, web = _egress("git-proxy")
    assert dns["to"] == [{"ipBlock": {"cidr": "10.1.2.53/32"}}] and _ports(dns) == [53, 53]
    assert _ports(web) == [80, 443, 8443]  # the allow-list's ports; names are the proxy's to check
    assert {"ipBlock": {"cidr": "10.1.2.0/24"}} in web["to"]
    public = web["to"][0]["ipBlock"]
    assert public["cidr"] == "0.0.0.0/0" and "169.254.0.0/16" in public["except"] and "10.0.0.0/8" in public["except"]
    dns, web = _egress("presets-any-port")
    assert dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert _ports(web) is None  # *.example.com:* allows any port
    dns, clone = _egress("loopback-git")  # loopback: the agent has no network; the clone has its port
    assert _ports(clone) == [2222] and len(_egress("loopback-git")) == 2
    assert [_ports(r) for r in _egress("host-firewall")[1:]] == [[443]]
    assert [_ports(r) for r in _egress("harness-default")[1:]] == [[80, 443, 8080]]  # the gateway's port too


def test_the_pod_runs_session_start_with_the_plans_flags_as_a_privileged_supervisor() -> None:
    from agentcell.cli import session

    for name, raw in PLANS.items():
        plan = plans.parse(raw)
        pod = _docs(name)["SandboxTemplate"]["spec"]["podTemplate"]["spec"]
        (container,) = pod["containers"]
        assert container["command"][:4] == ["sh", "-c", render.SUPERVISOR, "agentcell-pod"]
        start = container["command"][4:]
        assert start == plan.start_args(render.PROJECT)
        session.parser().parse_args(["start", "--json", *start[:start.index("--")]])  # flags session start knows
        assert container["securityContext"]["privileged"] is True
        assert pod["hostPID"] is pod["hostNetwork"] is True and pod["restartPolicy"] == "Never"
        assert pod["automountServiceAccountToken"] is False and "runtimeClassName" not in pod
        assert {"name": "state", "mountPath": "/var/lib/agentcell"} in container["volumeMounts"]
    docs = _docs("git-proxy", OPTIONS["gvisor-no-claim"])
    pod = docs["SandboxTemplate"]["spec"]["podTemplate"]["spec"]
    assert pod["runtimeClassName"] == "gvisor" and "SandboxClaim" not in docs
    assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": "harness-keys"}}]
    assert docs["SandboxWarmPool"]["spec"] == {"replicas": 0, "sandboxTemplateRef": {"name": "git-proxy"}}
    pod = _docs("git-proxy", OPTIONS["own-namespaces"])["SandboxTemplate"]["spec"]["podTemplate"]["spec"]
    assert "hostPID" not in pod and "hostNetwork" not in pod and pod["runtimeClassName"] == "kata"


def test_the_project_comes_from_an_init_container() -> None:
    docs = _docs("files-none")
    assert docs["ConfigMap"]["data"] == {"f0": "print(1)\n", "f1": "X = 2\n"}
    pod = docs["SandboxTemplate"]["spec"]["podTemplate"]["spec"]
    (files,) = [v for v in pod["volumes"] if v["name"] == "files"]
    assert files["configMap"]["items"] == [{"key": "f0", "path": "app.py"}, {"key": "f1", "path": "src/lib/util.py"}]
    assert pod["initContainers"][0]["command"] == ["sh", "-c", render.COPY_FILES]
    init = _docs("git-proxy")["SandboxTemplate"]["spec"]["podTemplate"]["spec"]["initContainers"][0]
    assert init["command"] == ["sh", "-c", render.CLONE, "clone", "https://git.example/org/repo.git", "v1.2"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "SETUID", "SETGID"]}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the scripts give the project to uid 1000 with setpriv")
def test_the_init_scripts_fill_the_project_as_its_owner() -> None:
    """The two init scripts, run here by sh on a real repository and a ConfigMap-like tree (their paths moved)."""
    top = Path(tempfile.mkdtemp(prefix="agentcell-k8s-"))
    try:
        top.chmod(0o755)  # the owner (uid 1000) reads the repository and the files, as in the pod
        repo, out = top / "repo", top / "project"
        out.mkdir()  # the project volume: an empty directory root owns
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
        (repo / "a.txt").write_text("one\n")
        for step in (["add", "a.txt"], ["commit", "-qm", "one"], ["tag", "v1"]):
            subprocess.run([*git, *step], check=True)
        (repo / "a.txt").write_text("two\n")
        subprocess.run([*git, "commit", "-qam", "two"], check=True)
        subprocess.run(["chown", "-R", f"{render.OWNER_UID}:{render.OWNER_UID}", str(repo)], check=True)  # git's
        # safe.directory: a local repository is cloned by its own owner only (the pod clones from a URL)
        clone = render.CLONE.replace(render.PROJECT, str(out))
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "GIT_TERMINAL_PROMPT": "0"}
        p = subprocess.run(["sh", "-c", clone, "clone", str(repo), "v1"], capture_output=True, text=True, env=env)
        assert p.returncode == 0, p.stderr
        assert (out / "a.txt").read_text() == "one\n"
        assert {f.stat().st_uid for f in [out, *out.rglob("*")]} == {render.OWNER_UID}  # nothing of root's
        files, out2 = top / "files", top / "project2"
        (files / "..2026_12_03" / "src").mkdir(parents=True)  # a ConfigMap volume as the kubelet lays it out
        (files / "..data").symlink_to("..2026_12_03")
        (files / "src").symlink_to("..data/src")
        out2.mkdir()
        (files / "..2026_12_03" / "src" / "b.py").write_text("B\n")
        copy_files = render.COPY_FILES.replace(render.FILES, str(files)).replace(render.PROJECT, str(out2))
        subprocess.run(["sh", "-c", copy_files], check=True, env=env)
        assert (out2 / "src" / "b.py").read_text() == "B\n"
        assert sorted(f.name for f in out2.iterdir()) == ["src"]  # the files once, not the kubelet's layout
        assert {f.stat().st_uid for f in [out2, *out2.rglob("*")]} == {render.OWNER_UID}
    finally:
        shutil.rmtree(top)


def test_the_supervisor_waits_for_the_claim_then_runs_the_session_and_passes_sigterm_on(tmp_path: Path) -> None:
    """The pod's script, run here by sh with a stand-in agentcell on PATH and a labels file as the kubelet keeps."""
    podinfo, bindir = tmp_path / "podinfo", tmp_path / "bin"
    podinfo.mkdir()
    bindir.mkdir()
    (podinfo / "labels").write_text('agentcell/plan="p"\n')
    log = tmp_path / "calls"
    fake = bindir / "agentcell"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {log}\ntrap \'echo TERM >> {log}; exit 120\' TERM\n'
                    'while :; do sleep 0.05; done\n')
    fake.chmod(0o755)
    script = render.SUPERVISOR.replace(render.PODINFO, str(podinfo)).replace(render.STATE, str(tmp_path))
    p = subprocess.Popen(["sh", "-c", script, "agentcell-pod", "--project", "/work/project", "--", "a b"],
                         env={"PATH": f"{bindir}:/usr/bin:/bin"}, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        assert not log.exists()  # warm: no claim yet
        with open(podinfo / "labels", "a") as f:
            f.write(f'{render.CLAIM_LABEL}="0b5e"\n')
        deadline = time.monotonic() + 10
        while not log.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert log.read_text().splitlines() == ["session", "start", "--json", "--project", "/work/project", "--",
                                                "a b"]
        p.send_signal(signal.SIGTERM)  # the pod deleted mid-session: the session is told, as 'session stop'
        deadline = time.monotonic() + 10
        while "TERM" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert log.read_text().splitlines()[-1] == "TERM"
        time.sleep(0.5)
        assert p.poll() is None  # the state stays for 'kubectl exec': the pod waits for its claim to end
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0
        assert "the session ended (exit status 120)" in (p.stderr.read() if p.stderr else "")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# ---- the command line ------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([AGENTCELL, "k8s", *args], capture_output=True, text=True, timeout=60)


def _plans_file(tmp_path: Path, *objs: dict[str, Any]) -> str:
    path = tmp_path / "plans.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


def test_render_prints_yaml_for_kubectl_and_writes_a_file_per_plan(tmp_path: Path) -> None:
    path = _plans_file(tmp_path, *PLANS.values())
    p = _cli("render", path, "--image", IMAGE, "--plan", "git-proxy", "--namespace", "agents", *TRUST_FLAGS)
    assert p.returncode == 0, p.stderr
    docs = [d for d in yaml.safe_load_all(p.stdout) if d]
    assert [d["kind"] for d in docs] == ["NetworkPolicy", "SandboxTemplate", "SandboxWarmPool", "SandboxClaim"]
    assert {d["metadata"]["namespace"] for d in docs} == {"agents"}
    assert docs == render.render(plans.parse(PLANS["git-proxy"]), render.Options(image=IMAGE, namespace="agents",
                                                                                 caps=TRUSTED))
    p = _cli("render", path, "--image", IMAGE, "-o", str(tmp_path / "out"), *TRUST_FLAGS)
    assert p.returncode == 0 and p.stdout == "", p.stderr
    assert sorted(f.name for f in (tmp_path / "out").iterdir()) == sorted(f"{n}.yaml" for n in PLANS)


@pytest.mark.parametrize("args,objs,says", [
    (["--plan", "nope"], [PLANS["files-none"]], "--plan: no plan named 'nope'"),
    (["--namespace", "Bad_NS"], [PLANS["files-none"]], "--namespace: 'Bad_NS' is not a namespace name"),
    (["--warm", "-1"], [PLANS["files-none"]], "--warm: -1 warm pods"),
    (["--runtime-class", "g visor"], [PLANS["files-none"]], "--runtime-class: 'g visor'"),
    ([], [{"name": "p", "project": {"path": "/srv/p"}}], "p: project.path: /srv/p is a directory on a node"),
    ([], [{"name": "p", "project": {"git": "/srv/p.git"}}], "p: project.git: '/srv/p.git' is a path on the node"),
    ([], [{"name": "p", "project": {"git": "ftp://h/r"}}], "p: project.git: 'ftp://h/r' is not a URL"),
    ([], [{"name": "p", "project": {"files": {"big": "x" * (1 << 20)}}}], "p: project.files: 1,048,579 bytes"),
    ([], [{"name": "p", "project": {"files": {}}, "network": "none", "allow_domains": ["x.com"]}],
     "p: network: allow_domains"),
    ([], [{"name": "p", "project": {"files": {}}, "allow_ranges": ["10.0.0.0/33"]}], "p: allow_ranges:"),
    ([], [{"name": "P!", "project": {"files": {}}}], ":1: name: "),
])
def test_bad_input_is_one_line_and_exit_125(tmp_path: Path, args: list[str], objs: list[dict[str, Any]],
                                             says: str) -> None:
    p = _cli("render", _plans_file(tmp_path, *objs), "--image", IMAGE, *args)
    assert p.returncode == 125 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert says in p.stderr, p.stderr
    assert p.stderr.startswith("agentcell k8s")


@pytest.mark.parametrize("plan,says", [
    ({"allow_ranges": ["169.254.169.254/32"]}, "a: allow_ranges: a plan may not set allow_ranges"),
    ({"resolver": "127.0.0.1:10250"}, "a: resolver: a plan may not set resolver"),
    ({"network": "host-firewall"}, "a: network: a plan may not set network host-firewall"),
    ({"harness": "claude_code", "prompt": "p", "api_base": "https://evil.example"},
     "a: api_base: a plan may not choose where the harness's key goes"),
    ({"keep_env": ["OTHER_KEY"]}, "a: keep_env: a plan may not take OTHER_KEY"),
    ({"memory": "1T"}, "a: memory: 1T is over the cap"),
    ({"project": {"git": "http://169.254.169.254/latest/"}}, "a: project.git: 169.254.169.254 is not a public"),
    ({"project": {"git": "git@10.0.0.5:org/repo.git"}}, "a: project.git: 10.0.0.5 is not a public"),
])
def test_a_plan_is_held_to_the_operators_caps(tmp_path: Path, plan: dict[str, Any], says: str) -> None:
    # The plans' author is trusted less than the operator: as agentcell fleet run holds them.
    obj = {"name": "a", "project": {"files": {"a": "b"}}, **plan}
    p = _cli("render", _plans_file(tmp_path, obj), "--image", IMAGE, "--env-secret", "keys", "--max-memory", "4G")
    assert p.returncode == 125 and p.stdout == "" and p.stderr.count("\n") == 1, p.stderr
    assert says in p.stderr, p.stderr
    # Within the caps, a plan without ceilings of its own gets the caps, not the pod node's defaults.
    p = _cli("render", _plans_file(tmp_path, {"name": "a", "project": {"files": {"a": "b"}}}), "--image", IMAGE,
             "--max-memory", "4G", "--max-pids", "100")
    args = [d for d in yaml.safe_load_all(p.stdout) if d and d["kind"] == "SandboxTemplate"][0]
    command = args["spec"]["podTemplate"]["spec"]["containers"][0]["command"]
    assert "--memory=4G" not in command and f"--memory={4 << 30}" in command and "--pids=100" in command, command


def test_missing_plans_file_and_image_are_one_line_too(tmp_path: Path) -> None:
    for args in (["render", str(tmp_path / "none.jsonl"), "--image", IMAGE], ["render", str(tmp_path)],
                 ["render", _plans_file(tmp_path, PLANS["files-none"]), "--image", "a b"]):
        p = _cli(*args)
        assert p.returncode == 125 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr


def test_image_recipe_is_debian_12_with_what_setup_sh_installs() -> None:
    p = _cli("image")
    assert p.returncode == 0 and p.stdout == image.containerfile()
    assert re.search(r"^FROM docker\.io/library/debian:12$", p.stdout, re.M)
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    wanted = set(re.search(r"APT_PACKAGES=\(([^)]*)\)", setup).group(1).split())  # type: ignore[union-attr]
    assert wanted - {"python3-dev", "gcc", "libc6-dev", "spin"} <= set(image.APT_PACKAGES)  # (build/test-only)
    assert f"--uid {render.OWNER_UID}" in p.stdout and "pip install --no-cache-dir /usr/src/agentcell" in p.stdout
