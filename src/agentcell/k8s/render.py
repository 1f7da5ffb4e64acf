"""One session plan as Kubernetes resources: kubernetes-sigs/agent-sandbox's v1beta1 ``SandboxTemplate``,
``SandboxWarmPool`` and ``SandboxClaim``, a ``NetworkPolicy``, and a ``ConfigMap`` for inline project files.

The pod's one container runs ``agentcell session start`` (the plan's flags, :meth:`SessionPlan.start_args`)
as the in-pod supervisor, so two layers stand between the agent and the cluster:

* outer: the pod. Its runtime (runc, or a ``runtimeClassName`` such as gVisor or Kata) and the NetworkPolicy,
  which sees addresses and ports only;
* inner: agentcell's cell inside the pod: namespaces, Landlock, seccomp, cgroups, the egress proxy that decides by
  name (the plan's allow-list), the escape monitor and the audit trail.

What the pod is given, and why. agentcell makes namespaces, cgroups, nftables rules and accounts, so its
container is privileged and root. Its monitor reads the kernel's audit stream and the proc connector, which the
kernel serves only to the initial PID and network namespaces: in a pod of its own (measured here with
``unshare --pid`` and ``unshare --net``) ``session start`` aborts ("the monitor cannot see"), so the pod shares the
node's PID and network namespaces (``hostPID``, ``hostNetwork``). Such a pod can act on the whole node: the node
is the outer boundary, so give these pods nodes of their own. With ``hostNetwork`` most network plugins do not apply
a NetworkPolicy to the pod; the proxy inside is then the only egress control.

Plain data, no I/O: :func:`render` returns the resources as dicts; :func:`dump` writes them as YAML.
"""
from __future__ import annotations

import ipaddress
import posixpath
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import AgentcellError
from ..fleet.plan import TRUSTED_NETWORK, Caps, SessionPlan, git_remote, public
from ..network import presets, rules
from ..network.firewall import NOT_BY_WILDCARD
from ..policy.plan import PLAN, Plan, egress

API = "extensions.agents.x-k8s.io/v1beta1"  # agent-sandbox's extension kinds (checked against release v0.5.6)
CLAIM_LABEL = "agents.x-k8s.io/claim-uid"  # put on the pod by agent-sandbox's claim controller when a claim takes it
PLAN_LABEL = "agentcell/plan"
PROJECT = "/work/project"
FILES = "/work/files"
STATE = "/var/lib/agentcell"  # the state dir of a root agentcell: sessions, audit trails, backups
PODINFO = "/etc/agentcell-pod"  # the pod's labels, kept current by the kubelet (downward API)
OWNER_UID = 1000  # the image's account 'agent' (image.py): a session refuses a project root owns
CONFIGMAP_MAX = 1000 * 1024  # a ConfigMap holds 1 MiB, its keys and metadata included
DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")
# The outer layer keeps these from the pod even where a name the proxy allows resolves into them (the proxy
# refuses them too); a plan's allow_ranges are given back as rules of their own.
PRIVATE = {"0.0.0.0/0": tuple(n for n in NOT_BY_WILDCARD if ":" not in n),
           "::/0": tuple(n for n in NOT_BY_WILDCARD if ":" in n)}
MAX_WARM = 1000

# The session container's command (sh -c SCRIPT agentcell-pod START-ARGS...). A warm pod waits, ready, until a
# claim takes it; the claim controller labels the pod, and the downward API volume shows the new label.
# SIGTERM (the pod deleted) reaches the session as 'session stop' would: terminated, torn down, audited.
# After the session the pod stays, so 'kubectl exec' can run 'agentcell session show/diff' and
# 'agentcell audit verify'; the summary is the last line of the container's log.
SUPERVISOR = f"""set -u
trap 'exit 143' TERM INT
until grep -q '^{CLAIM_LABEL}=' {PODINFO}/labels; do sleep 1; done
agentcell session start --json "$@" &
session=$!
trap 'kill -TERM "$session"' TERM INT
status=0
while kill -0 "$session" 2>/dev/null; do wait "$session"; status=$?; done
echo "agentcell-pod: the session ended (exit status $status); its state is kept in {STATE} until the claim ends" >&2
hold=
trap 'kill $hold 2>/dev/null; exit 0' TERM INT
while :; do sleep 3600 & hold=$!; wait $hold; done
"""
# The init container's scripts: the project is written by its owner, never by root (a clone of an untrusted
# repository as root is what the fleet's nodes avoid too); root only gives the empty volume to the owner.
AS_OWNER = f"setpriv --reuid={OWNER_UID} --regid={OWNER_UID} --clear-groups --"
CLONE = f"""set -eu
chown {OWNER_UID}:{OWNER_UID} {PROJECT}
{AS_OWNER} git -c http.followRedirects=false clone --quiet -- "$1" {PROJECT}
if [ -n "$2" ]; then {AS_OWNER} git -C {PROJECT} checkout --quiet --detach "$2" --; fi
"""
COPY_FILES = f"""set -eu
chown {OWNER_UID}:{OWNER_UID} {PROJECT}
{AS_OWNER} cp -RL {FILES}/..data/. {PROJECT}/
"""


