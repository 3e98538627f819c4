"""The main job: a real supervised training run on this machine, broken five ways, and its goodput.

    python examples/demo.py [--dir demo-run] [--faults crash,hang,node-lost,straggler,xid]

It starts a private etcd, six node agents (four active, two spares) and the controller, then trains
a small DDP model across four "nodes" (torchrun, gloo). While it trains it injects faults with
`controllerctl chaos` — the same entry point an operator's drill uses — and prints, for each, what
the controller did: detection (detector, latency), attribution (node, evidence), quarantine, the
spare taken, the relaunch (attempt, rendezvous id), the committed step it resumed from and the
first new step. At the end it stops the run (save, commit, exit 0) and prints the goodput report
computed from the event log. It leaves no process behind.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.goodput.report import GoodputReport, compute_goodput
from examples.cluster import ClusterSpec, LocalCluster, leftover_processes
from runwarden.eventlog import LogEntry, read_events
from runwarden.v1 import events_pb2

FAULTS = ("crash", "hang", "node-lost", "straggler", "xid")
# Each fault once the fleet has a ready spare (up to this long): what each restart costs, not what
# two spares cost four quarantines 1.5 s apart (the Xid then waits out a burn-in).
SPARE_READY_S = 90.0
E = events_pb2


def describe(ev: LogEntry, t0: float) -> str | None:
    """One readable line per event worth showing."""
    at = f"[{ev.ts - t0:6.1f}s]"
    kind = E.EventKind.Name(ev.kind).removeprefix("EVENT_KIND_").lower()
    if ev.kind == E.EVENT_KIND_LAUNCH:
        d = ev.launch
        start = f"committed step {d.resume_step}" if d.resume_step >= 0 else "scratch"
        return f"{at} launch    attempt {ev.attempt} rdzv={d.rendezvous_id} nodes={','.join(d.nodes)} from {start}"
    if ev.kind == E.EVENT_KIND_DETECTION:
        d = ev.detection
        det = E.Detector.Name(d.detector).removeprefix("DETECTOR_").lower()
        return f"{at} detect    {det} on {','.join(d.nodes) or '?'} ({d.latency_s:.1f}s after the last good sign): {ev.message}"
    if ev.kind == E.EVENT_KIND_ATTRIBUTION:
        s = ev.attribution.suspects
        who = ", ".join(f"{x.node} ({x.confidence:.0%}: {x.reason})" for x in s[:2]) or "no suspect"
        return f"{at} blame     [{ev.attribution.method}] {who}"
    if ev.kind in (
        E.EVENT_KIND_QUARANTINE,
        E.EVENT_KIND_RELEASE,
        E.EVENT_KIND_SPARE_TAKEN,
        E.EVENT_KIND_FIRST_STEP,
        E.EVENT_KIND_STOP_REQUEST,
        E.EVENT_KIND_PAGE,
        E.EVENT_KIND_RUN_END,
        E.EVENT_KIND_NODE_LOST,
        E.EVENT_KIND_CONTROL_PLANE,
        E.EVENT_KIND_EXIT,
    ):
        return f"{at} {kind:<9} {ev.message}"
    if ev.kind == E.EVENT_KIND_PREFLIGHT_RESULT and not ev.preflight.summary.passed:
        return f"{at} preflight {ev.message}"
    return None


def follow(cluster: LocalCluster, t0: float, stop: threading.Event) -> None:
    seen = 0
    while not stop.is_set():
        for ev in read_events(cluster.event_log).entries:
            if ev.seq > seen:
                seen = ev.seq
                line = describe(ev, t0)
                if line:
                    print(line, flush=True)
        stop.wait(0.3)


def current_nodes(cluster: LocalCluster) -> list[str]:
    for ev in reversed(cluster.events()):
        if ev.kind == E.EVENT_KIND_LAUNCH:
            return list(ev.launch.nodes)
    return []


def last_seq(cluster: LocalCluster) -> int:
    evs = cluster.events()
    return evs[-1].seq if evs else 0


def wait_training(cluster: LocalCluster, after_seq: int, timeout_s: float) -> bool:
    return cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, after_seq, timeout_s) is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class Injection:
    """One injected fault: what, where, when, and whether the run recovered from it."""

    fault: str
    node: str
    at: float
    after_seq: int
    recovered: bool


def pick_victim(
    fault: str, nodes: list[str], victim_rank: int | None = None, avoid: Collection[str] = ()
) -> str:
    """The node a fault hits: node rank `victim_rank`, or the demo's choice (node rank 1; the last
    node for an Xid); past it to the next node rank while that node is one to `avoid`."""
    at = victim_rank if victim_rank is not None else (1 if fault != "xid" else len(nodes) - 1)
    for k in range(len(nodes)):
        node = nodes[(at + k) % len(nodes)]
        if node not in avoid:
            return node
    return nodes[at % len(nodes)]


def inject(cluster: LocalCluster, fault: str, nodes: list[str], victim_rank: int | None = None) -> str:
    """Inject one fault into a node of the running attempt (node rank `victim_rank`, or the demo's
    choice); returns the node."""
    victim = pick_victim(fault, nodes, victim_rank)
    if fault == "crash":
        args = ["chaos", victim, "kill-rank"]
    elif fault == "hang":
        args = ["chaos", victim, "stop-rank"]
    elif fault == "node-lost":
        args = ["chaos", victim, "kill-agent"]
    elif fault == "straggler":
        args = ["chaos", victim, "slow-rank", "--seconds", "0.5"]
    else:
        args = ["chaos", victim, "xid"]
    out = cluster.ctl(*args)
    print(f"           >>> controllerctl {' '.join(args)}: {(out.stdout or out.stderr).strip()}", flush=True)
    return victim


def spare_ready(cluster: LocalCluster) -> bool:
    """A node outside the running attempt is a ready spare (alive, pool SPARE: its burn-in passed)."""
    out = cluster.ctl("--json", "nodes")
    try:
        nodes = json.loads(out.stdout).get("nodes", []) if out.returncode == 0 else []
    except ValueError:
        return False
    return any(n.get("pool_state") == "POOL_STATE_SPARE" and n.get("alive") for n in nodes)


def wait_spare_ready(cluster: LocalCluster, timeout_s: float) -> float:
    """Seconds until a spare is ready (at most `timeout_s`): the fleet has settled from the last
    fault. A fault that needs a spare while every one is still in its burn-in waits for that burn-in:
    the fleet's capacity, not what a restart costs."""
    t0 = time.monotonic()
    while not spare_ready(cluster) and time.monotonic() - t0 < timeout_s:
        time.sleep(1.0)  # a controllerctl process per poll: not faster on a 2-core machine
    return time.monotonic() - t0


