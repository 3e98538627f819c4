"""etcd at fleet scale (issue 9, benchmark 4): 2,048 node leases + one progress put per node per second.

    .venv/bin/python bench/bench_etcd_scale.py [--nodes 2048] [--procs 4] [--ttl 5] [--seconds 30]

One real etcd (testbed.etcd_server) on 127.0.0.1. Load generators (a few processes, threads
inside, the project's real `runwarden.store.Store`) each hold their share of the node leases,
refreshed every TTL/3 with `Store.refresh_lease` from a few threads (`Store.keep_alive`'s thread
per lease would be 2,048 threads on 2 cores), and write one `NodeProgress` per node per second.
The "controller" in this process does what the live shell does on that path: `Store.watch_prefix`
on the nodes and progress prefixes, decode, translate into core events, and feed a real
`controller.supervisor.machine.Supervisor` (attempt 1 running on every node but the spares) from one loop thread.

Measured: watch lag (agent's `written_at` -> the controller's watch callback) p50/p99; CPU of this
process (the controller side: watch threads + decode + core) as % of one core; node-loss detection
latency for spare nodes whose keepalive is stopped under load (keepalive stop -> DELETE seen);
then raw put throughput of the same etcd with the same clients, and the fraction the progress
writes use. Every loop is bounded in count and time; traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, assert_never

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.supervisor.actions import (
    AllocateFromQueue,
    CollectDumps,
    Launch,
    Page,
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
    Event,
    NodeJoined,
    NodeLost,
    PreflightResult,
    ProgressObserved,
    RankSample,
)
from controller.supervisor.machine import Supervisor
from controller.supervisor.policy import RunPlan, SupervisorConfig
from runwarden.store import Lease, Store, StoreConfig, StoreError, WatchEvent
from runwarden.store import client as store_module
from runwarden.v1 import common_pb2, events_pb2, store_pb2
from testbed.etcd_server import EtcdServer

RUN = "bench"
RANKS_PER_NODE = 8


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))]


def progress_value(node: str, step: int) -> bytes:
    now = time.time()
    ranks = [
        common_pb2.RankProgress(
            rank=r, local_rank=r, step=step, step_time_s=1.0, compute_s=0.8, wait_s=0.2, reported_at=now
        )
        for r in range(RANKS_PER_NODE)
    ]
    return store_pb2.NodeProgress(
        node=node, run=RUN, attempt=1, ranks=ranks, written_at=now
    ).SerializeToString()


# --- load generator process ------------------------------------------------------------------------


def _stream_refreshers(
    store: Store, leases: dict[str, Lease], ttl: float, dead: set[str], lost: set[str], stop: threading.Event
) -> list[threading.Thread]:
    """One persistent LeaseKeepAlive stream for all of this process's leases (what etcd's own
    clients do), over the store's connection; each lease still refreshed every TTL/3."""
    etcdrpc = store_module.etcdrpc  # the request type: runwarden.store stays the only pyetcd importer
    requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
    by_id = {lease.id: name for name, lease in leases.items()}

    def feed() -> Any:
        while True:
            item = requests.get()
            if item is None:
                return
            yield item

    call = store.conn.stub("Lease").LeaseKeepAlive(feed(), metadata=store.conn.metadata())

    def reader() -> None:
        try:
            for reply in call:
                if reply.TTL <= 0 and int(reply.ID) in by_id:
                    lost.add(by_id[int(reply.ID)])
        except Exception:  # cancelled at the end
            return

    def sender() -> None:
        period = ttl / 3.0
        due = time.time()
        while not stop.is_set():
            for name, lease in leases.items():
                if name not in dead and name not in lost:
                    requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease.id))
            due += period
            stop.wait(max(0.0, due - time.time()))
            due = max(due, time.time() - period)
        requests.put(None)
        call.cancel()

    return [threading.Thread(target=reader, daemon=True), threading.Thread(target=sender, daemon=True)]


