"""An unmodified script through nodeagent.trainer.bootstrap vs the instrumented path (BENCHMARKS.md, issue 19).

    flock /tmp/runwarden-heavy.lock .venv/bin/python bench/bench_bootstrap.py \
        [--cost-trials 3] [--cost-s 20] [--trials 5] [--per-run 5] --out bench/results/bench_bootstrap.json

Two measurements, each alternating its modes so the machine's noise falls on all of them alike:

* **cost**: CPU seconds per rank per second of wall time spent deriving and sending progress.
  Each trial is a real 2-rank gloo job under torchrun (a toy DDP model, one all-reduce per step,
  ~18 steps/s here) for `--cost-s` seconds, its reports going to the agent's real progress-datagram
  server in this process. Bootstrap mode: the rank runs the plain DDP loop with
  `CollectiveSampler` (the bootstrap's thread: read the flight recorder's counters, derive, report,
  send), at the default sample interval (0.02 s) and at 0.005 s; the thread's own CPU
  (`time.thread_time` around each sample). Instrumented mode: the same loop calling
  `ProgressReporter.report(step)` every step (nodeagent.trainer, without a collective timer) and
  its background sends; the CPU of those calls in the threads that make them. Also the samples
  and reports per second.
* **detection**: fault -> DETECTION and fault -> the first new step, for a hang (`controllerctl chaos
  NODE stop-rank`: SIGSTOP) and a crash (`kill-rank`: SIGKILL), with the real system: an
  `examples/cluster.LocalCluster` (etcd, 6 agents, the controller, torchrun + gloo on CPU) running
  examples/train.py (instrumented), and the same cluster running tests/nodeagent/plain_ddp.py with
  `script_mode = "unmodified"` (tests/live/test_unmodified_script.py's cluster). Same policy
  (hang timeout max(10 s, 3 x median step)), `--per-run` rounds of (hang, crash) per cluster.

Results go to --out as JSON; the medians are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.cluster import ClusterSpec, LocalCluster  # noqa: E402
from examples.demo import run_faults  # noqa: E402
from nodeagent.daemon.progress_socket import ProgressDatagramServer  # noqa: E402
from nodeagent.wire import progress_socket_path  # noqa: E402
from runwarden.v1 import agent_pb2, events_pb2  # noqa: E402

E = events_pb2
COST_MODES = ("bootstrap", "bootstrap-5ms", "instrumented")
DETECT_MODES = ("instrumented", "unmodified")
FAULTS = ("hang", "crash")


# --- cost: the rank side (run under torchrun as `bench_bootstrap.py rank MODE SECONDS OUT`) ---------


def rank_main(mode: str, seconds: float, out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nodeagent.trainer import ProgressReporter, bootstrap

    cpu = [0.0]
    lock = threading.Lock()

    def counted(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    cpu[0] += time.thread_time() - start

        return wrapper

    class CountedReporter(ProgressReporter):
        flush = counted(ProgressReporter.flush)  # the background sends, in the thread that sends
        report = counted(ProgressReporter.report)

    class CountedSampler(bootstrap.CollectiveSampler):
        sample = counted(bootstrap.CollectiveSampler.sample)  # read, derive, report and send

    reporter: Any
    sampler = None
    if mode == "instrumented":
        reporter = CountedReporter.from_env(handle_sigterm=False)
    else:
        reporter = ProgressReporter.from_env(handle_sigterm=False)
        config = bootstrap.BootstrapConfig(sample_interval_s=0.005 if mode == "bootstrap-5ms" else 0.02)
        sampler = CountedSampler(reporter=reporter, config=config)
    dist.init_process_group("gloo")
    model = DDP(nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)))
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    if sampler is not None:
        sampler.start()
    with lock:
        cpu[0] = 0.0  # from the first step on: start-up is not the steady cost
    start, steps = time.monotonic(), 0
    flag = torch.zeros(1)
    while True:
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(20, 10)), torch.randn(20, 5)).backward()
        opt.step()
        time.sleep(0.05)
        steps += 1
        if mode == "instrumented":
            reporter.report(steps)
        if steps % 10 == 0:  # every rank stops at the same step
            flag[0] = float(time.monotonic() - start >= seconds)
            dist.all_reduce(flag)
            if flag[0] > 0:
                break
    wall = time.monotonic() - start
    if sampler is not None:
        sampler.stop()
    with lock:
        used = cpu[0]
    result = {
        "mode": mode,
        "rank": dist.get_rank(),
        "wall_s": wall,
        "steps": steps,
        "cpu_s": used,
        "cpu_s_per_s": used / wall,
        "samples_per_s": (sampler.samples / wall) if sampler is not None else 0.0,
        "reports_per_s": ((sampler.reports if sampler is not None else steps) / wall),
    }
    reporter.close()
    dist.destroy_process_group()
    out.with_name(f"{out.name}.rank{result['rank']}").write_text(json.dumps(result))


def cost_trial(mode: str, seconds: float, tmp: Path) -> list[dict[str, Any]]:
    received = [0]

    def handle(req: agent_pb2.ReportProgressRequest) -> agent_pb2.ReportProgressResponse:
        received[0] += len(req.reports)
        return agent_pb2.ReportProgressResponse()

    sock = str(tmp / f"agent-{mode}.sock")
    server = ProgressDatagramServer(progress_socket_path(sock), handle, lambda code, s: None)
    server.start()
    out = tmp / f"cost-{mode}"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "RUNWARDEN_RUN": "bench",
        "RUNWARDEN_ATTEMPT": "1",
        "RUNWARDEN_NODEAGENT_SOCKET": sock,
    }
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nnodes=1",
                "--nproc-per-node=2",
                "--max-restarts=0",
                str(Path(__file__).resolve()),
                "rank",
                mode,
                str(seconds),
                str(out),
            ],
            env=env,
            check=True,
            timeout=seconds + 300,
        )
    finally:
        server.stop()
    rows = [json.loads(out.with_name(f"{out.name}.rank{r}").read_text()) for r in (0, 1)]
    for row in rows:
        row["datagrams_received"] = received[0]
    return rows


# --- detection ---------------------------------------------------------------------------------------


def detection_run(mode: str, rounds: int, timeout_s: float) -> list[dict[str, Any]]:
    from tests.live.test_unmodified_script import UnmodifiedCluster

    # many faults on six nodes: without this "failed twice in a week stays out" empties the pool
    spec = ClusterSpec(run="bench", policy={"hold_after_failures": 1000})
    with tempfile.TemporaryDirectory(prefix=f"bench-bootstrap-{mode}-") as tmp:
        root = Path(tmp) / "c"
        cluster = UnmodifiedCluster(root, spec) if mode == "unmodified" else LocalCluster(root, spec)
        try:
            cluster.start()
            if cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 240) is None:
                raise SystemExit(f"{mode}: the run did not start")
            time.sleep(2)
            injections = run_faults(cluster, list(FAULTS) * rounds, timeout_s)
        finally:
            cluster.stop()
        events = cluster.events()
    rows = []
    ends = [i.after_seq for i in injections[1:]] + [10**12]
    for inj, end in zip(injections, ends, strict=True):
        window = [e for e in events if inj.after_seq < e.seq <= end]
        detect = next((e for e in window if e.kind == E.EVENT_KIND_DETECTION), None)
        blame = next((e for e in window if e.kind == E.EVENT_KIND_ATTRIBUTION), None)
        launch = next((e for e in window if e.kind == E.EVENT_KIND_LAUNCH), None)
        first = next(
            (e for e in window if e.kind == E.EVENT_KIND_FIRST_STEP and launch and e.seq > launch.seq), None
        )
        rows.append(
            {
                "mode": mode,
                "fault": inj.fault,
                "node": inj.node,
                "recovered": inj.recovered,
                "detect_s": detect.ts - inj.at if detect else None,
                "detector": E.Detector.Name(detect.detection.detector) if detect else "",
                "blamed": list(s.node for s in blame.attribution.suspects) if blame else [],
                "blame_method": E.BlameMethod.Name(blame.attribution.blame_method) if blame else "",
                "first_new_step_s": first.ts - inj.at if first else None,
            }
        )
    return rows


# --- the report --------------------------------------------------------------------------------------


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(cost: list[dict[str, Any]], detection: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"cost": {}, "detection": {}}
    for mode in COST_MODES:
        rows = [r for r in cost if r["mode"] == mode]
        if rows:
            out["cost"][mode] = {
                "rank_trials": len(rows),
                "cpu_s_per_rank_s_median": med([r["cpu_s_per_s"] for r in rows]),
                "cpu_s_per_rank_s_max": max(r["cpu_s_per_s"] for r in rows),
                "samples_per_s_median": med([r["samples_per_s"] for r in rows]),
                "reports_per_s_median": med([r["reports_per_s"] for r in rows]),
                "steps_per_s_median": med([r["steps"] / r["wall_s"] for r in rows]),
            }
    for mode in DETECT_MODES:
        for fault in FAULTS:
            rows = [r for r in detection if r["mode"] == mode and r["fault"] == fault]
            if not rows:
                continue
            ok = [r for r in rows if r["detect_s"] is not None]
            out["detection"][f"{mode}/{fault}"] = {
                "n": len(rows),
                "detected": len(ok),
                "recovered": sum(1 for r in rows if r["recovered"]),
                "blamed_the_injected_node": sum(1 for r in rows if r["blamed"][:1] == [r["node"]]),
                "detect_s_median": med([r["detect_s"] for r in ok]),
                "detect_s_max": max((r["detect_s"] for r in ok), default=None),
                "first_new_step_s_median": med(
                    [r["first_new_step_s"] for r in rows if r["first_new_step_s"] is not None]
                ),
            }
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank_main(sys.argv[2], float(sys.argv[3]), Path(sys.argv[4]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cost-trials", type=int, default=3, help="2-rank jobs per cost mode")
    p.add_argument("--cost-s", type=float, default=20.0, help="seconds of training per cost trial")
    p.add_argument("--trials", type=int, default=5, help="faults of each kind per detection mode")
    p.add_argument("--per-run", type=int, default=5, help="rounds of (hang, crash) per cluster")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--skip-detection", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    cost: list[dict[str, Any]] = []
    detection: list[dict[str, Any]] = []
    started = time.time()

    def save() -> None:
        result = {
            "command": " ".join(sys.argv),
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "wall_s": time.time() - started,
            "load_average_at_end": os.getloadavg(),
            "summary": summarize(cost, detection),
            "cost_rows": cost,
            "detection_rows": detection,
        }
        print(json.dumps(result["summary"], indent=2), flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="bench-bootstrap-cost-") as tmp:
        for _ in range(args.cost_trials):
            for mode in COST_MODES:  # alternating: the machine's noise falls on every mode alike
                cost.extend(cost_trial(mode, args.cost_s, Path(tmp)))
            save()
    if not args.skip_detection:
        done = dict.fromkeys(DETECT_MODES, 0)
        while todo := [m for m in DETECT_MODES if done[m] < args.trials]:
            for mode in todo:
                rounds = min(args.per_run, args.trials - done[mode])
                detection.extend(detection_run(mode, rounds, args.timeout))
                done[mode] += rounds
                save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
