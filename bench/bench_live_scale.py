"""The live controller at fleet scale (issue 31): the real `controller run` against N light agents.

    PYTHONPATH=. flock /tmp/runwarden-heavy.lock .venv/bin/python bench/bench_live_scale.py \
        --sizes 256,1024,2048 --out bench/results/bench_live_scale.json

One real etcd (testbed.etcd_server) on 127.0.0.1, a fleet of light agents (lightfleet: real NodeAgent
gRPC servers, real leases, 8 ranks a node, no torch) and the real `controller run` at its shipped
policy, in its own process (`--controller-tree` runs another checkout's controller against the same
fleet: the "before" of a shell change). Per size: N active nodes + `--spares`; every preflight takes
`--preflight-s` (uniform); then, once the run has settled, the faults in turn, each after the
previous recovery: a lost host (its lease revoked), a hang (a culprit rank stops; the others' dumps
lag by one collective), a crash; then `--soak-s` of a fault every `--fault-every-s`.

Measured from the controller's own event log (its `ts`, wall clock) and the processes' /proc:
  preflight fan-out      PREFLIGHT_PLAN -> LAUNCH of attempt 1 (every node preflighted once), beside
                         the slowest host's preflight (the fleet's latency bound)
                         and -> the last host's arrival of its RunPreflight (the fleet's stamps)
  launch fan-out         LAUNCH -> WORKERS_STARTED (every node's LaunchWorkers answered), and ->
                         the last host's arrival of its LaunchWorkers
  lost host -> relaunch  the lease revoked (the key gone at once) -> NODE_LOST -> LAUNCH, -> the last
                         host's arrival of its LaunchWorkers, and -> WORKERS_STARTED; and when a
                         watcher of this process saw the key's DELETE (etcd's part vs the controller's)
  hang -> dumps          DETECTION -> ATTRIBUTION (every rank's host asked for dumps, the verdict)
  crash -> relaunch      DETECTION -> WORKERS_STARTED
  controller CPU (% of one core, mean over the soak and over the whole size) and peak RSS; etcd CPU
  and its write rate (revisions per second).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lightfleet import cli  # noqa: E402
from lightfleet.fleet import Fleet  # noqa: E402
from runwarden.eventlog import LogEntry, decode_line  # noqa: E402
from runwarden.store import EventType, Relisted, Store, StoreConfig, WatchEvent  # noqa: E402
from runwarden.v1 import events_pb2 as E  # noqa: E402
from testbed.etcd_server import EtcdServer  # noqa: E402

RUN = "scale"
TICK = os.sysconf("SC_CLK_TCK")


def received(fleet: Fleet, rpc: str, after: float, attempt: int | None = None) -> float | None:
    """When the last host received the fan-out of `rpc` that began at `after` (the event's `ts`):
    the latest arrival, across the fleet's processes, of the first window of arrivals (lightfleet's
    `Receipts`) that begins at or after it (and is of `attempt`, when given)."""
    last = None
    for line in fleet.inject("stats").splitlines():
        if not line.startswith("ok stats "):
            continue
        windows = json.loads(line[len("ok stats ") :]).get("received", {}).get(rpc, [])
        mine = [w for w in windows if w[0] >= after - 0.05 and (attempt is None or w[3] == attempt)]
        if mine:
            first = min(mine, key=lambda w: w[0])
            last = first[1] if last is None else max(last, first[1])
    return last


def since(at: float | None, t0: float) -> float | None:
    return None if at is None else round(at - t0, 2)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (its own, not its children's)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Tail:
    """The event log's new entries since the last read (an offset, not a re-read of the whole file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.buf = b""
        self.entries: list[LogEntry] = []

    def poll(self) -> list[LogEntry]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        new = [decode_line(line) for line in lines if line.strip()]
        self.entries.extend(new)
        return new

    def wait(self, kind: int, after_seq: int, timeout_s: float, pred: Any = None) -> LogEntry:
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            for ev in self.entries:
                if ev.seq > after_seq and ev.kind == kind and (pred is None or pred(ev)):
                    return ev
            if time.monotonic() > deadline:
                last = "\n".join(
                    f"  {e.seq} {E.EventKind.Name(e.kind)} a{e.attempt}: {e.message[:160]}"
                    for e in self.entries[-15:]
                )
                raise TimeoutError(
                    f"no {E.EventKind.Name(kind)} after seq {after_seq} in {timeout_s:g} s; last:\n{last}"
                )
            time.sleep(0.1)

    @property
    def last_seq(self) -> int:
        self.poll()
        return self.entries[-1].seq if self.entries else 0


