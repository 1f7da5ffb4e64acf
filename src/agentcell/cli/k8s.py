"""``agentcell k8s``: session plans as Kubernetes agent-sandbox resources, and the image their pods run.

    agentcell k8s render PLANS.jsonl --image IMAGE [--plan NAME] [--namespace NS] [--runtime-class NAME]
                         [--warm N] [--no-claim] [--env-secret NAME] [--no-host-namespaces] [-o DIR]
    agentcell k8s image

render prints multi-document YAML (or writes DIR/NAME.yaml, one file a plan) for ``kubectl apply -f``; it talks to
no cluster. See agentcell.k8s.render for what the pod is given and why.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from ..errors import AgentcellError, report
from .common import Parser

PROG = "agentcell k8s"


def parser() -> Parser:
    import argparse

    p = Parser(prog=PROG, description="Session plans as kubernetes-sigs/agent-sandbox resources (v1beta1): a "
               "SandboxTemplate whose pod runs 'agentcell session start', a NetworkPolicy, a SandboxWarmPool and a "
               "SandboxClaim; and the recipe of the image those pods run.",
               epilog="exit status: 0, or 125 when the plans or a flag are refused (nothing is written)",
               formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", metavar="render|image", parser_class=Parser)
    sub.required = True
    sp = sub.add_parser("render", help="a plans file's resources as YAML")
    sp.add_argument("plans", metavar="PLANS.jsonl", help="session plans, one JSON object a line "
                    "(see 'agentcell fleet run --help')")
    sp.add_argument("--image", required=True, help="the image built from 'agentcell k8s image', as the cluster "
                    "pulls it")
    sp.add_argument("--plan", metavar="NAME", help="only this plan of the file")
    sp.add_argument("--namespace", default="default", help="the namespace of every resource (default: default)")
    sp.add_argument("--runtime-class", metavar="NAME", help="the pod's runtimeClassName (gvisor, kata, ...): the "
                    "outer layer's runtime; default: the cluster's (runc)")
    sp.add_argument("--warm", type=int, default=1, metavar="N", help="pods the warm pool keeps ready, each waiting "
                    "for a claim (default 1)")
    sp.add_argument("--no-claim", dest="claim", action="store_false", help="leave out the SandboxClaim (a "
                    "k8s-agent-sandbox client makes it)")
    sp.add_argument("--env-secret", metavar="NAME", help="a Secret whose keys the supervisor gets as its "
                    "environment: a harness's API key (the cell holds a placeholder)")
    sp.add_argument("--no-host-namespaces", dest="host_namespaces", action="store_false", help="no hostPID and "
                    "hostNetwork: agentcell's monitor cannot see from a pod's own namespaces, and the session aborts")
    sp.add_argument("-o", "--output-dir", metavar="DIR", help="write DIR/NAME.yaml for each plan instead")
    from .caps import cap_args

    cap_args(sp)
    sub.add_parser("image", help="the Containerfile of the image the pods run (Debian 12 and agentcell)")
    return p


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    try:
        if ns.cmd == "image":
            from ..k8s import image

            sys.stdout.write(image.containerfile())
            return 0
        return _render(ns)
    except AgentcellError as e:
        return report(PROG, e)


def _render(ns: Any) -> int:
    from ..fleet import plan as plans
    from ..k8s import render
    from .caps import caps

    opts = render.Options(image=ns.image, namespace=ns.namespace, runtime_class=ns.runtime_class, warm=ns.warm,
                          claim=ns.claim, host_namespaces=ns.host_namespaces, env_secret=ns.env_secret,
                          caps=caps(ns, keys=ns.env_secret is not None))
    chosen = plans.read(ns.plans)
    if ns.plan is not None:
        chosen = [p for p in chosen if p.name == ns.plan]
        if not chosen:
            raise AgentcellError("--plan", f"no plan named '{ns.plan}' in {ns.plans}", "give one of its names")
    out = {p.name: render.dump(render.render(p, opts), f"# agentcell k8s render: plan {p.name}\n")
           for p in chosen}  # every plan rendered before anything is written
    if ns.output_dir is None:
        sys.stdout.write("".join(out.values()))
        return 0
    try:
        os.makedirs(ns.output_dir, exist_ok=True)
        for name, text in out.items():
            path = os.path.join(ns.output_dir, f"{name}.yaml")
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            sys.stderr.write(f"{PROG}: wrote {path}\n")
    except OSError as e:
        raise AgentcellError("--output-dir", f"cannot write in {ns.output_dir}: {e.strerror}",
                             "give a directory you can write") from None
    return 0
