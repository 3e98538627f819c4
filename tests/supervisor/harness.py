"""A tiny shell for the sans-IO core in tests: keeps simulated time, timers and outstanding requests.

`Driver` plays the live shell's part: it feeds events, records every batch (flattened: log entries,
then actions), delivers `Tick` when a `SetTimer` falls due while time advances (the shared
`controller.supervisor.timers.Timers` rules), and can answer outstanding preflight requests. It
also renders items as one line each, for the golden scenario scripts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.supervisor import machine as core
from controller.supervisor.actions import (
    Action,
    AllocateFromQueue,
    CollectDumps,
    Launch,
    MeasureBandwidth,
    Page,
    PersistCheckpoint,
    PersistMemory,
    PersistNode,
    Quarantine,
    Release,
    RunPreflight,
    SetTimer,
    StopAttempt,
    TakeSpare,
)
from controller.supervisor.events import (
    AttemptExited,
    BandwidthMeasured,
    Event,
    NodeJoined,
    PreflightResult,
    ProgressObserved,
    RankSample,
    Tick,
)
from controller.supervisor.policy import RunPlan, SupervisorConfig
from controller.supervisor.timers import Timers
from runwarden.v1 import events_pb2

# What one step of the driver returns: a batch flattened, its log entries first (the order of obligations).
Item = Action | events_pb2.Event


def fast(**kw: object) -> SupervisorConfig:
    """The core tests' config: short backoff, grace and dump timeouts, no wait for late joiners."""
    base: dict[str, object] = {
        "backoff_base_s": 1.0,
        "backoff_max_s": 8.0,
        "dump_timeout_s": 5.0,
        "stop_grace_s": 5.0,
        "stop_margin_s": 2.0,
        "queue_wait_s": 0.0,
    }
    base.update(kw)
    return SupervisorConfig(**base)  # test knobs


@dataclass
class Driver:
    cfg: SupervisorConfig = field(default_factory=SupervisorConfig)
    nodes: int = 4
    run: str = "demo"
    now: float = 1000.0
    ranks_per_node: int = 1

    def __post_init__(self) -> None:
        self.sup = core.Supervisor(self.cfg, RunPlan(run=self.run, nodes=self.nodes))
        self.actions: list[Item] = []
        self.batch: list[Item] = []
        self.timers = Timers()
        self.preflight_out: list[RunPreflight] = []
        self.soaks_out: list[MeasureBandwidth] = []  # burn-in soaks, answered with the preflights
        self.launches: list[Launch] = []

    # --- feeding events -----------------------------------------------------------------------

    def send(self, event: Event, now: float | None = None) -> list[Item]:
        if now is not None:
            self.now = max(self.now, now)
        batch = self.sup.handle(event, self.now)
        out: list[Item] = [*batch.entries, *batch.actions]
        self._record(out)
        self.batch = out
        return out

    def _record(self, out: list[Item]) -> None:
        for a in out:
            self.actions.append(a)
            if isinstance(a, SetTimer):
                self.timers.set(a.key, a.at)
            elif isinstance(a, RunPreflight):
                self.preflight_out.append(a)
            elif isinstance(a, MeasureBandwidth) and a.purpose == "burn_in":
                self.soaks_out.append(a)
            elif isinstance(a, Launch):
                self.launches.append(a)

    def advance(self, seconds: float) -> list[Item]:
        """Move time forward, firing due timers in order, then one final tick."""
        target = self.now + seconds
        out: list[Item] = []
        while True:
            due = self.timers.next_at()
            if due is None or due > target:
                break
            self.timers.pop_due(due)
            out += self.send(Tick(), max(self.now, due))
        out += self.send(Tick(), target)
        self.batch = out
        return out

    def add_nodes(self, count: int, prefix: str = "n", start: int = 1) -> list[str]:
        names = [f"{prefix}{i}" for i in range(start, start + count)]
        for n in names:
            self.send(NodeJoined(node=n, local_ranks=self.ranks_per_node))
        return names

    def answer_preflight(self, fail: dict[str, tuple[str, ...]] | None = None) -> list[Item]:
        """Answer every outstanding RunPreflight: pass, except nodes in `fail` (name -> checks); then
        every burn-in soak, on a flat fabric (1 GB/s everywhere, as the simulator's)."""
        fail = fail or {}
        out: list[Item] = []
        while self.preflight_out or self.soaks_out:
            if self.preflight_out:
                req = self.preflight_out.pop(0)
                for n in req.nodes:
                    checks = fail.get(n)
                    out += self.send(
                        PreflightResult(
                            node=n, passed=checks is None, mode=req.mode, failed_checks=checks or ()
                        )
                    )
                continue
            soak = self.soaks_out.pop(0)
            flat = tuple((n, 1.0) for n in soak.nodes)
            out += self.send(
                BandwidthMeasured(nodes=soak.nodes, set_gbps=1.0, per_node_gbps=flat, duration_s=1.0)
            )
        return out

    def start(self, nodes: int | None = None) -> Launch:
        self.add_nodes(nodes if nodes is not None else self.nodes)
        self.answer_preflight()
        assert self.sup.state == core.RunState.RUNNING, self.sup.state
        return self.launches[-1]

    def running_nodes(self) -> list[str]:
        return list(self.sup.current_nodes)

    def progress(
        self,
        step: int,
        *,
        dt: float = 1.0,
        nodes: list[str] | None = None,
        compute: dict[str, float] | None = None,
        in_checkpoint: tuple[str, ...] = (),
        loaded: int | None = None,
        loss: Callable[[int, int], float] | None = None,
        snapshots: tuple[int, ...] | Mapping[str, tuple[int, ...]] = (),
    ) -> list[Item]:
        """One job step on every running node (or `nodes`), `dt` seconds after the last; `loaded`: the
        ranks' `loaded_step` (their load mark, carried on every report after it); `loss(step, rank)`:
        each rank's loss of the step; `snapshots`: the in-memory snapshots every rank holds (or per
        node)."""
        self.now += dt
        out: list[Item] = []
        for node_rank, node in enumerate(self.running_nodes()):
            if nodes is not None and node not in nodes:
                continue
            c = (compute or {}).get(node, 0.8 * dt)
            wait = max(0.0, dt - c) if node not in (compute or {}) else 0.0005
            ranks = tuple(
                RankSample(
                    rank=node_rank * self.ranks_per_node + i,
                    step=step,
                    step_time_s=dt,
                    compute_s=c,
                    wait_s=wait,
                    in_checkpoint=node in in_checkpoint,
                    reported_at=self.now,
                    loaded_step=loaded,
                    losses=((step, loss(step, node_rank * self.ranks_per_node + i)),) if loss else (),
                    snapshot_steps=snapshots.get(node, ()) if isinstance(snapshots, Mapping) else snapshots,
                )
                for i in range(self.ranks_per_node)
            )
            out += self.send(ProgressObserved(node=node, attempt=self.sup.attempt, ranks=ranks))
        return out

    def steps(self, first: int, last: int, **kw: Any) -> list[Item]:
        out: list[Item] = []
        for s in range(first, last + 1):
            out += self.progress(s, **kw)
            if self.timers.pop_due(self.now):
                out += self.send(Tick())
        return out

    def exit_all(self, code: int = 0, attempt: int | None = None) -> list[Item]:
        out: list[Item] = []
        for node in self.running_nodes():
            if self.sup.pool.get(node).alive:
                out += self.send(
                    AttemptExited(node=node, attempt=attempt or self.sup.attempt, exit_code=code)
                )
        return out

    # --- inspecting ---------------------------------------------------------------------------

    def events(self, kind: int | None = None, actions: list[Item] | None = None) -> list[events_pb2.Event]:
        src = self.actions if actions is None else actions
        return [a for a in src if isinstance(a, events_pb2.Event) and (kind is None or a.kind == kind)]

    def of(self, cls: type, actions: list[Item] | None = None) -> list[Any]:
        src = self.actions if actions is None else actions
        return [a for a in src if isinstance(a, cls)]