@dataclass
class Sampler:
    """CPU and RSS of the controller and etcd, and etcd's revision, once a second."""

    controller: int
    etcd: int
    store: Store
    rows: list[dict[str, float]] = field(default_factory=list)

    def sample(self) -> None:
        self.rows.append(
            {
                "t": time.monotonic(),
                "ctl_cpu_s": cpu_s(self.controller),
                "ctl_rss_mib": rss_mib(self.controller),
                "etcd_cpu_s": cpu_s(self.etcd),
                "revision": float(self.store.revision()),
            }
        )

    def window(self, since: float) -> dict[str, float]:
        rows = [r for r in self.rows if r["t"] >= since]
        if len(rows) < 2:
            return {}
        a, b = rows[0], rows[-1]
        dt = b["t"] - a["t"]
        return {
            "seconds": round(dt, 1),
            "controller_cpu_pct": round(100 * (b["ctl_cpu_s"] - a["ctl_cpu_s"]) / dt, 1),
            "controller_rss_peak_mib": round(max(r["ctl_rss_mib"] for r in rows), 1),
            "etcd_cpu_pct": round(100 * (b["etcd_cpu_s"] - a["etcd_cpu_s"]) / dt, 1),
            "etcd_writes_per_s": round((b["revision"] - a["revision"]) / dt, 1),
        }


def sleep_sampling(sampler: Sampler, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sampler.sample()
        time.sleep(min(1.0, max(0.0, end - time.monotonic())))


def controller_config(path: Path, *, etcd: str, nodes: int, run_dir: Path) -> None:
    """The controller's config: the shipped policy; the command is never run (light agents)."""
    text = f"""
[store]
endpoints = ["{etcd}"]

[controller]
run = "{RUN}"
nodes = {nodes}
procs_per_node = 8
command = ["train.py"]
run_dir = "{run_dir}"
api_address = "127.0.0.1:0"
metrics_address = ""
identity = "bench-controller"
"""
    path.write_text(text)


def fleet_args(etcd: str, args: argparse.Namespace) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_common(p)
    return p.parse_args(
        [
            f"--etcd={etcd}",
            "--prefix=light-",
            f"--preflight-s={args.preflight_s}",
            f"--launch-s={args.launch_s}",
            f"--stop-s={args.stop_s}",
            f"--dump-s={args.dump_s}",
            f"--step-s={args.step_s}",
            "--startup-s=1",
        ]
    )


_DUMPS_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*flight-recorder dumps of .* collected in "
    r"([\d.]+) s, analysed in ([\d.]+) s"
)


def dumps_line(log_path: Path, after: float) -> tuple[float, float, float] | None:
    """(when, seconds collecting, seconds analysing) of the first dumps line the controller logged
    after `after` (its log's local-time stamps, this machine's clock)."""
    for line in log_path.read_text(errors="replace").splitlines():
        m = _DUMPS_LINE.match(line)
        if m is None:
            continue
        when = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
        if when >= after - 0.01:
            return when, float(m.group(3)), float(m.group(4))
    return None


def first_step_after(tail: Tail, seq: int, timeout_s: float) -> LogEntry:
    return tail.wait(E.EVENT_KIND_FIRST_STEP, seq, timeout_s)