@dataclass(frozen=True)
class Options:
    """What the cluster decides, not the plan. ``host_namespaces`` False drops hostPID/hostNetwork (the module's
    doc: the session then aborts unless the runtime gives agentcell a kernel's initial namespaces)."""

    image: str
    namespace: str = "default"
    runtime_class: str | None = None
    warm: int = 1
    claim: bool = True
    host_namespaces: bool = True
    env_secret: str | None = None  # a Secret whose keys become the supervisor's environment (a harness's API key)
    caps: Caps = Caps()  # what the operator lets a plan ask for (Caps.check; keys: an env_secret is given)

    def check(self) -> None:
        if not self.image or any(c.isspace() for c in self.image):
            raise AgentcellError("--image", f"'{self.image}' is not an image reference",
                                 "give the image built from 'agentcell k8s image', e.g. registry.example/agentcell:0.1")
        if not DNS_LABEL.match(self.namespace):
            raise AgentcellError("--namespace", f"'{self.namespace}' is not a namespace name",
                                 "a DNS label: a-z, 0-9 and '-', at most 63")
        for flag, value in (("--runtime-class", self.runtime_class), ("--env-secret", self.env_secret)):
            if value is not None and not DNS_SUBDOMAIN.match(value):
                raise AgentcellError(flag, f"'{value}' is not a Kubernetes object name",
                                     "a DNS subdomain: a-z, 0-9, '-' and '.'")
        if not 0 <= self.warm <= MAX_WARM:
            raise AgentcellError("--warm", f"{self.warm} warm pods", f"give 0 to {MAX_WARM}")


@dataclass(frozen=True)
class _Source:
    """Where the pod's project comes from: an init container fills the project volume."""

    init: dict[str, Any]
    volumes: tuple[dict[str, Any], ...]
    configmap: dict[str, Any] | None
    clone_port: int | None  # the git host's port, which the init container's clone needs


def render(plan: SessionPlan, opts: Options) -> list[dict[str, Any]]:
    """The plan's resources, in the order to apply them. Bad input: AgentcellError naming the plan's field."""
    opts.check()
    opts.caps.check(plan, plan.name)
    source = _source(plan, opts)
    docs = [source.configmap] if source.configmap else []
    docs += [network_policy(plan, opts, source.clone_port), template(plan, opts, source), warm_pool(plan, opts)]
    if opts.claim:
        docs.append(claim(plan, opts))
    return docs


def _meta(name: str, plan: SessionPlan, opts: Options) -> dict[str, Any]:
    return {"name": name, "namespace": opts.namespace, "labels": _labels(plan)}


def _labels(plan: SessionPlan) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": "agentcell", PLAN_LABEL: plan.name}


