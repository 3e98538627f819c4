"""Fault recovery per scheduler backend on this machine: the time from a fault to the first new step,
per backend (agents, slurm, ray) and fault kind, median over trials, and the ratio to the agents
backend measured in the same run; for Slurm also the time from a time-limit signal to the stop's
commit.

    .venv/bin/python bench/bench_backends.py --trials 5 --out bench/results/bench_backends.json
    .venv/bin/python bench/bench_backends.py --backends agents,ray --faults crash,node-lost --trials 2
    .venv/bin/python bench/bench_backends.py --trials 5 --resume --out bench/results/bench_backends.json
        # continues a run cut short (--budget-s, or killed) up to 5 trials
    .venv/bin/python bench/bench_backends.py --markdown bench/results/bench_backends.json  # the tables

Every backend runs the same job (examples/train.py, torchrun + gloo on CPU, 2 active nodes + 1
spare, one local rank each, the test clusters' policy plus `kill_stragglers_mid_run` and
`hold_after_failures = 1000`) against a private etcd and the real `controller run`:

* agents: examples/cluster.LocalCluster (a static fleet of 3 agents on loopback ports);
* slurm: `[controller] backend = "slurm"` on the throwaway 4-node Slurm cluster of
  tests/backends/slurm_cluster.py (no prolog); the agents are started by srun from
  deploy/slurm/agents.sbatch inside the allocation the controller submits;
* ray: `[controller] backend = "ray"` on a ray.cluster_utils.Cluster (a head with no CPUs and four
  1-CPU worker raylets on loopback addresses), tests/e2e/test_ray_run.RayRun.

Faults are the demo's (examples/demo.inject: `controllerctl chaos <node> kill-rank | stop-rank |
slow-rank | xid`), except node-lost: on agents `chaos kill-agent` and the agent restarted 8 s later
(systemd's Restart=always, as bench/bench_faults.py); on Slurm the host dies (its slurmd, its
slurmstepd, the agent and the rank SIGKILLed: SlurmCluster.kill_node); on Ray the worker node's
raylet is killed (Cluster.remove_node(allow_graceful=False)). One cluster runs one round of the
fault list (node-lost last: it takes a node for good); a fault that is not recovered from within
--timeout ends that cluster's round. Rounds go agents, slurm, ray, agents, ... so a run cut short
(--budget-s) still has comparable numbers. On Slurm each round then ends with the time-limit
notice: `scancel --signal=USR1 <job>` for each of the run's allocation jobs (what --signal=USR1@300
does before the time limit): every agent drains, the controller stops the attempt as planned
(finish the step, save, commit, exit 0); measured: signal -> STOP_REQUEST, -> the stop's commit
(the last CHECKPOINT_COMMIT after the stop request and before the planned-stop EXIT), -> that
EXIT.

The phases of a recovery come from the event log (bench/bench_faults.phases); the JSON is written
after every cluster, so a cut-off run keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Protocol

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_faults import phases  # noqa: E402
from examples.cluster import ClusterSpec, LocalCluster, kill_strays  # noqa: E402
from examples.demo import FAULTS, Injection, current_nodes, inject, last_seq  # noqa: E402
from runwarden.eventlog import LogEntry  # noqa: E402
from runwarden.v1 import events_pb2  # noqa: E402
from testbed.etcd_server import EtcdServer, free_port  # noqa: E402
from testbed.fleet_cluster import (  # noqa: E402
    ClusterBase,
    agent_settings,
    controller_settings,
    controllerctl,
    preflight_settings,
    program,
    start_controller,
    write_toml,
)

E = events_pb2
BACKENDS = ("agents", "slurm", "ray")
POLICY: dict[str, object] = {"kill_stragglers_mid_run": True, "hold_after_failures": 1000}


def spec(run: str) -> ClusterSpec:
    return ClusterSpec(run=run, active=2, spares=1, policy=dict(POLICY))


class Bench(Protocol):
    """One backend's run: started, faulted, stopped; the demo's ctl/events interface."""

    @property
    def event_log(self) -> Path: ...
    def start(self) -> Any: ...
    def stop(self) -> None: ...
    def lose_node(self, node: str) -> None: ...
    def ctl(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]: ...
    def events(self) -> list[LogEntry]: ...
    def wait_for_event(
        self, kind: int, after_seq: int, timeout_s: float, pred: Any = None
    ) -> LogEntry | None: ...


# -- agents: the static fleet -----------------------------------------------------------------------


class AgentsRun(LocalCluster):
    timers: list[threading.Timer]

    def lose_node(self, node: str) -> None:
        out = self.ctl("chaos", node, "kill-agent")
        print(f"    controllerctl chaos {node} kill-agent: {(out.stdout or out.stderr).strip()}", flush=True)
        # systemd's Restart=always brings the agent back; it re-registers and goes through burn-in.
        timer = threading.Timer(8.0, self.restart_agent, args=(node,))
        self.timers = [*getattr(self, "timers", []), timer]
        timer.start()

    def stop(self) -> None:
        for timer in getattr(self, "timers", []):
            timer.cancel()
        super().stop()


# -- slurm ------------------------------------------------------------------------------------------


class SlurmRun(ClusterBase):
    """etcd and `controller run` with backend = "slurm" on a running SlurmCluster (as
    tests/backends/test_slurm_controller.py sets it up); stop() gives the cluster back as it was."""

    def __init__(self, root: Path, cluster: Any) -> None:
        self.root = root
        self.spec = spec("slurmbench")
        self.slurm = cluster
        self.agents = {}
        self.etcd: EtcdServer | None = None
        self.controller: subprocess.Popen[bytes] | None = None
        self.api_port = free_port()
        self.lost: list[str] = []
        # Short: an agent's flight-recorder sockets live under <dir>/<node>/runs/<run>/attempt-N/fr/.
        self.agents_dir = Path(tempfile.mkdtemp(prefix="rw-agents-", dir="/tmp"))

    def start(self) -> SlurmRun:
        for d in (self.root, self.run_dir, self.ckpt_dir, self.loss_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.etcd = EtcdServer(self.root / "etcd", fast=True).start()
        write_toml(self.root / "preflight.toml", preflight_settings(self.ckpt_dir))
        agent = agent_settings(
            "unused",
            self.spec,
            listen="127.0.0.1:0",
            state_dir=self.root,
            etcd_endpoints=[self.etcd.endpoint],
            preflight_config=self.root / "preflight.toml",
        )
        for key in ("node", "unix_socket", "run_dir"):  # agents.sbatch gives each node its own
            del agent[key]
        write_toml(self.root / "nodeagent.toml", {"": agent})
        settings = controller_settings(
            self.spec,
            store={"endpoints": [self.etcd.endpoint]},
            run_dir=self.run_dir,
            ckpt_dir=self.ckpt_dir,
            loss_dir=self.loss_dir,
            api_address=f"127.0.0.1:{self.api_port}",
            metrics_address="",
        )
        settings["controller"].update(backend="slurm", spares=self.spec.spares)
        settings["slurm"] = {
            "agent_config": str(self.root / "nodeagent.toml"),
            "agent_run_dir": str(self.agents_dir),
            "nodeagent": program("nodeagent"),
            "output": str(self.root / "%x-%j.out"),
            "slurm_conf": str(self.slurm.conf),
            "allocate_timeout_s": 60,
        }
        write_toml(self.run_dir / "controller.toml", settings)
        self.controller = start_controller(self.run_dir / "controller.toml", self.run_dir / "controller.log")
        return self

    def ctl(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return controllerctl(f"127.0.0.1:{self.api_port}", *args, timeout=timeout)

    def lose_node(self, node: str) -> None:
        self.slurm.kill_node(node)  # the host dies: slurmd, its slurmstepd, the agent and the rank
        self.lost.append(node)

    def jobs(self) -> list[str]:
        names = f"--name=runwarden-{self.spec.run},runwarden-{self.spec.run}-more"
        return self.slurm.cmd("squeue", "--noheader", "--format=%i", names).split()

    def time_limit(self) -> list[str]:
        """What --signal=USR1@<lead> does before the time limit: USR1 to every step (the agents)."""
        jobs = self.jobs()
        for job in jobs:
            self.slurm.cmd("scancel", "--signal=USR1", job)
        return jobs

    def stop(self) -> None:
        if self.controller is not None and self.controller.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.controller.pid, signal.SIGTERM)
            try:
                self.controller.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.controller.pid, signal.SIGKILL)
                self.controller.wait(5)
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            jobs = self.slurm.cmd("squeue", "--noheader", "--format=%i").split()
            if jobs:
                self.slurm.cmd("scancel", *jobs)
        self.slurm.kill_steps()
        kill_strays(self.agents_dir)
        if self.etcd is not None:
            self.etcd.discard()
        shutil.rmtree(self.agents_dir, ignore_errors=True)
        restore_slurm(self.slurm, self.lost)


def restore_slurm(cluster: Any, lost: list[str]) -> None:
    """Every node idle again: the lost ones restarted, runwarden's drains undone (an operator's repair)."""
    for node in lost:
        cluster.start_node(node)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            states = cluster.node_states()
            if all(s == "idle" for s, _ in states.values()):
                return
            for node, (state, _) in states.items():
                if "drain" in state and not state.endswith("*"):
                    with contextlib.suppress(RuntimeError):
                        cluster.cmd("scontrol", "update", f"NodeName={node}", "State=RESUME")
        time.sleep(0.5)
    print(f"bench: slurm nodes not idle again: {cluster.node_states()}", flush=True)


# -- ray --------------------------------------------------------------------------------------------


def ray_run(root: Path) -> Bench:
    from tests.e2e.test_ray_run import RayRun

    class RayBench(RayRun):
        def lose_node(self, node: str) -> None:
            self.lose_ray_node(node)  # the worker's raylet SIGKILLed

    return RayBench(root, spec("raybench"))


# -- one round --------------------------------------------------------------------------------------


def one_round(
    backend: str, faults: list[str], timeout_s: float, slurm: Any, tmp: Path
) -> tuple[list[tuple[str, dict[str, float] | None]], dict[str, Any] | None, str]:
    """One cluster, one round of `faults`; returns per-fault phases (None: not recovered), the
    time-limit stop (Slurm) and a note when the round broke off."""
    root = tmp / f"{backend}-{time.time_ns()}"
    run: Bench
    slurm_run: SlurmRun | None = None
    if backend == "agents":
        run = AgentsRun(root, spec("agentsbench"))
    elif backend == "slurm":
        run = slurm_run = SlurmRun(root, slurm)
    else:
        run = ray_run(root)
    injections: list[Injection] = []
    stop: dict[str, Any] | None = None
    note = ""
    try:
        started = time.monotonic()
        run.start()
        if run.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 180) is None:
            return [], None, "the run did not start within 180 s"
        print(f"  [{backend}] first step {time.monotonic() - started:.1f} s after start", flush=True)
        time.sleep(1)
        for fault in faults:
            nodes = current_nodes(run)
            mark = last_seq(run)
            at = time.time()
            if fault == "node-lost":
                victim = nodes[1 % len(nodes)]
                run.lose_node(victim)
            else:
                victim = inject(run, fault, nodes)
            ok = run.wait_for_event(E.EVENT_KIND_FIRST_STEP, mark, timeout_s) is not None
            injections.append(Injection(fault=fault, node=victim, at=at, after_seq=mark, recovered=ok))
            print(f"  [{backend}] {fault}: {'recovered' if ok else 'NOT recovered'}", flush=True)
            if not ok:
                note = f"no first step within {timeout_s:.0f} s after {fault}"
                break
            time.sleep(1.5)
        if slurm_run is not None and not note:
            stop = time_limit_stop(slurm_run, timeout_s)
    finally:
        events = run.events() if run.event_log.exists() else []
        run.stop()
    ends = [i.after_seq for i in injections[1:]] + [10**12]
    return (
        [
            (i.fault, phases(events, i, end) if i.recovered else None)
            for i, end in zip(injections, ends, strict=True)
        ],
        stop,
        note,
    )


def time_limit_stop(run: SlurmRun, timeout_s: float) -> dict[str, Any] | None:
    mark = last_seq(run)
    at = time.time()
    jobs = run.time_limit()
    print(f"  [slurm] scancel --signal=USR1 {' '.join(jobs)}", flush=True)

    def planned_exit(e: LogEntry) -> bool:
        return e.exit.classification == "planned_stop"

    end = run.wait_for_event(E.EVENT_KIND_EXIT, mark, timeout_s, pred=planned_exit)
    if end is None:
        print("  [slurm] time limit: no planned-stop exit", flush=True)
        return None
    window = [e for e in run.events() if mark < e.seq <= end.seq]
    req = next((e for e in window if e.kind == E.EVENT_KIND_STOP_REQUEST), None)
    commits = [e for e in window if e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT and req and e.seq > req.seq]
    before = [e.step for e in run.events() if e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT and e.seq <= end.seq]
    out: dict[str, Any] = {"stop_request": (req.ts - at) if req else float("nan"), "exit": end.ts - at}
    # The stop's own commit: one after the stop request and before the attempt's exit (none when
    # the ranks did not save, e.g. killed by the signal themselves).
    out["commit"] = (commits[-1].ts - at) if commits else float("nan")
    out["committed_step"] = max(before, default=-1)
    out["exit_message"] = end.message
    print(
        f"  [slurm] time limit: stop request {out['stop_request']:.2f} s, stop's commit {out['commit']:.2f} s, "
        f"planned exit {out['exit']:.2f} s ({end.message})",
        flush=True,
    )
    return out


# -- the whole bench --------------------------------------------------------------------------------


def slurm_cluster() -> Any:
    from tests.backends.slurm_cluster import SlurmCluster, missing_binaries

    missing = missing_binaries()
    if missing or os.geteuid() != 0:
        raise RuntimeError(f"no Slurm here: missing {missing}, euid {os.geteuid()}")
    root = Path(tempfile.mkdtemp(prefix="rwslurm-", dir="/tmp"))  # slurmd's sockets: a short path
    cluster = SlurmCluster(root, nodes=4)
    try:
        cluster.up()
    except BaseException:
        cluster.down()
        shutil.rmtree(root, ignore_errors=True)
        raise
    return cluster


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--faults", default="crash,hang,straggler,xid,node-lost")
    p.add_argument("--trials", type=int, default=5, help="trials per backend and fault kind")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds to the first new step")
    p.add_argument("--budget-s", type=float, default=0.0, help="start no round after this (0: none)")
    p.add_argument("--out", type=Path)
    p.add_argument("--keep", type=Path, help="keep each cluster's directory (event log, logs) under this")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the --out JSON of a cut-off run (same backends and faults) up to --trials",
    )
    p.add_argument(
        "--markdown", type=Path, help="print the tables of a results JSON as Markdown; run nothing"
    )
    args = p.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    backends = [b for b in args.backends.split(",") if b]
    faults = [f for f in args.faults.split(",") if f]
    bad = [b for b in backends if b not in BACKENDS] + [f for f in faults if f not in FAULTS]
    if bad:
        p.error(f"unknown {bad}")
    if "node-lost" in faults:  # it takes a node for good: last in the round
        faults = [f for f in faults if f != "node-lost"] + ["node-lost"]
    result: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "trials_asked": args.trials,
        "faults": faults,
        "backends": {
            b: {"samples": {f: [] for f in faults}, "unrecovered": dict.fromkeys(faults, 0)} for b in backends
        },
        "notes": {b: [] for b in backends},
        "time_limit": [],
        "rounds": [],
    }
    t0 = time.time()
    if args.resume and args.out and args.out.exists():
        before = json.loads(args.out.read_text())
        if before["faults"] != faults or set(before["backends"]) != set(backends):
            p.error(f"--resume: {args.out} measured {sorted(before['backends'])} x {before['faults']}")
        before.setdefault("continued_by", []).append(result["command"])
        before["trials_asked"] = args.trials
        for notes in before["notes"].values():  # the cut-off is undone by continuing
            notes[:] = [n for n in notes if not n.startswith("cut off by")]
        t0 -= before.get("wall_s", 0.0)
        result = before
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as tmpdir, contextlib.ExitStack() as stack:
        tmp = args.keep.resolve() if args.keep else Path(tmpdir)
        tmp.mkdir(parents=True, exist_ok=True)
        slurm = None
        if "slurm" in backends:
            try:
                slurm = slurm_cluster()
                stack.callback(shutil.rmtree, slurm.root, ignore_errors=True)  # after down (LIFO)
                stack.callback(slurm.down)
            except Exception as e:  # recorded: the backend could not be measured
                result["notes"]["slurm"].append(f"not measured: {e}")
                backends.remove("slurm")
        if "ray" in backends:
            try:
                import ray  # noqa: F401
            except ImportError as e:
                result["notes"]["ray"].append(f"not measured: {e}")
                backends.remove("ray")

        def done(b: str) -> bool:
            r = result["backends"][b]
            return all(len(r["samples"][f]) + r["unrecovered"][f] >= args.trials for f in faults)

        while not all(done(b) for b in backends):
            for b in backends:
                if done(b):
                    continue
                if args.budget_s and time.time() - t0 > args.budget_s:
                    for left in (x for x in backends if not done(x)):
                        result["notes"][left].append(f"cut off by --budget-s {args.budget_s:.0f}")
                    write(result, t0, args.out)
                    return summarise(result, args.out, t0)
                print(f"\n=== {b}: round (elapsed {time.time() - t0:.0f} s) ===", flush=True)
                load, began = os.getloadavg()[0], time.time()
                rows, stop, note = one_round(b, faults, args.timeout, slurm, tmp)
                result["rounds"].append(
                    {
                        "backend": b,
                        "wall_s": time.time() - began,
                        "load_avg_1m_start": load,
                        "load_avg_1m_end": os.getloadavg()[0],
                        "recovered": [f for f, ph in rows if ph is not None],
                        "note": note,
                    }
                )
                for fault, ph in rows:
                    if ph is None:
                        result["backends"][b]["unrecovered"][fault] += 1
                    else:
                        result["backends"][b]["samples"][fault].append(ph)
                if stop is not None:
                    result["time_limit"].append(stop)
                if note:
                    result["notes"][b].append(note)
                    if not rows:  # the run did not start: count it against every fault
                        for f in faults:
                            result["backends"][b]["unrecovered"][f] += 1
                write(result, t0, args.out)
    return summarise(result, args.out, t0)


def stats(xs: list[float]) -> dict[str, float] | None:
    xs = [x for x in xs if x == x]
    if not xs:
        return None
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def write(result: dict[str, Any], t0: float, out: Path | None) -> None:
    result["wall_s"] = time.time() - t0
    summary: dict[str, Any] = {}
    for b, r in result["backends"].items():
        summary[b] = {}
        for f, rows in r["samples"].items():
            s = stats([x["time_to_first_step"] for x in rows])
            d = stats([x["time_to_detect"] for x in rows])
            summary[b][f] = {
                "time_to_first_step": s,
                "time_to_detect": d,
                "unrecovered": r["unrecovered"][f],
            }
    for b in summary:
        for f, row in summary[b].items():
            base = summary.get("agents", {}).get(f, {}).get("time_to_first_step")
            mine = row["time_to_first_step"]
            row["ratio_to_agents"] = (mine["median"] / base["median"]) if mine and base else None
    tl = result["time_limit"]
    result["summary"] = summary
    result["time_limit_summary"] = {k: stats([x[k] for x in tl]) for k in ("stop_request", "commit", "exit")}
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))


def summarise(result: dict[str, Any], out: Path | None, t0: float) -> int:
    write(result, t0, out)
    print(
        f"\n{'backend':<8} {'fault':<10} {'n':>2} {'fail':>4} {'detect':>7} {'1st step med':>12} {'min':>6} {'max':>6} {'x agents':>8}"
    )
    for b, rows in result["summary"].items():
        for f, row in rows.items():
            s, d = row["time_to_first_step"], row["time_to_detect"]
            if s is None:
                print(f"{b:<8} {f:<10} {0:>2} {row['unrecovered']:>4}  (no sample)")
                continue
            ratio = f"{row['ratio_to_agents']:.2f}" if row["ratio_to_agents"] else "-"
            print(
                f"{b:<8} {f:<10} {s['n']:>2} {row['unrecovered']:>4} {d['median']:6.2f}s {s['median']:11.2f}s "
                f"{s['min']:5.1f}s {s['max']:5.1f}s {ratio:>8}"
            )
    for k, s in result["time_limit_summary"].items():
        if s:
            print(
                f"slurm time limit -> {k:<12} n={s['n']} median {s['median']:.2f} s ({s['min']:.2f} .. {s['max']:.2f})"
            )
    for b, notes in result["notes"].items():
        for n in notes:
            print(f"note {b}: {n}")
    return 0


def markdown(result: dict[str, Any]) -> str:
    """BENCHMARKS.md's tables from a results JSON."""

    def fmt(s: dict[str, float] | None, digits: int = 1) -> str:
        return f"{s['median']:.{digits}f} s ({s['min']:.{digits}f} .. {s['max']:.{digits}f})" if s else "-"

    lines = [
        "| backend | fault | n | unrecovered | time to detect, median | fault -> first new step, median (min .. max) | x agents |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in result["faults"]:
        for b, rows in result["summary"].items():
            row = rows[f]
            s, d = row["time_to_first_step"], row["time_to_detect"]
            ratio = f"{row['ratio_to_agents']:.2f}" if row["ratio_to_agents"] else "-"
            n = s["n"] if s else 0
            det = f"{d['median']:.2f} s" if d else "-"
            lines.append(f"| {b} | {f} | {n} | {row['unrecovered']} | {det} | {fmt(s)} | {ratio} |")
    tl = result["time_limit_summary"]
    if any(tl.values()):
        lines += [
            "",
            "| slurm time-limit notice (`scancel --signal=USR1 <job>`) -> | n | median (min .. max) |",
            "| --- | --- | --- |",
        ]
        names = {
            "stop_request": "STOP_REQUEST (the first agent's drain seen)",
            "commit": "the stop's CHECKPOINT_COMMIT",
            "exit": "the attempt's planned-stop EXIT (its ranks all gone)",
        }
        for k, s in tl.items():
            lines.append(f"| {names[k]} | {s['n'] if s else 0} | {fmt(s, 2)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