def run_faults(
    cluster: LocalCluster,
    faults: list[str],
    timeout_s: float,
    victim_ranks: dict[str, int] | None = None,
    lose_node: Callable[[str], None] | None = None,
    repair_xid_nodes: bool = False,
    spare_ready_s: float = 0.0,
    lose_not: Callable[[], Collection[str]] = tuple,
) -> list[Injection]:
    """Inject each fault into the running attempt and wait for the first new step after it.

    victim_ranks: the node rank a fault hits, where the demo's choice is not wanted.
    lose_node: how the node-lost fault takes a node away where the cluster has a realer way than
    killing its agent (a Slurm node's slurmd, steps and agent SIGKILLed); the node stays lost.
    repair_xid_nodes: after the run recovered from an injected Xid, mark its node repaired (the Xid
    was not real), so that many rounds of faults do not hold every node for repair.
    spare_ready_s > 0: before each fault, wait up to that long for a ready spare (`wait_spare_ready`).
    lose_not: the nodes `lose_node` must not take (asked at the fault), the next node rank instead."""
    done: list[Injection] = []
    for fault in faults:
        if spare_ready_s > 0:
            waited = wait_spare_ready(cluster, spare_ready_s)
            if waited >= 1.0:
                print(f"\n           ... {waited:.0f} s until a spare was ready (its burn-in)", flush=True)
                time.sleep(1.5)
        nodes = current_nodes(cluster)
        mark = last_seq(cluster)
        print(f"\n=== fault: {fault} ===", flush=True)
        at = time.time()
        if fault == "node-lost" and lose_node is not None:
            victim = pick_victim(fault, nodes, (victim_ranks or {}).get(fault), avoid=lose_not())
            print(f"           >>> losing node {victim}", flush=True)
            lose_node(victim)
        else:
            victim = inject(cluster, fault, nodes, (victim_ranks or {}).get(fault))
        if fault == "node-lost" and lose_node is None:
            # systemd's Restart=always brings the agent back; it re-registers and goes through burn-in.
            threading.Timer(8.0, cluster.restart_agent, args=(victim,)).start()
        recovered = wait_training(cluster, mark, timeout_s)
        if not recovered:
            print(f"demo: no recovery from {fault} within {timeout_s:.0f} s", flush=True)
        if fault == "xid" and repair_xid_nodes:
            # a repair ends with the host rebooted: its agent starts without the fatal evidence it held
            cluster.reboot_agent(victim)
            out = cluster.ctl("repaired", victim, "--note", "the injected Xid was not real")
            print(
                f"           >>> controllerctl repaired {victim}: {(out.stdout or out.stderr).strip()}",
                flush=True,
            )
        done.append(Injection(fault=fault, node=victim, at=at, after_seq=mark, recovered=recovered))
        time.sleep(1.5)
    return done


