"""Session plans as Ray tasks on the nodes of a cluster (the ``agentcell[ray]`` extra).

Ray schedules; this module only asks. Each node where agentcell runs as root declares how many cells it
runs at once as a Ray resource, and may name itself with a label (default: its host name)::

    ray start --address HEAD:6379 --resources '{"agentcell_cells": 4}' --labels 'agentcell.node=gpu-7'

Each plan is one task that needs one ``agentcell_cells``: a full cluster queues the rest (back-pressure).
The task runs the session on its node (:func:`agentcell.fleet.node.run_plan`) and returns its result.

A task whose node (or worker) dies has no result: it is reported ``lost``, with the node it ran on. Each
task is a generator whose first item is its node's name, and it goes on only once the caller has taken
that item (a back-pressure of one item), so the caller knows the node before the session starts. Once a
node of that name is alive again, a task pinned to it finishes the node's dead sessions
(``agentcell session recover``) and brings their results; until then, or past ``recover_wait_s``, they stay
``lost``, and ``agentcell fleet recover RUN --node NAME`` does it later. A task lost before it started is
submitted again: nothing of it ran.
"""
from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..errors import AgentcellError
from . import node as node_mod
from .plan import Caps, SessionPlan

CELLS = "agentcell_cells"  # the resource: cells a node runs at once
LABEL = "agentcell.node"  # the node label naming a node (else its host name)
RESUBMITS = 2  # a task lost before it started, submitted again at most this often
RECOVERIES = 2  # a lost session's node asked to recover it at most this often
POLL_S = 1.0

Result = dict[str, Any]


def node_name() -> str:
    return str(ray.get_runtime_context().get_node_labels().get(LABEL) or socket.gethostname())


@ray.remote(num_cpus=0, max_retries=0)
def _run(plan: dict[str, Any], run: str, base: str, owner: str, attempt: int, caps: Caps,
         env_file: str | None) -> Iterator[Any]:
    """The node's name, then the plan's result (submitted with a back-pressure of one item: the session
    starts once the caller has the name)."""
    p = SessionPlan.model_validate(plan)
    here = node_mod.Node(base, node_name())
    yield here.name
    yield node_mod.run_plan(p, run, here, owner, attempt, caps, env_file)


@ray.remote(num_cpus=0, max_retries=0)
def _recover(run: str, base: str, name: str, names: list[str] | None) -> list[Result]:
    return node_mod.recover(node_mod.Node(base, name), run, names)


