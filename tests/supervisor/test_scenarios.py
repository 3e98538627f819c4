"""Readable scenario scripts with golden output, in the style of raft's interaction tests.

Each file in tests/supervisor/scenarios/ is a list of blocks: one command line, a `----` line, then the
expected output (one line per action; timers and pool persistence are not shown), then a blank
line. Regenerate after an intended change with `REWRITE_SCENARIOS=1 pytest tests/supervisor/test_scenarios.py`
and review the diff like code.

Commands (one handler each):
  config nodes=4 [SupervisorConfig field=value ...]   start a fresh supervisor (first line)
  add-nodes 6                       nodes n1..n6 join
  preflight [fail=n3:gpu.count;n4:x]  answer every outstanding preflight (pass unless named)
  steps 1..30 [dt=1] [without=n3] [slow=n3:1.1]   job steps on the running nodes
        [loss=curve] [nan=n2] [scale=n2:1.001]  each rank's loss (2/(1+0.05 step) + 0.001 rank); n2's NaN; x1.001
  commit 20                         a checkpoint's commit marker was written
  tick 40                           time passes (due timers fire, then one tick)
  lose n3 | join n3                 a lease DELETE / a node registering
  exit n3 code=1|signal=9 [rank=2]  a node's workers ended
  exit-all code=0                   every live node of the attempt ended
  dumps [suspect=n3:2:reason words] flight-recorder attribution arrived
  evidence n3 xid=79                fatal Xid evidence published by n3's agent
  stop reason [norelaunch]          a planned stop request
  control-plane lost|restored       etcd unreachable / reachable (restored sends a snapshot)
  quarantine n3 reason | release n3 reason   operator commands
  lose-many n1,n2,n3                leases expiring at once
  checkpoint-failed 20 [node=n1]    a rank reported that saving step 20 failed
  fail-launch [node=n2] [temporary=true]   the shell could not carry out the last Launch (ActionFailed)
  fail-preflight n3 [temporary=false]      the shell could not reach n3 for its preflight (ActionFailed)
  bandwidth set=3 n1=10 n2=1 ...    answer the last MeasureBandwidth (the set's and each node's best pair GB/s)
  restart-controller                a new controller: a fresh core reconciles from the store's view
                                    and the loss history the logged LOSS_RECORD events hold
  send-unknown                      an event with no rule (the error is the output)
  timers | pool                     print the pending timers / every node's pool state and the run's state
Errors (an unknown pair, a bad value) are output lines (`error: ...`), never an abort.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from controller.live.loss_history import loss_history
from controller.supervisor.actions import MeasureBandwidth, RunPreflight
from controller.supervisor.blame import FlightRecorderVerdict, Suspect
from controller.supervisor.events import (
    ActionFailed,
    AttemptExited,
    BandwidthMeasured,
    CheckpointCommitted,
    CheckpointFailed,
    ControlPlaneLost,
    ControlPlaneRestored,
    DumpsCollected,
    EvidenceObserved,
    NodeJoined,
    NodeLaunchPath,
    NodeLost,
    OperatorQuarantine,
    OperatorRelease,
    StopRequested,
    StoreListed,
    WorkersStarted,
)
from controller.supervisor.policy import SupervisorConfig
from controller.supervisor.states import TransitionError
from runwarden.v1 import common_pb2, events_pb2
from tests.supervisor.harness import Driver, render
from tests.support.golden import check_golden

SCENARIOS = Path(__file__).parent / "scenarios"


def _kv(args: list[str]) -> tuple[list[str], dict[str, str]]:
    pos = [a for a in args if "=" not in a]
    kv = dict(a.split("=", 1) for a in args if "=" in a)
    return pos, kv


def _loss(d: Driver, kv: dict[str, str]) -> Callable[[int, int], float]:
    """steps' loss=curve [nan=NODE] [scale=NODE:FACTOR]: a deterministic curve per (step, rank)."""
    ranks = {node: i for i, node in enumerate(d.running_nodes())}  # node rank: its ranks' block
    per = d.ranks_per_node
    nan = {ranks[kv["nan"]]} if "nan" in kv else set()
    node, _, factor = kv.get("scale", ":1").partition(":")
    scaled = {ranks[node]} if node else set()

    def loss(step: int, rank: int) -> float:
        if rank // per in nan:
            return math.nan
        return (2.0 / (1.0 + 0.05 * step) + 0.001 * rank) * (float(factor) if rank // per in scaled else 1.0)

    return loss


class Runner:
    def __init__(self) -> None:
        self.d = Driver()
        self.earlier_log: list[events_pb2.Event] = []  # what earlier controllers logged

    def run(self, line: str) -> list[str]:
        cmd, *args = line.split()
        handler = getattr(self, "cmd_" + cmd.replace("-", "_"), None)
        if handler is None:
            raise ValueError(f"unknown scenario command {cmd!r}")
        driver, start = self.d, len(self.d.actions)
        try:
            printed = handler(args)
            if printed is not None:
                return printed
        except (TransitionError, ValueError) as exc:  # an error is output, not an abort
            return [
                *(r for a in self.d.actions[start:] if (r := render(a)) is not None),
                f"error: {type(exc).__name__}: {exc}",
            ]
        if self.d is not driver:  # restart-controller: a new driver, all of whose output is new
            start = 0
        return [r for a in self.d.actions[start:] if (r := render(a)) is not None]

    def cmd_timers(self, args: list[str]) -> list[str]:
        """Pending timers, relative to now."""
        return [f"timer {k} in {at - self.d.now:g}s" for k, at in self.d.timers.items()]

    def cmd_pool(self, args: list[str]) -> list[str]:
        """Every node's pool state (and whether its lease is alive), and the run's state."""
        sup = self.d.sup
        rows = [
            f"pool {n}: {p.state.label}{'' if p.alive else ' (lost)'}"
            + (f" failures={len(p.failure_times)}" if p.failure_times else "")
            for n, p in sorted(sup.pool.nodes.items())
        ]
        return [*rows, f"state {sup.state.name} attempt={sup.attempt} step={sup.job_step}"]

    def cmd_lose_many(self, args: list[str]) -> None:
        for n in args[0].split(","):
            self.d.send(NodeLost(node=n))

    def cmd_checkpoint_failed(self, args: list[str]) -> None:
        pos, kv = _kv(args)
        self.d.send(
            CheckpointFailed(step=int(pos[0]), error=kv.get("error", "disk full"), node=kv.get("node", ""))
        )

    def cmd_started(self, args: list[str]) -> None:
        """The shell's answer to the last Launch: every node started, each on its path (node=path[:why])."""
        _, kv = _kv(args)
        last = self.d.launches[-1]
        paths = []
        for nr in last.nodes:
            path, _, why = kv.get(nr.node, "cold").partition(":")
            paths.append(NodeLaunchPath(node=nr.node, path=path, detail=why.replace("_", " ")))
        self.d.send(WorkersStarted(attempt=int(kv.get("attempt", last.attempt)), nodes=tuple(paths)))

    def cmd_fail_launch(self, args: list[str]) -> None:
        """The shell could not carry out the last Launch (a refused CAS: permanent), optionally on one node."""
        _, kv = _kv(args)
        self.d.send(
            ActionFailed(
                action=self.d.launches[-1],
                temporary=kv.get("temporary") == "true",
                reason=kv.get("reason", "attempt record CAS refused"),
                node=kv.get("node", ""),
            )
        )

    def cmd_fail_preflight(self, args: list[str]) -> None:
        """The shell could not reach a node for its preflight (UNAVAILABLE past every retry)."""
        pos, kv = _kv(args)
        req = next(r for r in reversed(self.d.preflight_out) if pos[0] in r.nodes)
        self.d.preflight_out.remove(req)
        rest = tuple(n for n in req.nodes if n != pos[0])
        if rest:
            self.d.preflight_out.append(RunPreflight(nodes=rest, mode=req.mode, purpose=req.purpose))
        self.d.send(
            ActionFailed(
                action=req,
                node=pos[0],
                temporary=kv.get("temporary", "true") == "true",
                reason=kv.get("reason", "UNAVAILABLE: connection refused"),
            )
        )

    def cmd_bandwidth(self, args: list[str]) -> None:
        """Answer the last MeasureBandwidth: `set=GBPS` and each node's best pair figure `n1=GBPS`."""
        _, kv = _kv(args)
        req = self.d.of(MeasureBandwidth)[-1]
        per_node = tuple((n, float(kv[n])) for n in req.nodes if n in kv)
        self.d.send(
            BandwidthMeasured(
                nodes=req.nodes,
                set_gbps=float(kv.get("set", "0")),
                per_node_gbps=per_node,
                duration_s=2.0,
                detail="gloo, 1 MiB x 3",
            )
        )

    def cmd_restart_controller(self, args: list[str]) -> None:
        """A new controller: a fresh core, fed the store's view (what the old one persisted) and the
        loss history its log holds (the live shell's own reading of the LOSS_RECORD events)."""
        old = self.d.sup
        logged = self.earlier_log + [a for a in self.d.actions if isinstance(a, events_pb2.Event)]
        self.earlier_log = logged
        records = tuple(p.view() for p in old.pool.nodes.values())
        alive = {n: 1 for n, p in old.pool.nodes.items() if p.alive}
        self.d = Driver(cfg=old.cfg, nodes=old.plan.nodes, now=self.d.now)
        self.d.send(
            StoreListed(
                alive=alive,
                records=records,
                attempt=old.attempt,
                attempt_nodes=old.current_nodes,
                resume_step=old.cur.resume_step,
                committed_steps=tuple(sorted(old.committed)),
                losses=loss_history(logged, old.plan.run),
            )
        )

    def cmd_send_unknown(self, args: list[str]) -> None:
        """An event the machine has no rule for (a bug in a shell): the error is the output."""

        class Unknown:
            pass

        self.d.send(Unknown())  # deliberately not an Event

    def cmd_config(self, args: list[str]) -> None:
        _, kv = _kv(args)
        nodes = int(kv.pop("nodes", "4"))
        fields = SupervisorConfig.__dataclass_fields__
        typed = {
            k: (fields[k].type in ("bool",) and v == "true")
            if fields[k].type == "bool"
            else int(v)
            if fields[k].type == "int"
            else float(v)
            if fields[k].type != "str"
            else v
            for k, v in kv.items()
        }
        self.d = Driver(cfg=SupervisorConfig(**typed), nodes=nodes)  # typed above

    def cmd_add_nodes(self, args: list[str]) -> None:
        self.d.add_nodes(int(args[0]))

    def cmd_preflight(self, args: list[str]) -> None:
        _, kv = _kv(args)
        fail = {}
        for item in filter(None, kv.get("fail", "").split(";")):
            node, checks = item.split(":")
            fail[node] = tuple(checks.split(","))
        self.d.answer_preflight(fail)

    def cmd_steps(self, args: list[str]) -> None:
        pos, kv = _kv(args)
        first, last = (int(x) for x in pos[0].split(".."))
        dt = float(kv.get("dt", "1"))
        without = set(kv.get("without", "").split(",")) - {""}
        compute = {}
        if "slow" in kv:
            node, factor = kv["slow"].split(":")
            compute[node] = 0.8 * dt * float(factor)
        nodes = [n for n in self.d.running_nodes() if n not in without]
        loss = _loss(self.d, kv) if "loss" in kv else None
        for s in range(first, last + 1):
            self.d.progress(s, dt=dt, nodes=nodes, compute=compute, loss=loss)
            self.d.advance(0)

    def cmd_commit(self, args: list[str]) -> None:
        self.d.send(CheckpointCommitted(step=int(args[0]), path=f"/ckpt/step-{int(args[0]):08d}"))

    def cmd_tick(self, args: list[str]) -> None:
        self.d.advance(float(args[0].rstrip("s")))

    def cmd_lose(self, args: list[str]) -> None:
        self.d.send(NodeLost(node=args[0]))

    def cmd_join(self, args: list[str]) -> None:
        self.d.send(NodeJoined(node=args[0]))

    def cmd_exit(self, args: list[str]) -> None:
        pos, kv = _kv(args)
        self.d.send(
            AttemptExited(
                node=pos[0],
                attempt=self.d.sup.attempt,
                ended_at=self.d.now,
                exit_code=int(kv["code"]) if "code" in kv else None,
                signal=int(kv["signal"]) if "signal" in kv else None,
                rank=int(kv["rank"]) if "rank" in kv else None,
                never_started="never_started" in pos[1:],
            )
        )

    def cmd_exit_all(self, args: list[str]) -> None:
        _, kv = _kv(args)
        self.d.exit_all(code=int(kv.get("code", "0")))

    def cmd_dumps(self, args: list[str]) -> None:
        suspects: tuple[Suspect, ...] = ()
        if args and args[0].startswith("suspect="):
            node, rank, *_ = args[0].removeprefix("suspect=").split(":")
            reason = " ".join([args[0].split(":", 2)[2], *args[1:]]) if args[0].count(":") >= 2 else ""
            suspects = (Suspect(node=node, ranks=(int(rank),), confidence=0.95, reason=reason),)
        self.d.send(
            DumpsCollected(attempt=self.d.sup.attempt, verdict=FlightRecorderVerdict(suspects=suspects))
        )

    def cmd_evidence(self, args: list[str]) -> None:
        pos, kv = _kv(args)
        xid = int(kv.get("xid", "79"))
        self.d.send(
            EvidenceObserved(
                evidence=common_pb2.Evidence(
                    node=pos[0],
                    kind=common_pb2.EVIDENCE_KIND_XID,
                    xid=xid,
                    severity=common_pb2.SEVERITY_FATAL,
                    detail=f"Xid {xid}",
                    observed_at=self.d.now,
                    source="kmsg",
                )
            )
        )

    def cmd_stop(self, args: list[str]) -> None:
        words = [a for a in args if a != "norelaunch"]
        self.d.send(
            StopRequested(reason=" ".join(words), requested_by="scenario", relaunch="norelaunch" not in args)
        )

    def cmd_control_plane(self, args: list[str]) -> None:
        if args[0] == "lost":
            self.d.send(ControlPlaneLost())
            return
        self.d.send(ControlPlaneRestored())
        sup = self.d.sup
        alive = {n: 1 for n, p in sup.pool.nodes.items() if p.alive}
        self.d.send(
            StoreListed(
                alive=alive,
                attempt=sup.attempt,
                attempt_nodes=sup.current_nodes,
                committed_steps=tuple(sorted(sup.committed)),
            )
        )

    def cmd_quarantine(self, args: list[str]) -> None:
        self.d.send(OperatorQuarantine(node=args[0], reason=" ".join(args[1:])))

    def cmd_release(self, args: list[str]) -> None:
        self.d.send(OperatorRelease(node=args[0], reason=" ".join(args[1:])))


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.txt")), ids=lambda p: p.stem)
def test_scenario(path: Path) -> None:
    check_golden(path, Runner().run, "REWRITE_SCENARIOS")


def test_scenarios_exist() -> None:
    assert len(list(SCENARIOS.glob("*.txt"))) >= 5


def test_scenario_events_cover_the_log_schema_and_round_trip_through_the_event_log(tmp_path: Path) -> None:
    """Every event kind issue 5 names is emitted somewhere, and every one survives the real log."""
    from runwarden.eventlog import EventLog, read_events
    from runwarden.v1 import events_pb2 as E

    written: list[E.Event] = []
    for path in sorted(SCENARIOS.glob("*.txt")):
        runner = Runner()
        for block in path.read_text().split("\n\n"):
            lines = [ln for ln in block.strip("\n").splitlines() if not ln.startswith("#")]
            if lines:
                runner.run(lines[0])
        written += [a for a in runner.d.actions if isinstance(a, E.Event)]
    log_path = tmp_path / "events.jsonl"
    with EventLog(log_path) as log:
        for ev in written:
            log.append(ev)
    read = read_events(log_path)
    assert read.errors == [] and read.torn_tail is None and len(read.entries) == len(written)
    for got, want in zip(read.entries, written, strict=True):
        want_copy = E.Event()
        want_copy.CopyFrom(want)
        want_copy.seq = got.seq
        assert got == want_copy
    kinds = {ev.kind for ev in written}
    for kind in (
        E.EVENT_KIND_LAUNCH,
        E.EVENT_KIND_EXIT,
        E.EVENT_KIND_DETECTION,
        E.EVENT_KIND_ATTRIBUTION,
        E.EVENT_KIND_QUARANTINE,
        E.EVENT_KIND_RELEASE,
        E.EVENT_KIND_SPARE_TAKEN,
        E.EVENT_KIND_PREFLIGHT_RESULT,
        E.EVENT_KIND_CHECKPOINT_COMMIT,
        E.EVENT_KIND_WORKERS_STARTED,
        E.EVENT_KIND_STOP_REQUEST,
        E.EVENT_KIND_FIRST_STEP,
        E.EVENT_KIND_PAGE,
        E.EVENT_KIND_RUN_END,
        E.EVENT_KIND_CONTROL_PLANE,
        E.EVENT_KIND_RESTART,
        E.EVENT_KIND_ALLOCATE,
        E.EVENT_KIND_NODE_LOST,
        E.EVENT_KIND_NODE_JOINED,
    ):
        assert kind in kinds, E.EventKind.Name(kind)
    detectors = {ev.detection.detector for ev in written if ev.kind == E.EVENT_KIND_DETECTION}
    assert {
        E.DETECTOR_HANG,
        E.DETECTOR_CRASH,
        E.DETECTOR_NODE_LOST,
        E.DETECTOR_STRAGGLER,
        E.DETECTOR_EVIDENCE,
    } <= detectors