def template(plan: SessionPlan, opts: Options, source: _Source) -> dict[str, Any]:
    security = {"privileged": True, "runAsUser": 0, "seccompProfile": {"type": "Unconfined"},
                "appArmorProfile": {"type": "Unconfined"}}
    session: dict[str, Any] = {
        "name": "session", "image": opts.image,
        "command": ["sh", "-c", SUPERVISOR, "agentcell-pod", *plan.start_args(PROJECT, opts.caps.bounded(plan))],
        "securityContext": security,
        "volumeMounts": [{"name": "project", "mountPath": PROJECT}, {"name": "state", "mountPath": STATE},
                         {"name": "podinfo", "mountPath": PODINFO, "readOnly": True}]}
    if opts.env_secret:
        session["envFrom"] = [{"secretRef": {"name": opts.env_secret}}]
    pod: dict[str, Any] = {
        "restartPolicy": "Never",  # a session runs once: a restarted container would start it again
        "automountServiceAccountToken": False, "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,  # the session's teardown and last audit record
        "initContainers": [source.init], "containers": [session],
        "volumes": [{"name": "project", "emptyDir": {}}, {"name": "state", "emptyDir": {}},
                    {"name": "podinfo", "downwardAPI": {"items": [{"path": "labels",
                                                                   "fieldRef": {"fieldPath": "metadata.labels"}}]}},
                    *source.volumes]}
    if opts.host_namespaces:
        pod.update(hostPID=True, hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    if opts.runtime_class:
        pod["runtimeClassName"] = opts.runtime_class
    return {"apiVersion": API, "kind": "SandboxTemplate", "metadata": _meta(plan.name, plan, opts),
            "spec": {"podTemplate": {"metadata": {"labels": _labels(plan)}, "spec": pod},
                     # the NetworkPolicy is rendered beside the template (network_policy), where it can be read
                     "networkPolicyManagement": "Unmanaged"}}


def warm_pool(plan: SessionPlan, opts: Options) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "SandboxWarmPool", "metadata": _meta(plan.name, plan, opts),
            "spec": {"replicas": opts.warm, "sandboxTemplateRef": {"name": plan.name}}}


def claim(plan: SessionPlan, opts: Options) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "SandboxClaim", "metadata": _meta(plan.name, plan, opts),
            "spec": {"warmPoolRef": {"name": plan.name}}}


# ---- the project -------------------------------------------------------------------------------

def _source(plan: SessionPlan, opts: Options) -> _Source:
    project = plan.project
    mounts: list[dict[str, Any]] = [{"name": "project", "mountPath": PROJECT}]

    def init(command: list[str], **more: Any) -> dict[str, Any]:
        return {"name": "project", "image": opts.image, "command": command, **more,
                "securityContext": {"runAsUser": 0, "capabilities": {"drop": ["ALL"], "add": [
                    "CHOWN", "SETUID", "SETGID"]}}, "volumeMounts": mounts}

    if project.path is not None:
        raise AgentcellError(f"{plan.name}: project.path", f"{project.path} is a directory on a node; a pod would "
                             "need a hostPath volume, which hands the pod the node's files",
                             "give the project as git (cloned by an init container) or files (a ConfigMap)")
    if project.git is not None:
        port = _git_port(plan.name, project.git, opts.caps.plan_network)
        return _Source(init(["sh", "-c", CLONE, "clone", project.git, project.ref or ""],
                            env=[{"name": "GIT_TERMINAL_PROMPT", "value": "0"}, {"name": "HOME", "value": "/tmp"},
                                 {"name": "GIT_ALLOW_PROTOCOL", "value": "https:http:ssh:git"}]),
                       (), None, port)
    files = project.files or {}
    size = sum(len(k) + len(v.encode()) for k, v in files.items())
    if size > CONFIGMAP_MAX:
        raise AgentcellError(f"{plan.name}: project.files", f"{size:,} bytes; a ConfigMap holds at most 1 MiB",
                             "give the project as git")
    keys = {f"f{i}": rel for i, rel in enumerate(sorted(files))}  # a ConfigMap key holds no '/'
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{plan.name}-project", plan, opts),
                 "data": {k: files[rel] for k, rel in keys.items()}}
    volume = {"name": "files", "configMap": {"name": f"{plan.name}-project", "items": [
        {"key": k, "path": posixpath.normpath(rel)} for k, rel in keys.items()]}}
    mounts.append({"name": "files", "mountPath": FILES, "readOnly": True})
    return _Source(init(["sh", "-c", COPY_FILES]), (volume,), configmap, None)


def _git_port(name: str, url: str, trusted: bool) -> int:
    """The port a clone of ``url`` connects to; a path (a repository on the node) is refused, and so is an
    address that is not public (the clone runs on the node's network, outside the cell) unless ``trusted``.
    A name is resolved in the cluster, not here: the NetworkPolicy keeps the pod from non-public ranges
    only where the network plugin applies it to a hostNetwork pod."""
    field = f"{name}: project.git"
    try:
        remote = git_remote(url)
    except ValueError as e:
        raise AgentcellError(field, f"'{url}' {e}", "give an https://, http://, ssh:// or git:// URL") from None
    if remote is None:
        raise AgentcellError(field, f"'{url}' is a path on the node", "give the repository's URL (https:// or ssh://)")
    _scheme, host, port = remote
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None and not trusted and not public(literal):
        raise AgentcellError(field, f"{host} is not a public address: the clone runs on the node's network, outside "
                             "the cell", f"clone from a public host, or render with {TRUSTED_NETWORK}")
    return port