def connect(address: str | None) -> None:
    if not ray.is_initialized():
        try:
            ray.init(address=address or "auto", logging_level=logging.WARNING, log_to_driver=False,
                     configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise AgentcellError("--address", f"cannot reach a Ray cluster at {address or 'auto'}: {e}",
                                 "give the head's GCS address (HOST:6379) from a node of the cluster") from None
    if not ray.cluster_resources().get(CELLS):  # type: ignore[no-untyped-call]
        raise AgentcellError("--address", f"no node of the cluster offers the resource {CELLS}",
                             "start agentcell's nodes with ray start --resources '{\"" + CELLS + "\": N}'")


def alive_node(name: str) -> str | None:
    """The id of a live node called ``name`` (its label, else its host name)."""
    for n in ray.nodes():  # type: ignore[no-untyped-call]
        labels = n.get("Labels") or {}
        if n.get("Alive") and (labels.get(LABEL) or n.get("NodeManagerHostname")) == name \
                and n.get("Resources", {}).get(CELLS):
            return str(n["NodeID"])
    return None


def recover_on(run: str, base: str, name: str, names: list[str] | None, wait_s: float) -> list[Result] | None:
    """Recover ``names`` (default: all of ``run``'s there) on the node ``name`` once it is alive; None if it
    is not alive within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while (node_id := alive_node(name)) is None:
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)
    pinned = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    out: list[Result] = ray.get(_recover.options(scheduling_strategy=pinned).remote(run, base, name, names))
    return out


def run(plans: Sequence[SessionPlan], *, run_id: str, base: str, owner: str, recover_wait_s: float,
        caps: Caps | None = None, env_file: str | None = None,
        on_result: Callable[[Result], None] = lambda r: None) -> list[Result]:
    """Run every plan on the cluster (connected), each held to ``caps`` (checked: :meth:`Caps.check`);
    the results in the plans' order. ``on_result`` is told each result as it arrives (a lost one, then
    its recovery)."""
    caps = caps or Caps()
    for p in plans:
        caps.check(p, p.name)
    by_name = {p.name: p for p in plans}
    results: dict[str, Result] = {}
    tries: dict[str, int] = {}
    pending: dict[Any, str] = {}  # each plan's task (its generator)
    started: dict[str, str] = {}  # the node each plan's task started on
    recoveries: dict[str, int] = {}  # how often each plan's node was asked to recover it

    def submit(name: str) -> None:
        tries[name] = tries.get(name, 0) + 1
        started.pop(name, None)
        gen = _run.options(resources={CELLS: 1}, _generator_backpressure_num_objects=1).remote(
            by_name[name].model_dump(mode="json"), run_id, base, owner, tries[name], caps, env_file)
        pending[gen] = name

    def lost(name: str, where: str | None, why: str) -> Result:
        return node_mod.result(name, where or "?", node_mod.session_id(run_id, name, tries[name]), "lost", why)

    def drain() -> None:
        while pending:
            ready: list[Any] = ray.wait(list(pending), num_returns=1, timeout=POLL_S)[0]
            for gen in ready:
                name = pending[gen]
                try:
                    item = ray.get(next(gen))
                except RayTaskError as e:  # our code on the node raised: a bug, reported as such
                    results[name] = node_mod.result(name, "?", "", "failed", f"on the node: {_first_line(e)}")
                except (RayError, StopIteration) as e:
                    where = started.get(name)
                    if where is None and tries[name] <= RESUBMITS:
                        del pending[gen]
                        submit(name)  # it never started: nothing ran
                        continue
                    results[name] = lost(name, where, f"node {where or '?'} was lost mid-run ({type(e).__name__})")
                else:
                    if name not in started:
                        started[name] = str(item)  # taken: the task goes on to the session
                        continue
                    results[name] = item
                del pending[gen]
                on_result(results[name])

    for p in plans:
        submit(p.name)
    drain()
    given_up: set[str] = set()  # nodes that did not come back in time
    while True:
        by_node: dict[str, list[str]] = {}
        for name, r in results.items():
            # (one session recover refused stays lost: by hand, once fixed; no loop on a node that keeps one)
            if r["status"] == "lost" and r["node"] not in ("?", *given_up) and not r.get("unrecovered") \
                    and recoveries.get(name, 0) < RECOVERIES:
                by_node.setdefault(r["node"], []).append(name)
        if not by_node:
            break
        for where, names in sorted(by_node.items()):
            for name in names:
                recoveries[name] = recoveries.get(name, 0) + 1
            try:
                got = recover_on(run_id, base, where, names, recover_wait_s)
            except RayError as e:  # the node died again, or its recovery failed: they stay lost, said why
                for name in names:
                    results[name] = {**results[name], "reason": f"{results[name]['reason']}; recovery on "
                                     f"{where} failed: {_first_line(e)}"}
                got = None
            if got is None:
                given_up.add(where)
                continue
            for r in got:
                if r.get("never_ran") and tries[r["name"]] <= RESUBMITS:
                    submit(r["name"])  # its session never reached its agent: it runs again
                    continue
                was = results[r["name"]]
                results[r["name"]] = {**r, "lost": was.get("lost") or was["reason"]}  # (the first loss's reason)
                on_result(results[r["name"]])
        drain()
    return [results[p.name] for p in plans]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return next((ln for ln in reversed(text) if ln.strip()), type(e).__name__)[:300]