@dataclass(frozen=True, slots=True, kw_only=True)
class Recovery:
    """What the controller did about one injected fault, read back from the event log.

    The phases of the recovery, each from the end of the one before: detect (fault -> detection),
    verdict (detection -> the decision to relaunch: the RESTART event, else the blame), launch
    (decision -> the launch of the attempt that trained again: backoff, preflight, spares), load
    (launch -> every node loaded its checkpoint), first step (loaded -> the first new step)."""

    injection: Injection
    detection: LogEntry | None
    attribution: LogEntry | None
    quarantined: bool
    spare: str
    launch: LogEntry | None
    first_step: LogEntry | None
    restart: LogEntry | None = None  # the supervisor's decision to relaunch
    trained_launch: LogEntry | None = None  # the launch of the attempt whose first step is first_step
    load_done: LogEntry | None = None  # that attempt's "every node loaded"
    workers_started: LogEntry | None = None  # that attempt's launch path per node (warm / cold)

    @property
    def detect_s(self) -> float:
        return self.detection.ts - self.injection.at if self.detection else float("nan")

    @property
    def first_step_s(self) -> float:
        return self.first_step.ts - self.injection.at if self.first_step else float("nan")

    @property
    def decision(self) -> LogEntry | None:
        return self.restart or self.attribution

    def phases(self) -> dict[str, float]:
        """Seconds per phase (nan where an event is missing): detect, verdict, launch, load, first
        step, and total (fault -> first new step)."""
        marks = [
            self.injection.at,
            self.detection.ts if self.detection else None,
            self.decision.ts if self.decision else None,
            self.trained_launch.ts if self.trained_launch else None,
            self.load_done.ts if self.load_done else None,
            self.first_step.ts if self.first_step else None,
        ]
        names = ("detect", "verdict", "launch", "load", "first step")
        out = {
            name: (b - a if a is not None and b is not None else float("nan"))
            for name, a, b in zip(names, marks[:-1], marks[1:], strict=True)
        }
        out["total"] = self.first_step_s
        return out

    @property
    def launch_path(self) -> str:
        """How the relaunched attempt's nodes started their ranks: "warm", "cold", "warm 3/4"."""
        if self.workers_started is None:
            return "-"
        paths = [n.path or "?" for n in self.workers_started.workers_started.nodes]
        warm = paths.count("warm")
        if warm == len(paths):
            return "warm"
        return "cold" if warm == 0 else f"warm {warm}/{len(paths)}"


def recoveries(events: list[LogEntry], injections: list[Injection]) -> list[Recovery]:
    out = []
    bounds = [i.after_seq for i in injections[1:]] + [10**12]
    for inj, end in zip(injections, bounds, strict=True):
        window = [e for e in events if inj.after_seq < e.seq <= end]

        def first(kind: int, window: list[LogEntry] = window, attempt: int | None = None) -> LogEntry | None:
            return next(
                (e for e in window if e.kind == kind and (attempt is None or e.attempt == attempt)), None
            )

        spare = first(E.EVENT_KIND_SPARE_TAKEN)
        first_step = first(E.EVENT_KIND_FIRST_STEP)
        # the attempt that trained again (an earlier launch of the window may have failed)
        trained = first_step.attempt if first_step else None
        detection = first(E.EVENT_KIND_DETECTION)
        restart = next(
            (
                e
                for e in window
                if e.kind == E.EVENT_KIND_RESTART and (not detection or e.seq > detection.seq)
            ),
            None,
        )
        out.append(
            Recovery(
                injection=inj,
                detection=detection,
                attribution=first(E.EVENT_KIND_ATTRIBUTION),
                quarantined=any(
                    e.kind == E.EVENT_KIND_QUARANTINE and e.quarantine.node == inj.node for e in window
                ),
                spare=spare.spare.node if spare else "",
                launch=first(E.EVENT_KIND_LAUNCH),
                first_step=first_step,
                restart=restart,
                trained_launch=first(E.EVENT_KIND_LAUNCH, attempt=trained) if trained else None,
                load_done=first(E.EVENT_KIND_LOAD_DONE, attempt=trained) if trained else None,
                workers_started=first(E.EVENT_KIND_WORKERS_STARTED, attempt=trained) if trained else None,
            )
        )
    return out


