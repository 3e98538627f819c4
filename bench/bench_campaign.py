"""Randomized fault campaign: many random faults over repeated LocalCluster runs (a benchmark, not CI).

    .venv/bin/python bench/bench_campaign.py [--faults 56] [--per-run 8] [--seed 7] [--out bench/results/campaign]

Each round starts a whole local deployment (etcd, node agents, controller; examples/cluster.py), waits
for training, then injects `--per-run` faults drawn at random from FAULT_KINDS, one at a time, each
into a random node of the running attempt, and waits for the system to settle before the next one.
Rank faults go through `controllerctl chaos` (the operator's drill entry point); etcd blips are a
SIGSTOP/SIGCONT of etcd shorter than a lease TTL; a controller kill is SIGKILL of the leader, after
which a replacement replica is started on the same config (what systemd's Restart=always does).

Every verdict is read back from the event log, never from the injector:
  * detected     — a DETECTION event after the injection (rank faults);
  * attributed   — the first suspect of the ATTRIBUTION (or the only detected node) is the victim;
  * resumed      — the relaunch resumed from the newest CHECKPOINT_COMMIT logged before it;
  * storm        — more than two LAUNCH events for one fault;
  * survived     — for etcd blips and controller kills: nothing declared dead (no DETECTION,
                   QUARANTINE or LAUNCH), and a new CHECKPOINT_COMMIT after the fault.
Per-fault rows go to <out>/faults.jsonl as they happen; the summary to <out>/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.cluster import ClusterSpec, LocalCluster, leftover_processes
from runwarden.v1 import events_pb2

E = events_pb2
RANK_FAULTS = ("crash", "hang", "node-lost", "straggler", "xid")
INFRA_FAULTS = ("etcd-blip", "controller-kill")
FAULT_KINDS = RANK_FAULTS + INFRA_FAULTS
CHAOS_ARGS = {
    "crash": ["kill-rank"],
    "hang": ["stop-rank"],
    "node-lost": ["kill-agent"],
    "straggler": ["slow-rank", "--seconds", "0.5"],
    "xid": ["xid"],
}


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultResult:
    round: int
    fault: str
    node: str
    detected: bool
    attributed: bool
    resumed_from_commit: bool
    launches: int
    storm: bool
    recovered: bool
    survived: bool
    detect_s: float
    recover_s: float
    note: str


def _launch_nodes(cluster: LocalCluster) -> list[str]:
    for ev in reversed(cluster.events()):
        if ev.kind == E.EVENT_KIND_LAUNCH:
            return list(ev.launch.nodes)
    return []


def _last_seq(cluster: LocalCluster) -> int:
    evs = cluster.events()
    return evs[-1].seq if evs else 0


def _api_port_of_controller(cluster: LocalCluster) -> None:
    """Start a replacement controller replica (new API port) after the leader was killed."""
    cluster._start_controller()  # rewrites controller.toml with a fresh API port, same identity


def _inject(cluster: LocalCluster, fault: str, victim: str, rng: random.Random) -> str:
    if fault in CHAOS_ARGS:
        out = cluster.ctl("chaos", victim, *CHAOS_ARGS[fault])
        if fault == "node-lost":  # systemd's Restart=always brings the agent back
            threading.Timer(8.0, cluster.restart_agent, args=(victim,)).start()
        return (out.stdout or out.stderr).strip()[:200]
    if fault == "etcd-blip":
        assert cluster.etcd is not None and cluster.etcd.pid
        pause = rng.uniform(0.3, 0.4) * cluster.spec.lease_ttl_s
        os.kill(cluster.etcd.pid, signal.SIGSTOP)
        time.sleep(pause)
        os.kill(cluster.etcd.pid, signal.SIGCONT)
        return f"etcd stopped {pause:.2f}s"
    assert cluster.controller is not None
    os.killpg(cluster.controller.pid, signal.SIGKILL)
    cluster.controller.wait()
    _api_port_of_controller(cluster)
    return "controller SIGKILLed, replacement started"


def _judge_rank(
    cluster: LocalCluster,
    rnd: int,
    fault: str,
    victim: str,
    at: float,
    mark: int,
    timeout_s: float,
    note: str,
) -> FaultResult:
    first = cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, mark, timeout_s)
    time.sleep(1.0)
    events = cluster.events()
    window = [e for e in events if e.seq > mark]
    det = next((e for e in window if e.kind == E.EVENT_KIND_DETECTION), None)
    att = next((e for e in window if e.kind == E.EVENT_KIND_ATTRIBUTION), None)
    if att is not None and att.attribution.suspects:
        blamed = att.attribution.suspects[0].node
    else:
        blamed = det.detection.nodes[0] if det is not None and len(det.detection.nodes) == 1 else ""
    launches = [e for e in window if e.kind == E.EVENT_KIND_LAUNCH]
    resumed = False
    if launches:
        commits = [
            e.step for e in events if e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT and e.seq < launches[0].seq
        ]
        resumed = launches[0].launch.resume_step == (max(commits) if commits else -1)
    return FaultResult(
        round=rnd,
        fault=fault,
        node=victim,
        detected=det is not None,
        attributed=blamed == victim,
        resumed_from_commit=resumed,
        launches=len(launches),
        storm=len(launches) > 2,
        recovered=first is not None,
        survived=first is not None,
        detect_s=round(det.ts - at, 2) if det else -1.0,
        recover_s=round(first.ts - at, 2) if first else -1.0,
        note=note,
    )


def _judge_infra(cluster: LocalCluster, rnd: int, fault: str, at: float, mark: int, note: str) -> FaultResult:
    # Survived = nothing declared dead and training kept committing checkpoints afterwards.
    deadline = time.monotonic() + 45
    commit = None
    while time.monotonic() < deadline and commit is None:
        commit = next(
            (
                e
                for e in cluster.events()
                if e.seq > mark and e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT and e.ts > at + 2.0
            ),
            None,
        )
        time.sleep(0.5)
    time.sleep(1.0)
    window = [e for e in cluster.events() if e.seq > mark]
    bad = [
        E.EventKind.Name(e.kind)
        for e in window
        if e.kind in (E.EVENT_KIND_DETECTION, E.EVENT_KIND_QUARANTINE, E.EVENT_KIND_LAUNCH)
    ]
    launches = sum(e.kind == E.EVENT_KIND_LAUNCH for e in window)
    ok = commit is not None and not bad
    return FaultResult(
        round=rnd,
        fault=fault,
        node="",
        detected=True,
        attributed=True,
        resumed_from_commit=True,
        launches=launches,
        storm=launches > 2,
        recovered=commit is not None,
        survived=ok,
        detect_s=-1.0,
        recover_s=round(commit.ts - at, 2) if commit else -1.0,
        note=note + (f"; unexpected {bad}" if bad else ""),
    )


def run_round(
    rnd: int, root: Path, faults: list[str], rng: random.Random, timeout_s: float, sink: Path
) -> list[FaultResult]:
    spec = ClusterSpec(active=2, spares=4, ckpt_every=10, policy={"kill_stragglers_mid_run": True})
    cluster = LocalCluster(root / f"round{rnd}", spec)
    results: list[FaultResult] = []
    try:
        cluster.start()
        if cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 180) is None:
            print(f"round {rnd}: no training within 180 s; skipped", flush=True)
            return results
        time.sleep(2)
        for fault in faults:
            nodes = _launch_nodes(cluster)
            victim = rng.choice(nodes) if nodes else ""
            mark, at = _last_seq(cluster), time.time()
            note = _inject(cluster, fault, victim, rng)
            if fault in RANK_FAULTS:
                r = _judge_rank(cluster, rnd, fault, victim, at, mark, timeout_s, note)
            else:
                r = _judge_infra(cluster, rnd, fault, at, mark, note)
            results.append(r)
            with sink.open("a") as f:
                f.write(json.dumps(asdict(r)) + "\n")
            print(
                f"round {rnd} {fault:<16} {victim or '-':<6} det={r.detected} blame={r.attributed} "
                f"resume={r.resumed_from_commit} launches={r.launches} ok={r.survived} "
                f"detect={r.detect_s}s recover={r.recover_s}s",
                flush=True,
            )
            time.sleep(2.0)
    finally:
        cluster.stop()
        left = leftover_processes(cluster.root)
        if left:
            print(f"round {rnd}: processes left behind: {left}", flush=True)
    return results


def summarize(results: list[FaultResult], wall_s: float) -> dict[str, object]:
    rank = [r for r in results if r.fault in RANK_FAULTS]
    infra = [r for r in results if r.fault in INFRA_FAULTS]
    relaunched = [r for r in rank if r.launches > 0]
    by_kind: dict[str, dict[str, int]] = {}
    for r in results:
        k = by_kind.setdefault(r.fault, {"injected": 0, "survived": 0})
        k["injected"] += 1
        k["survived"] += int(r.survived and (r.fault in INFRA_FAULTS or r.detected))

    def rate(n: int, d: int) -> float:
        return round(n / d, 4) if d else float("nan")

    return {
        "faults": len(results),
        "rank_faults": len(rank),
        "infra_faults": len(infra),
        "wall_s": round(wall_s) if wall_s == wall_s else None,
        "detection_rate": rate(sum(r.detected for r in rank), len(rank)),
        "attribution_correct": rate(sum(r.attributed for r in rank), len(rank)),
        "resumed_from_commit": rate(sum(r.resumed_from_commit for r in relaunched), len(relaunched)),
        "recovered": rate(sum(r.recovered for r in results), len(results)),
        "infra_survived": rate(sum(r.survived for r in infra), len(infra)),
        "restart_storms": sum(r.storm for r in results),
        "by_kind": by_kind,
        "detect_s_median": sorted(r.detect_s for r in rank if r.detected)[
            len([r for r in rank if r.detected]) // 2
        ]
        if any(r.detected for r in rank)
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=56)
    p.add_argument("--per-run", type=int, default=8)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for recovery per fault")
    p.add_argument("--out", type=Path, default=Path("bench/results/campaign"))
    p.add_argument("--workdir", type=Path, default=Path("/tmp/runwarden-campaign"))
    p.add_argument(
        "--summarize", action="store_true", help="only summarize <out>/faults.jsonl (e.g. a cut-short run)"
    )
    args = p.parse_args(argv)
    if args.summarize:
        rows = [
            FaultResult(**json.loads(line))
            for line in (args.out / "faults.jsonl").read_text().splitlines()
            if line
        ]
        summary = summarize(rows, float("nan"))
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary, indent=2))
        return 0
    rng = random.Random(args.seed)
    plan = [rng.choice(FAULT_KINDS) for _ in range(args.faults)]
    args.out.mkdir(parents=True, exist_ok=True)
    sink = args.out / "faults.jsonl"
    sink.write_text("")
    t0 = time.monotonic()
    results: list[FaultResult] = []
    for rnd, start in enumerate(range(0, len(plan), args.per_run)):
        results += run_round(rnd, args.workdir, plan[start : start + args.per_run], rng, args.timeout, sink)
    summary = summarize(results, time.monotonic() - t0)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
