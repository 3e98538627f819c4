"""The bandwidth gate's measurement: the shell's answer to `MeasureBandwidth`.

`run_gate` has the nodes' agents run `preflight.collective` together (MeasureAllReduce, one rank per
node): the whole set once, then pairs around the ring to locate a slow link. It answers a
`BandwidthMeasured` within `MeasureBandwidth.timeout_s`, whatever the agents do; a refusal gives no
figure (it says nothing about a link). Sizes are CPU-sized (gloo on CPUs is tens of MB/s to a few
GB/s): a few MiB, a few iterations.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from controller.backends.agents import RpcOutcome
from controller.supervisor.events import BandwidthMeasured
from runwarden.v1 import agent_pb2

log = logging.getLogger(__name__)

SIZE_BYTES = 4 << 20
ITERATIONS = 3
WARMUP = 1
# The gate answers this much before the core's own deadline (its timer is the action's timeout_s).
_MARGIN_S = 1.0
_MARGIN_RATIO = 0.05
_MIN_GROUP_S = 1.0  # less than this cannot even start a rank: not tried
_RPC_GRACE_S = 5.0
# An agent's refusal, not a link that could not carry the all-reduce: no figure for its pair's nodes.
_REFUSALS = frozenset(
    {"FAILED_PRECONDITION", "UNIMPLEMENTED", "PERMISSION_DENIED", "INVALID_ARGUMENT"}
)  # the agent's own bound is the rank's timeout; the answer gets this much longer


class AllReduceRpc(Protocol):
    """The one agent call the gate needs (controller.backends.agents.AgentClients has it)."""

    def measure_all_reduce(
        self,
        node: str,
        request: agent_pb2.MeasureAllReduceRequest,
        timeout_s: float,
        on_master: Callable[[agent_pb2.CollectiveMaster], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> tuple[RpcOutcome, agent_pb2.AllReduceMeasurement | None]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Figure:
    """One group's measurement: bus bandwidth in GB/s, or 0.0 and why it could not be had."""

    nodes: tuple[str, ...]
    busbw_gbps: float = 0.0
    error: str = ""
    backend: str = ""
    refused: bool = False  # an agent said no (busy, too old, not allowed): says nothing about the link

    @property
    def ok(self) -> bool:
        return not self.error


def ring_rounds(n: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The ring's pairs (i, i+1 mod n) in rounds in which no node is in two pairs.

    Round 1: (0,1), (2,3), ...; round 2: (1,2), (3,4), ..., with (n-1,0) there when n is even; when n
    is odd the wrap-around (n-1,0) would meet node 0 (or n-1) twice, so it is a third round of its own.
    n = 2: the one pair (0,1), which is the whole set."""
    if n < 2:
        return ()
    if n == 2:
        return (((0, 1),),)
    first = tuple((i, i + 1) for i in range(0, n - 1, 2))
    second = tuple((i, (i + 1) % n) for i in range(1, n, 2))
    third = ((n - 1, 0),) if n % 2 else ()
    return tuple(r for r in (first, second, third) if r)


def measure_group(
    rpc: AllReduceRpc,
    nodes: tuple[str, ...],
    group_id: str,
    timeout_s: float,
    clock: Callable[[], float],
    *,
    iterations: int = ITERATIONS,
) -> Figure:
    """One all-reduce across `nodes` (nodes[0] is rank 0), within `timeout_s`.

    Rank 0's agent is asked first; its stream names the master (its own advertised host, a port it
    bound there) and only then are the other ranks' agents asked, with that address, each by the
    same deadline. The first rank that fails cancels the rest (their agents stop their ranks), so a
    refusal costs seconds, not the group's timeout."""
    end = clock() + timeout_s
    master: list[agent_pb2.CollectiveMaster] = []
    master_known = threading.Event()
    stop = threading.Event()

    def request(rank: int, addr: str = "", port: int = 0) -> agent_pb2.MeasureAllReduceRequest:
        return agent_pb2.MeasureAllReduceRequest(
            group_id=group_id,
            rank=rank,
            world_size=len(nodes),
            master_addr=addr,
            master_port=port,
            size_bytes=SIZE_BYTES,
            iterations=iterations,
            warmup=WARMUP,
            timeout_s=max(0.1, end - clock()),
        )

    def on_master(m: agent_pb2.CollectiveMaster) -> None:
        master.append(m)
        master_known.set()

    def rank(
        node: str,
        req: agent_pb2.MeasureAllReduceRequest,
        on: Callable[[agent_pb2.CollectiveMaster], None] | None,
    ) -> tuple[RpcOutcome, agent_pb2.AllReduceMeasurement | None]:
        try:
            out, res = rpc.measure_all_reduce(node, req, req.timeout_s + _RPC_GRACE_S, on, stop)
        except Exception as exc:  # a bug in the client must not hang the group
            log.exception("MeasureAllReduce on %s", node)
            out, res = RpcOutcome(node=node, ok=False, code="INTERNAL", error=str(exc)[:200]), None
        if not out.ok:
            stop.set()
        master_known.set()  # rank 0 ended (or failed) without a master: stop waiting for one
        return out, res

    with ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="allreduce") as threads:
        calls = [threads.submit(rank, nodes[0], request(0), on_master)]
        master_known.wait(timeout_s)
        if master and not stop.is_set():
            m = master[0]
            calls += [
                threads.submit(rank, n, request(r, m.addr, m.port), None) for r, n in enumerate(nodes[1:], 1)
            ]
        else:
            stop.set()
        answers = [c.result() for c in calls]
    failed = [out for out, _ in answers if not out.ok]
    cause = [out for out in failed if out.code != "CANCELLED"]  # the cancelled ones were stopped by it
    if not cause and len(answers) < len(nodes):
        return Figure(nodes=nodes, error=f"{nodes[0]} named no master within {timeout_s:.1f}s")
    if cause or failed:
        refused = bool(cause) and all(out.code in _REFUSALS for out in cause)
        return Figure(
            nodes=nodes,
            error="; ".join(f"{out.node}: {out.error}" for out in cause or failed),
            refused=refused,
        )
    result = answers[0][1]
    assert result is not None  # an ok outcome carries its result
    if not result.correct:
        return Figure(nodes=nodes, error="the all-reduce returned a wrong sum", backend=result.backend)
    return Figure(nodes=nodes, busbw_gbps=result.busbw_gbps, backend=result.backend)