def print_recoveries(rs: list[Recovery]) -> None:
    print("\n=== per fault ===")
    head = (
        f"{'fault':<10} {'node':<6} {'detector':<10} {'blamed':<8} {'method':<16} {'quar':<5} "
        f"{'spare':<6} {'attempt':>7} {'resumed':>7} {'1st step':>8} {'path':<9}"
    )
    print(head)
    for r in rs:
        det = (
            E.Detector.Name(r.detection.detection.detector).removeprefix("DETECTOR_").lower()
            if r.detection
            else "-"
        )
        sus = r.attribution.attribution.suspects if r.attribution else []
        launch = r.trained_launch or r.launch
        print(
            f"{r.injection.fault:<10} {r.injection.node:<6} {det:<10} "
            f"{sus[0].node if sus else '-':<8} {r.attribution.attribution.method if r.attribution else '-':<16} "
            f"{'yes' if r.quarantined else 'no':<5} {r.spare or '-':<6} "
            f"{launch.attempt if launch else '-':>7} {launch.launch.resume_step if launch else '-':>7} "
            f"{r.first_step.step if r.first_step else '-':>8} {r.launch_path:<9}"
        )
    print_phases(rs)


def print_phases(rs: list[Recovery]) -> None:
    """Seconds per phase of each recovery, from the event log (Recovery's docstring says where each
    phase starts and ends)."""
    print("\n=== per fault: seconds from the fault to the first new step, by phase ===")
    names = ("detect", "verdict", "launch", "load", "first step", "total")
    print(f"{'fault':<10} " + " ".join(f"{n:>10}" for n in names))
    for r in rs:
        ph = r.phases()
        print(f"{r.injection.fault:<10} " + " ".join(f"{ph[n]:>9.1f}s" for n in names))
    print(
        "detect: fault -> detection; verdict: -> decision to relaunch; launch: -> launch (backoff, "
        "preflight, spare); load: -> every node loaded; first step: -> first new step"
    )


def demo_spec() -> ClusterSpec:
    """The demo's deployment: the shipped defaults but for one policy key. A persistent straggler is
    stopped at once here (kill_stragglers_mid_run); by default it is only quarantined at the next
    restart, which a short demo might never reach."""
    return ClusterSpec(policy={"kill_stragglers_mid_run": True}, shipped_timings=True)


def demo_cluster(root: Path) -> LocalCluster:
    """The demo's cluster in `root`: preflight at its shipped defaults, as a user's deployment runs it
    (not the test clusters' cut-down settings), the agents at theirs."""
    return LocalCluster(root, demo_spec(), shipped_preflight=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path("demo-run"))
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument(
        "--fault-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for recovery per fault (a bound: the demo goes on as soon as it recovered)",
    )
    args = p.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        p.error(f"unknown fault(s) {bad}; choose from {FAULTS}")
    cluster = demo_cluster(args.dir)
    spec = cluster.spec
    t0 = time.time()
    print(
        f"runwarden demo: etcd, {spec.active + spec.spares} node agents ({spec.spares} spares), controller; "
        f"state in {cluster.root}",
        flush=True,
    )
    stop = threading.Event()
    follower = threading.Thread(target=follow, args=(cluster, t0, stop), daemon=True)
    rc = 0
    injections: list[Injection] = []
    try:
        cluster.start()
        follower.start()
        if not wait_training(cluster, 0, 120):
            print(
                "demo: the run did not start training within 120 s; see", cluster.run_dir / "controller.log"
            )
            return 1
        time.sleep(1)
        injections = run_faults(cluster, faults, args.fault_timeout, spare_ready_s=SPARE_READY_S)
        rc = 0 if all(i.recovered for i in injections) else 1
        print("\n=== planned stop: save, commit, exit 0 ===", flush=True)
        cluster.ctl("stop", spec.run, "--reason", "demo finished")
        cluster.wait_for_event(E.EVENT_KIND_RUN_END, 0, 60)
        time.sleep(1)
    finally:
        stop.set()
        cluster.stop()
    events = read_events(cluster.event_log).entries
    print_recoveries(recoveries(events, injections))
    report = compute_goodput(events, run=spec.run)
    print_goodput(report)
    left = leftover_processes(cluster.root)
    print(f"\ndemo finished in {time.time() - t0:.0f} s; processes left behind: {len(left)}")
    return rc if not left else 1


def print_goodput(report: GoodputReport) -> None:
    from controller.ctl.format import Painter, colour_wanted
    from controller.ctl.goodput import render_report

    print("\n=== goodput (computed from the event log) ===")
    print(render_report(report.to_proto(), "cause", Painter(enabled=colour_wanted("auto", sys.stdout))))


if __name__ == "__main__":
    sys.exit(main())