def one_size(n: int, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"hosts": n, "spares": args.spares, "gpus": 8 * n}
    with tempfile.TemporaryDirectory(prefix="rw-scale-") as tmp:
        root = Path(tmp)
        etcd = EtcdServer(root / "etcd", fast=True).start()
        fleet: Fleet | None = None
        ctl: subprocess.Popen[bytes] | None = None
        store = Store.connect(StoreConfig(endpoints=(etcd.endpoint,)))
        try:
            fleet = Fleet(fleet_args(etcd.endpoint, args), nodes=n + args.spares, procs=args.procs)
            out["fleet_registered_s"] = round(fleet.start(timeout_s=600), 2)
            run_dir = root / "controller"
            run_dir.mkdir()
            cfg = root / "controller.toml"
            controller_config(cfg, etcd=etcd.endpoint, nodes=n, run_dir=run_dir)
            env = dict(os.environ)
            tree = Path(args.controller_tree).resolve() if args.controller_tree else REPO
            env["PYTHONPATH"] = str(tree)
            log = (root / "controller.log").open("ab")
            ctl = subprocess.Popen(
                [sys.executable, "-m", "controller.live.main", "run", "--config", str(cfg)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tree,
                env=env,
                start_new_session=True,
            )
            assert etcd.pid is not None
            sampler = Sampler(controller=ctl.pid, etcd=etcd.pid, store=store)
            tail = Tail(run_dir / "events.jsonl")
            t_all = time.monotonic()
            sampler.sample()
            plan = tail.wait(E.EVENT_KIND_PREFLIGHT_PLAN, 0, 300)
            launch = tail.wait(E.EVENT_KIND_LAUNCH, plan.seq, 600, lambda e: e.attempt == 1)
            started = tail.wait(E.EVENT_KIND_WORKERS_STARTED, launch.seq, 300)
            out["preflight_fan_out_s"] = round(launch.ts - plan.ts, 2)
            out["slowest_preflight_s"] = float(args.preflight_s.split(":")[-1])
            out["preflight_received_by_all_s"] = since(received(fleet, "RunPreflight", plan.ts), plan.ts)
            out["launch_fan_out_s"] = round(started.ts - launch.ts, 2)
            out["launch_received_by_all_s"] = since(received(fleet, "LaunchWorkers", launch.ts, 1), launch.ts)
            first = first_step_after(tail, started.seq, 300)
            out["first_step_after_launch_s"] = round(first.ts - launch.ts, 2)
            sleep_sampling(sampler, args.settle_s)

            nodes = list(launch.launch.nodes)
            # a lost host: its lease revoked, so its key is gone now (the lease TTL is not measured)
            victim = nodes[len(nodes) // 2]
            # an independent watch on the victim's key, in this process: when etcd's DELETE reached a
            # watcher, which splits revoke -> NODE_LOST into the fleet's and etcd's part and the
            # controller's (its watch, its translation and its core up to the logged event)
            victim_key = store.keys.node(victim)
            deleted: list[float] = []
            saw_delete = threading.Event()

            def seen(change: WatchEvent | Relisted) -> None:
                if (
                    isinstance(change, WatchEvent)
                    and change.key == victim_key
                    and change.type is EventType.DELETE
                ):
                    deleted.append(time.time())
                    saw_delete.set()

            watch = store.watch_prefix(victim_key, None, seen)
            seq = tail.last_seq
            t_fault = time.time()
            fleet.inject(f"lease-loss {victim} revoke")
            t_answered = time.time()  # the fleet answers once its process has revoked the lease
            lost = tail.wait(E.EVENT_KIND_NODE_LOST, seq, 60, lambda e: victim in e.message)
            saw_delete.wait(10)  # this watcher may see the DELETE after the controller logged it
            watch.cancel()
            deleted_at = deleted[0] if deleted else None
            relaunch = tail.wait(E.EVENT_KIND_LAUNCH, lost.seq, 120)
            started = tail.wait(E.EVENT_KIND_WORKERS_STARTED, relaunch.seq, 120)
            reached = received(fleet, "LaunchWorkers", relaunch.ts, relaunch.attempt)
            out["lost_host"] = {
                "revoked_to_node_lost_s": round(lost.ts - t_fault, 2),
                "revoke_answered_s": round(t_answered - t_fault, 2),
                "revoked_to_key_deleted_s": since(deleted_at, t_fault),
                "key_deleted_to_node_lost_s": None if deleted_at is None else since(lost.ts, deleted_at),
                "node_lost_to_launch_s": round(relaunch.ts - lost.ts, 2),
                # the launch RPC at every host (the agents' own arrival stamps)
                "node_lost_to_launch_received_by_all_s": since(reached, lost.ts),
                "revoked_to_launch_received_by_all_s": since(reached, t_fault),
                # the goal's clock: from the lease's end (its key gone), not from the fleet being asked
                "key_deleted_to_launch_received_by_all_s": None
                if deleted_at is None
                else since(reached, deleted_at),
                "node_lost_to_all_launched_s": round(started.ts - lost.ts, 2),
            }
            first_step_after(tail, started.seq, 300)
            sleep_sampling(sampler, args.settle_s)

            # a hang: the culprit's node is blamed from the dumps
            culprit = nodes[len(nodes) // 3]
            seq = tail.last_seq
            fleet.inject(f"hang {culprit} culprit-rank 5")
            det = tail.wait(E.EVENT_KIND_DETECTION, seq, 120)
            attr = tail.wait(E.EVENT_KIND_ATTRIBUTION, det.seq, 120)
            relaunch = tail.wait(E.EVENT_KIND_LAUNCH, attr.seq, 120)
            started = tail.wait(E.EVENT_KIND_WORKERS_STARTED, relaunch.seq, 120)
            dumps = dumps_line(root / "controller.log", det.ts)
            out["hang"] = {
                # DETECTION -> the controller's log line "dumps ... collected in X s, analysed in Y s"
                "detection_to_dumps_analysed_s": None if dumps is None else round(dumps[0] - det.ts, 2),
                "dumps_collected_s": None if dumps is None else dumps[1],
                "dumps_analysed_s": None if dumps is None else dumps[2],
                "detection_to_attribution_s": round(attr.ts - det.ts, 2),
                "blamed": culprit in attr.message,
                "attribution": attr.message[:200],
                "detection_to_all_launched_s": round(started.ts - det.ts, 2),
            }
            first_step_after(tail, started.seq, 300)
            sleep_sampling(sampler, args.settle_s)

            # a crash
            nodes = list(relaunch.launch.nodes)
            seq = tail.last_seq
            fleet.inject(f"crash {nodes[1]}")
            det = tail.wait(E.EVENT_KIND_DETECTION, seq, 60)
            relaunch = tail.wait(E.EVENT_KIND_LAUNCH, det.seq, 120)
            started = tail.wait(E.EVENT_KIND_WORKERS_STARTED, relaunch.seq, 120)
            out["crash"] = {
                "detection_to_launch_s": round(relaunch.ts - det.ts, 2),
                "detection_to_all_launched_s": round(started.ts - det.ts, 2),
            }
            first_step_after(tail, started.seq, 300)

            # the soak: a fault every fault_every_s, round robin over crash / hang / lost host
            t_soak = time.monotonic()
            kinds = ["crash", "hang", "lease-loss"]
            i = 0
            while time.monotonic() - t_soak < args.soak_s:
                sleep_sampling(sampler, args.fault_every_s)
                tail.poll()  # the soak waits on no event: read the log's new entries here
                launches = [e for e in tail.entries if e.kind == E.EVENT_KIND_LAUNCH]
                cur_nodes = list(launches[-1].launch.nodes) if launches else nodes
                target = cur_nodes[(7 * i + 3) % len(cur_nodes)]
                line = {
                    "crash": f"crash {target}",
                    "hang": f"hang {target} culprit-rank 2",
                    "lease-loss": f"lease-loss {target} revoke return 20",
                }[kinds[i % 3]]
                fleet.inject(line)
                i += 1
            sampler.sample()
            out["soak"] = {"faults": i, **sampler.window(t_soak)}
            out["whole"] = sampler.window(t_all)
            tail.poll()
            ev = tail.entries
            out["events"] = len(ev)
            out["restarts"] = sum(1 for e in ev if e.kind == E.EVENT_KIND_LAUNCH)
            out["quarantines"] = sum(1 for e in ev if e.kind == E.EVENT_KIND_QUARANTINE)
            # the shipped restart budget (20 a day) ends a run faulted every 30 s after 20 restarts
            out["run_end"] = next((e.message for e in ev if e.kind == E.EVENT_KIND_RUN_END), "")
            out["fleet"] = fleet.describe()
        finally:
            if ctl is not None and ctl.poll() is None:
                ctl.terminate()
                try:
                    ctl.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    ctl.kill()
            if fleet is not None:
                fleet.stop()
            store.close()
            etcd.stop()
            etcd.discard()
            if args.keep_logs:
                keep = Path(args.keep_logs) / f"{n}"
                keep.mkdir(parents=True, exist_ok=True)
                for name in ("controller.log", "controller/events.jsonl"):
                    src = root / name
                    if src.exists():
                        (keep / Path(name).name).write_bytes(src.read_bytes())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256,1024,2048")
    p.add_argument("--spares", type=int, default=16)
    p.add_argument("--procs", type=int, default=4, help="light-agent processes")
    p.add_argument("--preflight-s", default="5:10")
    p.add_argument("--launch-s", default="0.05:0.3")
    p.add_argument("--stop-s", default="0.3")
    p.add_argument("--dump-s", default="0.05:0.5")
    p.add_argument("--step-s", type=float, default=1.0)
    p.add_argument("--settle-s", type=float, default=10.0)
    p.add_argument("--soak-s", type=float, default=120.0)
    p.add_argument("--fault-every-s", type=float, default=30.0)
    p.add_argument("--controller-tree", default="", help="run this checkout's controller (default: this one)")
    p.add_argument("--label", default="")
    p.add_argument("--keep-logs", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    results = []
    for n in (int(s) for s in args.sizes.split(",")):
        load = os.getloadavg()
        t0 = time.time()
        row = {"label": args.label, "load_before": [round(x, 2) for x in load], **one_size(n, args)}
        row["wall_s"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)
        results.append(row)
        if args.out:
            Path(args.out).write_text(
                json.dumps(
                    {
                        "machine": platform.node(),
                        "cpus": os.cpu_count(),
                        "args": vars(args),
                        "results": results,
                    },
                    indent=1,
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