# ---- the NetworkPolicy -------------------------------------------------------------------------

def network_policy(plan: SessionPlan, opts: Options, clone_port: int | None) -> dict[str, Any]:
    """Ingress: none. Egress: as near the plan's allow-list as addresses and ports allow. The names are the
    proxy's to decide, inside the pod; this is the outer layer, in case the inner one fails."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(plan.name, plan, opts),
            "spec": {"podSelector": {"matchLabels": {PLAN_LABEL: plan.name}}, "policyTypes": ["Ingress", "Egress"],
                     "ingress": [], "egress": _egress(plan, clone_port)}}


def _egress(plan: SessionPlan, clone_port: int | None) -> list[dict[str, Any]]:
    domain_rules = bool(plan.allow_domains or plan.deny_domains or plan.allow_presets or plan.allow_ranges
                        or plan.resolver)
    network = plan.network or ("proxy" if domain_rules else None)  # as --allow-domain implies --net proxy
    if network is not None:
        try:
            egress(Plan(network=network, allow_domains=plan.allow_domains, deny_domains=plan.deny_domains,
                        allow_presets=plan.allow_presets, allow_ranges=plan.allow_ranges, resolver=plan.resolver,
                        terms=PLAN))
        except AgentcellError as e:
            raise AgentcellError(f"{plan.name}: {e.field}", e.problem, e.fix) from None
    public = [{"ipBlock": {"cidr": cidr, "except": list(private)}} for cidr, private in PRIVATE.items()]
    out: list[dict[str, Any]] = []
    covered: set[int] | None = set()  # the ports already open to the public addresses (None: all)
    if network in (None, "proxy", "host-firewall"):  # None: the harness's own, which reaches its API
        if network == "host-firewall":
            ports: set[int] | None = {443}  # the host firewall's rule: egress to 443 only
        else:
            ports = _ports([*presets.expand(list(plan.allow_presets)), *plan.allow_domains])
            if ports is not None and plan.api_base:
                ports.add(_url_port(plan.api_base))
        ranges = [{"ipBlock": {"cidr": str(rules.parse_range(r, "allow_ranges"))}} for r in plan.allow_ranges]
        out.append(_rule(public + ranges, ports))
        covered = ports
    if clone_port is not None and covered is not None and clone_port not in covered:
        out.append(_rule(public, {clone_port}))  # the init container's clone
    if out:
        out.insert(0, _dns(plan))
    return out


def _ports(patterns: list[str]) -> set[int] | None:
    """The ports the proxy may open for these domain patterns (None: any); none given, the harness's API's."""
    ports = set(rules.DEFAULT_PORTS)
    if patterns:
        ports = set()
    for text in patterns:
        given = rules.parse_pattern(text, "allow_domains").ports
        if rules.ANY_PORT in given:
            return None
        ports.update(given)
    return ports


def _rule(to: list[dict[str, Any]], ports: set[int] | None) -> dict[str, Any]:
    rule: dict[str, Any] = {"to": to}
    if ports is not None:
        rule["ports"] = [{"protocol": "TCP", "port": p} for p in sorted(ports)]
    return rule


def _dns(plan: SessionPlan) -> dict[str, Any]:
    """DNS: the plan's resolver, else the cluster's (kube-dns, as CoreDNS is labelled in most clusters)."""
    if plan.resolver:
        addr, port = rules.parse_resolver(plan.resolver, "resolver")
        to: list[dict[str, Any]] = [{"ipBlock": {"cidr": str(ipaddress.ip_network(addr))}}]
    else:
        to, port = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                     "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}], 53
    return {"to": to, "ports": [{"protocol": proto, "port": port} for proto in ("UDP", "TCP")]}


def _url_port(url: str) -> int:
    parts = urlsplit(url)
    try:
        return parts.port or (80 if parts.scheme == "http" else 443)
    except ValueError:
        return 443  # the session refuses such an api_base itself, on the node


# ---- output ------------------------------------------------------------------------------------

def dump(docs: list[dict[str, Any]], header: str = "") -> str:
    """Multi-document YAML; multi-line strings (the scripts, the project's files) as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True  # a rule's peers shared between rules are written out each time, not as &anchors

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    body = yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True,
                         explicit_start=True, width=120)
    return header + body