def render(action: Item) -> str | None:
    """One line per item for golden scripts; timers and persistence are not shown here."""
    if isinstance(action, SetTimer | PersistNode | PersistMemory | PersistCheckpoint):
        return None
    if isinstance(action, events_pb2.Event):
        ev = action
        kind = events_pb2.EventKind.Name(ev.kind).removeprefix("EVENT_KIND_")
        extra = ""
        if ev.HasField("detection"):
            d = ev.detection
            extra = f" [{events_pb2.Detector.Name(d.detector).removeprefix('DETECTOR_')} latency={d.latency_s:.1f}s]"
        elif ev.HasField("attribution"):
            extra = f" [{ev.attribution.method}]"
        return f"log {kind} a={ev.attempt} step={ev.step}: {ev.message}{extra}"
    if isinstance(action, Launch):
        return (
            f"launch attempt={action.attempt} rdzv={action.rendezvous_id} resume={action.resume_step} "
            f"nodes={','.join(nr.node for nr in action.nodes)}" + (" cold" if action.cold else "")
        )
    if isinstance(action, RunPreflight):
        return f"preflight {action.mode} ({action.purpose}) {','.join(action.nodes)}"
    if isinstance(action, StopAttempt):
        return f"stop attempt={action.attempt} planned={action.planned} grace={action.grace_s:g} {','.join(action.nodes)}"
    if isinstance(action, MeasureBandwidth):
        soaked = f" ({action.purpose}, {action.iterations} iterations)" if action.purpose != "gate" else ""
        return f"measure-bandwidth {','.join(action.nodes)} within {action.timeout_s:g}s{soaked}"
    if isinstance(action, CollectDumps):
        return f"collect-dumps attempt={action.attempt} {','.join(action.nodes)}"
    if isinstance(action, Quarantine):
        return f"quarantine {action.node} held={action.held}"
    if isinstance(action, Release):
        return f"release {action.node}"
    if isinstance(action, TakeSpare):
        return f"take-spare {action.node} replaces={action.replaces}"
    if isinstance(action, AllocateFromQueue):
        return f"allocate {action.count}"
    if isinstance(action, Page):
        return f"page: {action.reason}"
    return repr(action)