def loadgen(
    idx: int,
    endpoint: str,
    names: list[str],
    ttl: float,
    threads: int,
    refresh_threads: int,
    keepalive: str,
    inbox: Any,
    outbox: Any,
) -> None:
    store = Store.connect(StoreConfig(endpoints=(endpoint,), timeout_s=5.0))
    keys = store.keys
    # One LeaseKeeper thread per lease (Store.keep_alive) is 2,048 threads here: on 2 shared cores
    # that starves itself and expires leases. A few refresher threads per process call the store's
    # own refresh_lease for their slice, each lease every TTL/3, the keepers' exact cadence.
    leases: dict[str, Lease] = {}
    for name in names:
        lease = store.grant_lease(ttl)
        rec = store_pb2.NodeRecord(node=name, host=name, local_ranks=RANKS_PER_NODE, lease_id=lease.id)
        store.put(keys.node(name), rec.SerializeToString(), lease=lease)
        leases[name] = lease
    lost: set[str] = set()
    stop_refresh = threading.Event()
    dead: set[str] = set()

    def refresher(mine: list[str]) -> None:
        period = ttl / 3.0
        due = time.time()
        while not stop_refresh.is_set():
            for name in mine:
                if name in dead or name in lost:
                    continue
                try:
                    if store.refresh_lease(leases[name], timeout_s=period) <= 0:
                        lost.add(name)
                except StoreError:
                    pass  # retried next period; etcd expires it if this goes on for a TTL
            due += period
            stop_refresh.wait(max(0.0, due - time.time()))
            due = max(due, time.time() - period)

    if keepalive == "stream":
        refreshers = _stream_refreshers(store, leases, ttl, dead, lost, stop_refresh)
    else:
        refreshers = [
            threading.Thread(target=refresher, args=(names[i::refresh_threads],), daemon=True)
            for i in range(refresh_threads)
        ]
    for r in refreshers:
        r.start()
    outbox.put(("ready", idx))
    plan = inbox.get(timeout=600)
    start_at, write_until = plan["start_at"], plan["write_until"]
    kills: dict[str, float] = {n: t for n, t in plan["kills"].items() if n in leases}
    stats: dict[str, Any] = {"puts": 0, "late_rounds": 0, "rounds": 0, "put_ms": []}
    lock = threading.Lock()

    def writer(mine: list[str]) -> None:
        lat: list[float] = []
        puts = late = rounds = 0
        step = 0
        tick = start_at
        while tick < write_until and rounds < 100_000:
            delay = tick - time.time()
            if delay > 0:
                time.sleep(delay)
            step += 1
            for name in mine:
                if name in dead:
                    continue
                t0 = time.perf_counter()
                store.put(keys.progress(RUN, name), progress_value(name, step))
                lat.append(1000 * (time.perf_counter() - t0))
                puts += 1
            rounds += 1
            tick += 1.0
            if time.time() > tick:  # this round overran its second
                late += 1
                tick = max(tick, time.time() - 0.5)
        with lock:
            stats["puts"] += puts
            stats["late_rounds"] += late
            stats["rounds"] += rounds
            stats["put_ms"].extend(lat[:: max(1, len(lat) // 2000)])

    def killer() -> None:
        for name, at in sorted(kills.items(), key=lambda kv: kv[1]):
            delay = at - time.time()
            if delay > 0:
                time.sleep(delay)
            dead.add(name)  # its refreshes stop: the lease expires after TTL
            outbox.put(("killed", name, time.time()))

    workers = [
        threading.Thread(target=writer, args=(names[i::threads],), daemon=True) for i in range(threads)
    ]
    kt = threading.Thread(target=killer, daemon=True)
    for w in workers:
        w.start()
    kt.start()
    for w in workers:
        w.join(timeout=write_until - time.time() + 60)
    kt.join(timeout=60)
    lost_in_window = len(lost)
    # raw put throughput: the same clients, as fast as they go, for a bounded time
    blast_from, blast_until = plan["blast_from"], plan["blast_until"]
    counts = [0] * threads

    def blaster(i: int) -> None:
        value = progress_value(f"blast-{idx}-{i}", 1)
        key = keys.progress("blast", f"g{idx}-t{i}")
        while time.time() < blast_from:
            time.sleep(0.01)
        n = 0
        while time.time() < blast_until and n < 1_000_000:
            store.put(key, value)
            n += 1
        counts[i] = n

    bl = [threading.Thread(target=blaster, args=(i,), daemon=True) for i in range(threads)]
    for b in bl:
        b.start()
    for b in bl:
        b.join(timeout=blast_until - time.time() + 30)
    stop_refresh.set()
    for r in refreshers:
        r.join(timeout=ttl + 5)
    cpu = os.times()
    outbox.put(
        (
            "stats",
            idx,
            {
                **stats,
                "blast_puts": sum(counts),
                "leases_lost": len(lost),
                "leases_lost_by_window_end": lost_in_window,
                "cpu_s": cpu.user + cpu.system,
            },
        )
    )
    store.close()


# --- the controller side ---------------------------------------------------------------------------


class ControllerSide:
    """The live shell's watch path: watch -> decode -> core event -> one loop thread -> Supervisor."""

    def __init__(self, store: Store, nodes: int, spares: int) -> None:
        self.store = store
        self.keys = store.keys
        self.core = Supervisor(
            SupervisorConfig(startup_timeout_s=600.0), RunPlan(run=RUN, nodes=nodes - spares)
        )
        self.events: queue.Queue[Event] = queue.Queue()
        self.lags: list[tuple[float, float]] = []  # (seen at, lag s)
        self.deleted: dict[str, float] = {}
        self.handled = 0
        self.detections: list[str] = []
        self.attempt_nodes: set[str] = set()
        self.launched = threading.Event()
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._loop.start()
        self.watches = [
            self.store.watch_prefix(self.keys.nodes_prefix(), None, self._on_watch),
            self.store.watch_prefix(self.keys.progress_prefix(RUN), None, self._on_watch),
        ]

    def _on_watch(self, item: Any) -> None:
        if not isinstance(item, WatchEvent):
            return
        now = time.time()
        key, deleted = item.key, item.type.name == "DELETE"
        if key.startswith(self.keys.nodes_prefix()):
            node = key[len(self.keys.nodes_prefix()) :]
            if deleted:
                self.deleted[node] = now
                self.events.put(NodeLost(node=node))
            else:
                rec = store_pb2.NodeRecord.FromString(item.value)
                self.events.put(NodeJoined(node=node, local_ranks=max(1, rec.local_ranks)))
            return
        if deleted:
            return
        prog = store_pb2.NodeProgress.FromString(item.value)
        self.lags.append((now, now - prog.written_at))
        self.events.put(
            ProgressObserved(
                node=prog.node,
                attempt=prog.attempt,
                ranks=tuple(RankSample.from_proto(r) for r in prog.ranks),
            )
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ev = self.events.get(timeout=0.2)
            except queue.Empty:
                continue
            self._feed(ev)

    def _feed(self, ev: Event) -> None:
        self.handled += 1
        batch = self.core.handle(ev, time.time())
        for entry in batch.entries:  # no event log here: the detections are what the bench reports
            if entry.kind == events_pb2.EVENT_KIND_DETECTION:
                self.detections.append(entry.message[:160])
        for act in batch.actions:
            match act:
                case RunPreflight():  # agents answer at once: the bench is about etcd
                    for n in act.nodes:
                        self.events.put(PreflightResult(node=n, passed=True))
                case Launch():
                    self.attempt_nodes = {nr.node for nr in act.nodes}
                    self.launched.set()
                case (
                    StopAttempt()
                    | CollectDumps()
                    | Quarantine()
                    | Release()
                    | TakeSpare()
                    | AllocateFromQueue()
                    | Page()
                    | SetTimer()
                    | PersistNode()
                    | PersistMemory()
                ):
                    pass  # not carried out: no workers, no scheduler, no timers (the bench is the watch path)
                case _:
                    assert_never(act)

    def stop(self) -> None:
        for w in self.watches:
            w.cancel()
        self._stop.set()
        self._loop.join(timeout=5)


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2048)
    ap.add_argument("--procs", type=int, default=4, help="load-generator processes")
    ap.add_argument("--threads", type=int, default=16, help="writer threads per load-generator process")
    ap.add_argument(
        "--keepalive",
        choices=["stream", "store"],
        default="stream",
        help="stream: one persistent keepalive stream per process (default); store: "
        "Store.refresh_lease per lease from --refresh-threads threads (a stream per refresh)",
    )
    ap.add_argument(
        "--refresh-threads", type=int, default=4, help="lease refresher threads per process (store mode)"
    )
    ap.add_argument("--ttl", type=float, default=5.0, help="node lease TTL (the agent's default is 5 s)")
    ap.add_argument("--seconds", type=float, default=30.0, help="measured window")
    ap.add_argument("--kills", type=int, default=20, help="spare nodes whose keepalive is stopped under load")
    ap.add_argument("--blast-seconds", type=float, default=5.0)
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "bench_etcd_scale.json")
    )
    args = ap.parse_args()
    if not (1 <= args.procs <= 16 and 1 <= args.threads <= 64 and 0 <= args.kills < args.nodes):
        ap.error("bad --procs/--threads/--kills")
    tmp = tempfile.mkdtemp(prefix="bench-etcd-")
    etcd = EtcdServer(Path(tmp) / "etcd").start()
    out: dict[str, Any] = {"args": vars(args), "load_before": os.getloadavg()}
    ctx = mp.get_context("spawn")
    procs = []
    try:
        names = [f"node{i:05d}" for i in range(args.nodes)]
        store = Store.connect(StoreConfig(endpoints=(etcd.endpoint,), timeout_s=5.0))
        ctl = ControllerSide(store, args.nodes, args.kills)
        ctl.start()
        outbox = ctx.Queue()
        inboxes = [ctx.Queue() for _ in range(args.procs)]
        t_setup = time.time()
        for i in range(args.procs):
            p = ctx.Process(
                target=loadgen,
                args=(
                    i,
                    etcd.endpoint,
                    names[i :: args.procs],
                    args.ttl,
                    args.threads,
                    args.refresh_threads,
                    args.keepalive,
                    inboxes[i],
                    outbox,
                ),
                daemon=True,
            )
            p.start()
            procs.append(p)
        for _ in range(args.procs):
            msg = outbox.get(timeout=600)
            assert msg[0] == "ready", msg
        ctl.launched.wait(timeout=120)
        out["setup_s"] = time.time() - t_setup
        # Kill only nodes outside the running attempt (spares): the attempt keeps running, so the
        # controller's per-progress cost stays that of a live 2,048-node run while losses arrive.
        spares = [n for n in names if n not in ctl.attempt_nodes][: args.kills]
        warm = 5.0
        start_at = time.time() + 2.0
        write_until = start_at + warm + args.seconds
        kill_from = start_at + warm + args.seconds / 3
        kill_span = args.seconds / 3
        kills = {n: kill_from + kill_span * j / max(1, len(spares)) for j, n in enumerate(spares)}
        blast_from = write_until + args.ttl + 3.0
        plan = {
            "start_at": start_at,
            "write_until": write_until,
            "kills": kills,
            "blast_from": blast_from,
            "blast_until": blast_from + args.blast_seconds,
        }
        for q in inboxes:
            q.put(plan)
        time.sleep(max(0.0, start_at + warm - time.time()))
        ru0, w0, e0 = resource.getrusage(resource.RUSAGE_SELF), time.time(), proc_cpu_s(etcd.pid or 0)
        handled0 = ctl.handled
        time.sleep(max(0.0, write_until - time.time()))
        ru1, w1, e1 = resource.getrusage(resource.RUSAGE_SELF), time.time(), proc_cpu_s(etcd.pid or 0)
        handled1 = ctl.handled
        killed: dict[str, float] = {}
        stats: dict[int, dict[str, Any]] = {}
        deadline = time.time() + args.ttl + args.blast_seconds + 120
        while len(stats) < args.procs and time.time() < deadline:
            try:
                msg = outbox.get(timeout=5)
            except queue.Empty:
                continue
            if msg[0] == "killed":
                killed[msg[1]] = msg[2]
            elif msg[0] == "stats":
                stats[msg[1]] = msg[2]
        time.sleep(1.0)
        window = w1 - w0
        lags = [lag for seen, lag in ctl.lags if w0 <= seen <= w1]
        puts_in_window = len(lags)
        detect = [ctl.deleted[n] - t for n, t in killed.items() if n in ctl.deleted]
        missing = [n for n in killed if n not in ctl.deleted]
        blast = sum(s["blast_puts"] for s in stats.values())
        raw_rate = blast / args.blast_seconds
        write_rate = puts_in_window / window
        put_ms = [x for s in stats.values() for x in s["put_ms"]]
        out.update(
            {
                "window_s": window,
                "watched_progress_events": puts_in_window,
                "progress_write_rate_per_s": write_rate,
                "target_rate_per_s": args.nodes,
                "watch_lag_ms": {
                    "p50": 1000 * pct(lags, 50),
                    "p99": 1000 * pct(lags, 99),
                    "max": 1000 * max(lags or [0]),
                },
                "controller_cpu_pct_of_one_core": 100
                * ((ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime))
                / window,
                "core_events_per_s": (handled1 - handled0) / window,
                "core_launched": ctl.launched.is_set(),
                "core_state": ctl.core.state.value,
                "core_detections": ctl.detections[:5],
                "unexpected_deletes": {
                    "before_window": sum(1 for n, t in ctl.deleted.items() if n not in killed and t < w0),
                    "in_window": sum(1 for n, t in ctl.deleted.items() if n not in killed and w0 <= t <= w1),
                    "after_window": sum(1 for n, t in ctl.deleted.items() if n not in killed and t > w1),
                },
                "etcd_cpu_pct_of_one_core": 100 * (e1 - e0) / window,
                "node_loss_detect_s": {
                    "n": len(detect),
                    "p50": pct(detect, 50),
                    "p99": pct(detect, 99),
                    "max": max(detect or [0]),
                    "missing": missing,
                    "goal_s": args.ttl + 1,
                },
                "raw_put_rate_per_s": raw_rate,
                "used_fraction_of_raw": write_rate / raw_rate if raw_rate else None,
                "put_latency_ms": {"p50": pct(put_ms, 50), "p99": pct(put_ms, 99)},
                "late_rounds": sum(s["late_rounds"] for s in stats.values()),
                "rounds": sum(s["rounds"] for s in stats.values()),
                "leases_lost_unexpectedly": sum(s["leases_lost"] for s in stats.values()),
                "leases_lost_by_window_end": sum(s["leases_lost_by_window_end"] for s in stats.values()),
                "loadgen_cpu_s": sum(s["cpu_s"] for s in stats.values()),
                "load_after": os.getloadavg(),
                "cpus": os.cpu_count(),
            }
        )
        ctl.stop()
        store.close()
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        etcd.stop()
    print(json.dumps(out, indent=2, default=str))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