def run_gate(
    rpc: AllReduceRpc,
    nodes: tuple[str, ...],
    timeout_s: float,
    *,
    iterations: int = ITERATIONS,
    clock: Callable[[], float] = time.monotonic,
) -> BandwidthMeasured | str:
    """The set, then the ring pairs; a `BandwidthMeasured`, or the reason nothing could be measured.
    iterations: timed all-reduces per group (a burn-in soak runs many more than the gate).

    The pairs go around the ring in rounds where no node is in two pairs (`ring_rounds`; the pairs
    of a round run at once). Each node's figure is the best of its pairs: a slow link is slow in both
    of its pairs, a healthy node has a healthy one. A pair that could not run on the network gives
    its nodes 0.0 (they cannot carry traffic) and its reason goes into the detail; a pair an agent
    refused (busy, an older agent, not allowed) gives no figure at all: a refusal says nothing about
    a link, and the core judges only the nodes with a figure. Every group is bounded by its share of
    the budget, so the whole gate ends within `timeout_s`, whatever the agents do."""
    start = clock()
    deadline = start + timeout_s * (1 - _MARGIN_RATIO) - _MARGIN_S
    token = uuid.uuid4().hex[:8]
    rounds = ring_rounds(len(nodes)) if len(nodes) > 2 else ()  # two nodes: the set is the pair
    stages = 1 + len(rounds)

    def share(stages_left: int) -> float:
        return (deadline - clock()) / stages_left

    def group(members: tuple[str, ...], group_id: str, budget: float) -> Figure:
        if budget < _MIN_GROUP_S:
            return Figure(nodes=members, error=f"no time left in the gate's budget of {timeout_s:g}s")
        return measure_group(rpc, members, group_id, budget, clock, iterations=iterations)

    whole = group(nodes, f"bw-{token}-set", share(stages))
    figures: list[Figure] = [whole]
    best: dict[str, float] = dict.fromkeys(nodes, 0.0)
    judged: set[str] = set()  # nodes with a figure: a pair of theirs ran, or failed on the network
    if len(nodes) == 2 and (whole.ok or not whole.refused):
        best = dict.fromkeys(nodes, whole.busbw_gbps)
        judged.update(nodes)
    for r, pairs in enumerate(rounds, start=1):
        budget = share(stages - r)
        members = [(nodes[a], nodes[b]) for a, b in pairs]
        ids = [f"bw-{token}-r{r}p{i}" for i in range(len(members))]
        with ThreadPoolExecutor(max_workers=len(members), thread_name_prefix="pairs") as threads:
            done = list(threads.map(group, members, ids, [budget] * len(members)))
        for f in done:
            figures.append(f)
            for n in f.nodes:
                best[n] = max(best[n], f.busbw_gbps)
                if f.ok or not f.refused:
                    judged.add(n)
    duration = clock() - start
    if not any(f.ok for f in figures):
        return f"no all-reduce could run ({duration:.1f}s): {_failures(figures)}"
    backend = next(f.backend for f in figures if f.ok)
    detail = f"{backend}, {SIZE_BYTES / (1 << 20):g} MiB x {iterations}"
    if not all(f.ok for f in figures):
        detail += f"; failed: {_failures(figures)}"
    return BandwidthMeasured(
        nodes=nodes,
        set_gbps=whole.busbw_gbps,
        per_node_gbps=tuple((n, best[n]) for n in nodes if n in judged),
        duration_s=duration,
        detail=detail[:1000],
    )


def _failures(figures: list[Figure]) -> str:
    return "; ".join(f"{'+'.join(f.nodes)}: {f.error}" for f in figures if not f.ok)
