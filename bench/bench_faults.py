"""Fault recovery on this machine, with the real system: time to detect, time to the first new step,
and the restart breakdown, per fault kind, median over trials.

    .venv/bin/python bench/bench_faults.py --trials 5 --out bench/results/bench_faults.json
    .venv/bin/python bench/bench_faults.py --faults node-lost,hang --trials 20 --per-run 10 \
        --out bench/results/bench_detection.json
    .venv/bin/python bench/bench_faults.py --fleet --trials 5 --per-run 5 --out bench/results/bench_faults_fleet.json

Each run is `examples/cluster.LocalCluster` (private etcd, 6 agents, controller, torchrun + gloo on
CPU) with the demo's fault injection (`controllerctl chaos`); with `--fleet`, a
`testbed.fleet_cluster.FleetCluster` instead: etcd, the controller and each agent on its own
network-namespace host (mTLS, the collectives on each host's eth0; needs root). `--per-run K` injects K rounds of the
fault list into one cluster before starting a fresh one. Each fault comes once a spare is ready
(`--spare-ready`, up to 90 s, as the demo does: a fault is not made to wait out another node's
burn-in; 0: 1.5 s after the last recovery). Phases are read from the event log:
detect (fault -> DETECTION), attribute (-> ATTRIBUTION), replace (-> last QUARANTINE/SPARE_TAKEN),
preflight (-> PREFLIGHT_RESULT), launch (-> LAUNCH), load (-> LOAD_DONE, when the log has it),
first step (-> FIRST_STEP). By default the deployment is the demo's (examples/demo.demo_cluster):
preflight, the agents' warm-worker setting and every clock at their shipped defaults (`--preflight
test`: the test clusters' cut-down preflight, `--fleet` always runs it; `--timings test`: their short
lease TTL, stop grace, backoff and dump timeout). With `--warm on|off|both` the agents' warm
workers are set explicitly (parked ranks, torch imported; healthy hosts keep their processes across the
restart, nodeagent/warm/rank.py): each row also counts the nodes whose processes were kept
(`kept_nodes`), whose group was kept with a dead rank forked again (`reforked_nodes`), and whose
state came from their own memory (`memory_nodes`).

    flock /tmp/runwarden-heavy.lock .venv/bin/python bench/bench_faults.py --warm both --trials 5 \
        --per-run 5 --out bench/results/bench_faults_warm.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.cluster import ClusterSpec, LocalCluster
from examples.demo import FAULTS, SPARE_READY_S, Injection, run_faults
from nodeagent.warm.groups import REFORKED
from runwarden.eventlog import LogEntry
from runwarden.v1 import events_pb2
from testbed.fleet import Fleet, default_prefix
from testbed.fleet_cluster import FleetCluster

E = events_pb2
PHASES = ("detect", "attribute", "replace", "preflight", "launch", "load", "first_step")


def phases(events: list[LogEntry], inj: Injection, end_seq: int) -> dict[str, float] | None:
    window = [e for e in events if inj.after_seq < e.seq <= end_seq]
    launch = next((e for e in window if e.kind == E.EVENT_KIND_LAUNCH), None)
    detect = next((e for e in window if e.kind == E.EVENT_KIND_DETECTION), None)
    first = next(
        (e for e in window if e.kind == E.EVENT_KIND_FIRST_STEP and launch and e.seq > launch.seq), None
    )
    if launch is None or detect is None or first is None:
        return None
    before = [e for e in window if e.seq < launch.seq]

    def last(*kinds: int) -> LogEntry | None:
        return next((e for e in reversed(before) if e.kind in kinds), None)

    marks: list[tuple[str, float | None]] = [
        ("detect", detect.ts),
        ("attribute", next((e.ts for e in before if e.kind == E.EVENT_KIND_ATTRIBUTION), None)),
        ("replace", (ev.ts if (ev := last(E.EVENT_KIND_QUARANTINE, E.EVENT_KIND_SPARE_TAKEN)) else None)),
        ("preflight", (ev.ts if (ev := last(E.EVENT_KIND_PREFLIGHT_RESULT)) else None)),
        ("launch", launch.ts),
        (
            "load",
            next((e.ts for e in window if e.kind == E.EVENT_KIND_LOAD_DONE and e.seq > launch.seq), None),
        ),
        ("first_step", first.ts),
    ]
    out: dict[str, float] = {}
    prev = inj.at
    for name, ts in marks:
        if ts is None or ts < prev:
            out[name] = 0.0
            continue
        out[name] = ts - prev
        prev = ts
    out["time_to_detect"] = detect.ts - inj.at
    out["time_to_first_step"] = first.ts - inj.at
    out["first_step_after_detection"] = first.ts - detect.ts
    # the warm path's share: nodes whose processes were kept from the failed attempt, and nodes whose
    # state came from their own memory (WORKERS_STARTED details, LOAD_DONE's message)
    started = next(
        (e for e in window if e.kind == E.EVENT_KIND_WORKERS_STARTED and e.attempt == launch.attempt), None
    )
    details = [n.detail for n in started.workers_started.nodes] if started else []
    reforked = [d for d in details if REFORKED in d]
    out["kept_nodes"] = float(sum("kept from attempt" in d for d in details) - len(reforked))
    out["reforked_nodes"] = float(len(reforked))  # its group kept, a dead rank forked again by its leader
    load = next((e for e in window if e.kind == E.EVENT_KIND_LOAD_DONE and e.seq > launch.seq), None)
    memory = re.search(r"memory on ([^;]+)", load.message) if load else None
    out["memory_nodes"] = float(len(memory.group(1).split(", ")) if memory else 0)
    return out


def one_run(
    faults: list[str],
    rounds: int,
    timeout_s: float,
    fleet: bool = False,
    warm: bool | None = None,
    settle_s: float = 1.0,
    shipped_preflight: bool = True,
    shipped_timings: bool = True,
    spare_ready_s: float = SPARE_READY_S,
) -> list[tuple[str, dict[str, float] | None]]:
    """One cluster, `rounds` rounds of `faults`; warm None: the agents' shipped default."""
    policy: dict[str, object] = {"kill_stragglers_mid_run": True}
    if rounds > 1:
        # Many faults on six nodes: without this the "failed twice in a week stays out" rule holds
        # every node after a few rounds and the pool runs dry (correctly, but it ends the trials).
        policy["hold_after_failures"] = 1000
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp, contextlib.ExitStack() as stack:
        cluster: LocalCluster | FleetCluster
        # warm None: the key is not set, the agents run their shipped default
        spec = ClusterSpec(policy=policy, warm_workers=warm, shipped_timings=shipped_timings)
        if fleet:
            hosts = stack.enter_context(Fleet(default_prefix()))
            cluster = FleetCluster(hosts, Path(tmp) / "c", spec)
        else:
            cluster = LocalCluster(Path(tmp) / "c", spec, shipped_preflight=shipped_preflight)
        try:
            cluster.start()
            if cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 180) is None:
                raise SystemExit("the run did not start")
            time.sleep(settle_s)
            injections = run_faults(
                cluster, faults * rounds, timeout_s, repair_xid_nodes=rounds > 1, spare_ready_s=spare_ready_s
            )
        finally:
            cluster.stop()
        events = cluster.events()
    ends = [i.after_seq for i in injections[1:]] + [10**12]
    return [
        (i.fault, phases(events, i, end) if i.recovered else None)
        for i, end in zip(injections, ends, strict=True)
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--trials", type=int, default=5, help="trials per fault kind")
    p.add_argument("--per-run", type=int, default=1, help="rounds of the fault list per cluster")
    p.add_argument("--timeout", type=float, default=90.0)
    p.add_argument("--out", type=Path)
    p.add_argument("--fleet", action="store_true", help="across network-namespace hosts (root)")
    p.add_argument(
        "--warm",
        choices=("default", "off", "on", "both"),
        default="default",
        help="the agents' warm workers (default: as shipped); both: cold and warm clusters alternate, "
        "one result per mode",
    )
    p.add_argument(
        "--preflight",
        choices=("shipped", "test"),
        default="shipped",
        help="preflight's shipped defaults, or the test clusters' cut-down settings",
    )
    p.add_argument(
        "--timings",
        choices=("shipped", "test"),
        default="shipped",
        help="the agents' and controller's clocks (lease TTL, stop grace, backoff, dump timeout): "
        "shipped defaults, or the test clusters' short ones",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=20.0,
        help="seconds of training before the first fault (warm: the standby groups park meanwhile)",
    )
    p.add_argument(
        "--spare-ready",
        type=float,
        default=SPARE_READY_S,
        help="before each fault, wait up to this long for a ready spare, as the demo does (0: no wait: "
        "faults 1.5 s apart, a fault may wait out another node's burn-in)",
    )
    args = p.parse_args()
    if args.settle < 0:
        p.error("--settle: seconds, >= 0")
    faults = [f for f in args.faults.split(",") if f]
    modes = {"default": ["default"], "off": ["cold"], "on": ["warm"], "both": ["cold", "warm"]}[args.warm]
    warm_of: dict[str, bool | None] = {"default": None, "cold": False, "warm": True}
    samples = {m: {f: [] for f in faults} for m in modes}
    failures = {m: dict.fromkeys(faults, 0) for m in modes}
    t0 = time.time()

    def done(mode: str) -> int:
        return min(len(v) + failures[mode][k] for k, v in samples[mode].items())

    while todo := [m for m in modes if done(m) < args.trials]:
        for mode in todo:  # alternating modes: the machine's noise falls on both alike
            # The last cluster runs only the rounds still missing (5 trials at 3 per run: 3 + 2).
            rounds = min(args.per_run, args.trials - done(mode))
            for fault, ph in one_run(
                faults,
                rounds,
                args.timeout,
                args.fleet,
                warm=warm_of[mode],
                settle_s=args.settle,
                shipped_preflight=args.preflight == "shipped",
                shipped_timings=args.timings == "shipped",
                spare_ready_s=args.spare_ready,
            ):
                if ph is None:
                    failures[mode][fault] += 1
                else:
                    samples[mode][fault].append(ph)
            # after every cluster: a cut-off run keeps its data
            report(samples, failures, time.time() - t0, args.out, command=sys.argv)
    return 0


def summary(rows: list[dict[str, float]], unrecovered: int) -> dict[str, object]:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    det = sorted(r["time_to_detect"] for r in rows)
    p99 = det[min(len(det) - 1, round(0.99 * (len(det) - 1)))]
    return {"n": len(rows), "unrecovered": unrecovered, "median": med, "detect_p99": p99, "samples": rows}


def report(
    samples: dict[str, dict[str, list[dict[str, float]]]],
    failures: dict[str, dict[str, int]],
    wall_s: float,
    out: Path | None,
    command: list[str] | None = None,
) -> None:
    """One mode: {"faults": ...} as before; both: {"modes": {"cold": ..., "warm": ...}} and, per fault,
    the ratio warm/cold of the median first new step after detection."""
    per_mode = {m: report_mode(samples[m], failures[m], m) for m in samples}
    result: dict[str, object] = {"wall_s": wall_s, "command": command or []}
    if len(per_mode) == 1:
        ((mode, faults),) = per_mode.items()
        result |= {"warm_workers": {"default": "shipped default"}.get(mode, mode == "warm"), "faults": faults}
    else:
        ratios = {}
        for fault, cold in per_mode["cold"].items():
            warm = per_mode["warm"].get(fault)
            if warm is not None and cold["median"]["first_step_after_detection"] > 0:
                ratios[fault] = (
                    warm["median"]["first_step_after_detection"]
                    / cold["median"]["first_step_after_detection"]
                )
        result |= {"modes": per_mode, "ratio_warm_cold_first_step_after_detection": ratios}
        print(
            "warm/cold, first new step after detection: "
            + ", ".join(f"{f} {r:.2f}" for f, r in ratios.items())
        )
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))


def report_mode(
    samples: dict[str, list[dict[str, float]]], failures: dict[str, int], mode: str
) -> dict[str, dict[str, object]]:
    faults: dict[str, dict[str, object]] = {}
    print(f"-- {mode}")
    print(
        f"{'fault':<10} {'n':>3} {'detect':>7} {'p99':>6} {'1st step':>8} "
        + " ".join(f"{ph:>10}" for ph in PHASES)
    )
    for fault, rows in samples.items():
        if not rows:
            continue
        faults[fault] = s = summary(rows, failures[fault])
        med, p99 = s["median"], s["detect_p99"]
        print(
            f"{fault:<10} {len(rows):>3} {med['time_to_detect']:6.2f}s {p99:5.2f}s {med['time_to_first_step']:7.1f}s "
            + " ".join(f"{med[ph]:9.2f}s" for ph in PHASES),
            flush=True,
        )
    return faults


if __name__ == "__main__":
    sys.exit(main())
