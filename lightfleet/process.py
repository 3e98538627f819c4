"""One OS process hosting many light agents: one asyncio loop, a grpc.aio server per agent, one store.

The loop runs every agent's RPCs and a ticker (every TICK_S: each agent's due progress writes and
node-record puts, none while an earlier write of the same agent is in flight, so an older value never
lands after a newer one). etcd calls are the project's synchronous `runwarden.store.Store`, run in a
small thread pool; the leases are kept alive by one `LeaseStream`. A lost lease is handled as the
real agent's liveness does: the running attempt is fenced (its exit written) and the node registers
again under a new lease, revoking the old one first. Each run an agent launches is followed as the
real agent follows it: one watch per process on the run's stop key (a planned stop written in etcd
reaches the ranks even without a RequestStop) and one on its policy record (the agents' progress
interval).

`python -m lightfleet.process` is one such process (lightfleet.fleet starts them); it prints `ready
...` once every agent is registered, then answers each control line on stdin (lightfleet.faults,
and `stats`) with `ok LINE -> what happened` or `error LINE: why`, and exits at EOF or on SIGTERM.
`Hosted` runs one in a thread of the caller's process (tests, embedding).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from lightfleet import cli
from lightfleet.agent import LightAgent, PreflightFaults
from lightfleet.faults import STAMPED, Fault, FaultError, parse
from lightfleet.leases import LeaseStream
from lightfleet.server import make_server
from lightfleet.settings import AgentSettings
from runwarden import run_policy
from runwarden.store import Lease, Store, StoreConfig, StoreError
from runwarden.v1 import common_pb2, store_pb2

log = logging.getLogger(__name__)
TICK_S = 0.1  # how often due writes are looked for (an exit waits at most this, or nothing: see flush)
T = TypeVar("T")


class Receipts:
    """When this process's agents received each kind of RPC, as windows of arrivals: a window is
    (first, last, count, attempt), a new one begins after GAP_S without one, or for another
    attempt; the newest WINDOWS of each kind are kept. `stats` reports them, so a benchmark
    can tell when a controller's fan-out reached its last host (wall-clock times, one machine)."""

    GAP_S = 1.0
    WINDOWS = 32

    def __init__(self) -> None:
        self.windows: dict[str, list[list[float]]] = {}

    def add(self, rpc: str, at: float, attempt: int = 0) -> None:
        kept = self.windows.setdefault(rpc, [])
        cur = kept[-1] if kept else None
        if cur is not None and cur[3] == attempt and at - cur[1] <= self.GAP_S:
            cur[1] = max(cur[1], at)
            cur[2] += 1
            return
        kept.append([at, at, 1, attempt])
        del kept[: -self.WINDOWS]

    def as_dict(self) -> dict[str, list[list[float]]]:
        return {rpc: [list(w) for w in kept] for rpc, kept in self.windows.items()}


class LightProcess:
    def __init__(
        self,
        store_config: StoreConfig,
        nodes: Sequence[tuple[str, int]],
        settings: AgentSettings,
        *,
        host: str = "127.0.0.1",
        io_threads: int = 8,
        revoke_on_close: bool = True,
    ) -> None:
        self.store_config = store_config
        self.settings = settings
        self.revoke_on_close = revoke_on_close
        pid = os.getpid()
        self.agents: dict[str, LightAgent] = {
            name: LightAgent(name, port=port, settings=settings, host=host, pid=pid) for name, port in nodes
        }
        self.io_threads = io_threads
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="etcd")
        self.store: Store | None = None
        self.leases: LeaseStream | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.servers: list[grpc.aio.Server] = []
        self.counts: dict[str, int] = {}
        self.receipts = Receipts()
        self.registered_in_s = 0.0
        self._by_lease: dict[int, LightAgent] = {}
        self._progress_busy: set[str] = set()
        self._record_busy: set[str] = set()
        self._followed: set[str] = set()
        self._watches: list[Any] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._ticker: asyncio.Task[None] | None = None

    # --- plumbing --------------------------------------------------------------------------------

    @property
    def keys(self) -> Any:
        assert self.store is not None
        return self.store.keys

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        """A blocking store call, off the loop."""
        assert self.loop is not None
        return await self.loop.run_in_executor(self.pool, fn, *args)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._tasks.discard)

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def received(self, rpc: str, attempt: int = 0) -> None:
        self.receipts.add(rpc, time.time(), attempt)

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> float:
        """Serve every agent, register every one under its own lease; returns the seconds it took."""
        started = time.monotonic()
        self.loop = asyncio.get_running_loop()
        self.store = await self._io(Store.connect, self.store_config)
        self.leases = LeaseStream(self.store, self._lost_from_thread)
        self.leases.start()
        for agent in self.agents.values():
            try:
                server, port = make_server(agent, self)
            except RuntimeError as exc:
                raise OSError(f"node {agent.node}: cannot listen on {agent.address}: {exc}") from None
            agent.port = port
            await server.start()
            self.servers.append(server)
        limit = asyncio.Semaphore(self.io_threads * 2)

        async def register(agent: LightAgent) -> None:
            async with limit:
                await self._register(agent)

        await asyncio.gather(*(register(a) for a in self.agents.values()))
        self._ticker = asyncio.ensure_future(self._tick())
        self.registered_in_s = time.monotonic() - started
        return self.registered_in_s

    async def close(self) -> None:
        """Stop serving; revoke the leases (the node records go at once), close the store."""
        self._closing = True
        if self._ticker is not None:
            self._ticker.cancel()
        await asyncio.gather(*(s.stop(0) for s in self.servers), return_exceptions=True)
        if self.leases is not None:
            self.leases.stop()
        for watch in self._watches:
            watch.cancel()
        if self.store is not None and self.revoke_on_close:
            held = [a.lease.lease_id for a in self.agents.values() if a.lease_held]
            await asyncio.gather(*(self._io(self._revoke_quietly, lease) for lease in held))
        for task in list(self._tasks):
            task.cancel()
        if self.store is not None:
            self.store.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _revoke_quietly(self, lease_id: int) -> None:
        assert self.store is not None
        try:
            self.store.revoke(lease_id)
        except StoreError as exc:
            log.warning("revoking lease %x failed (it expires by itself): %s", lease_id, exc)

    # --- registration ------------------------------------------------------------------------------

    async def _register(self, agent: LightAgent, *, revoke: int = 0) -> None:
        """Grant a lease, put the node record under it, keep it alive (liveness.Registration._register);
        retried with backoff while etcd refuses."""
        assert self.store is not None and self.leases is not None
        delay = 0.1
        while not self._closing:
            lease: Lease | None = None
            try:
                if revoke:
                    await self._io(self._revoke_quietly, revoke)
                    revoke = 0
                lease = await self._io(self.store.grant_lease, self.settings.lease_ttl_s)
                agent.registered(lease.id, float(lease.ttl_s), time.time(), time.monotonic())
                record = agent.node_record()
                record.registered_at = agent.lease.registered_at
                await self._io(self.store.put, self.keys.node(agent.node), record.SerializeToString(), lease)
            except StoreError as exc:
                log.warning("node %s: registration failed (retry in %.1f s): %s", agent.node, delay, exc)
                if lease is not None:
                    agent.lease.lease_id = 0
                    revoke = lease.id
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.lease_ttl_s / 3)
                continue
            self._by_lease[lease.id] = agent
            self.leases.add(lease)
            agent.record_dirty = False
            self._count("registrations")
            return

    def _lost_from_thread(self, lease_id: int, reason: str) -> None:
        if self.loop is not None and not self._closing:
            self.loop.call_soon_threadsafe(self._lease_lost, lease_id, reason)

    def _lease_lost(self, lease_id: int, reason: str) -> None:
        agent = self._by_lease.pop(lease_id, None)
        if agent is None or agent.dark or agent.lease.lease_id != lease_id:
            return
        log.warning(
            "node %s lost its lease %x (%s): fencing, then registering again", agent.node, lease_id, reason
        )
        self._count("leases_lost")
        agent.lease_lost(time.time())
        self.flush(agent)  # the fenced attempt's exit
        self._spawn(self._register(agent, revoke=lease_id))

    def confirmed_at(self, agent: LightAgent) -> float | None:
        return self.leases.confirmed_at(agent.lease.lease_id) if self.leases is not None else None

    # --- writes --------------------------------------------------------------------------------

    async def _tick(self) -> None:
        while not self._closing:
            now = time.time()
            for agent in self.agents.values():
                self.flush(agent, now)
            await asyncio.sleep(TICK_S)

    def flush(self, agent: LightAgent, now: float | None = None) -> None:
        """Start the agent's due writes now: its progress (one put per run) and its node record."""
        if agent.dark or self._closing or self.store is None:
            return
        now = time.time() if now is None else now
        if agent.node not in self._progress_busy and agent.attempts:
            messages = agent.progress_due(now)
            if messages:
                self._progress_busy.add(agent.node)
                self._spawn(self._write_progress(agent, messages))
        if agent.record_dirty and agent.lease_held and agent.node not in self._record_busy:
            agent.record_dirty = False
            self._record_busy.add(agent.node)
            self._spawn(self._put_record(agent))

    async def _write_progress(self, agent: LightAgent, messages: list[store_pb2.NodeProgress]) -> None:
        assert self.store is not None
        try:
            for m in messages:
                try:
                    await self._io(
                        self.store.put, self.keys.progress(m.run, agent.node), m.SerializeToString()
                    )
                    self._count("progress_puts")
                except StoreError as exc:
                    log.warning("node %s: progress write failed (again next interval): %s", agent.node, exc)
                    self._count("progress_failures")
                    agent.progress_failed(m)
        finally:
            self._progress_busy.discard(agent.node)

    async def _put_record(self, agent: LightAgent) -> None:
        """The node record again under the current lease (liveness.Registration.update)."""
        assert self.store is not None
        try:
            lease_id = agent.lease.lease_id
            if lease_id and not agent.dark:
                record = agent.node_record()
                await self._io(
                    self.store.put, self.keys.node(agent.node), record.SerializeToString(), lease_id
                )
                self._count("record_puts")
        except StoreError as exc:
            log.warning("node %s: node record update failed: %s", agent.node, exc)
            agent.record_dirty = True
        finally:
            self._record_busy.discard(agent.node)

    def publish(self, agent: LightAgent, evidence: common_pb2.Evidence) -> None:
        """One evidence record at keys.evidence(node, seq), retried as the real publisher does."""
        key = self.keys.evidence(agent.node, agent.evidence_seq)
        value = store_pb2.EvidenceRecord(evidence=evidence).SerializeToString()

        async def put() -> None:
            assert self.store is not None
            delay = 0.1
            while not self._closing:
                try:
                    await self._io(self.store.put, key, value)
                    self._count("evidence_puts")
                    return
                except StoreError as exc:
                    log.warning("evidence of %s not written yet: %s", agent.node, exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)

        self._spawn(put())

    # --- what a run's agents read ---------------------------------------------------------------

    async def attempt_record(self, run: str) -> store_pb2.AttemptRecord | None:
        """The run's attempt record (its launched_at starts the step clock every node shares)."""
        assert self.store is not None
        try:
            kv = await self._io(self.store.get, self.keys.attempt(run))
            return None if kv is None else store_pb2.AttemptRecord.FromString(kv.value)
        except (StoreError, DecodeError) as exc:
            log.warning("run %s: attempt record unreadable (this node's own clock): %s", run, exc)
            return None

    def follow(self, run: str) -> None:
        """Watch the run's stop key and policy record (once per process), as Agent.follow_run does."""
        if run in self._followed or self.store is None:
            return
        self._followed.add(run)
        self._spawn(self._watch(run, self.keys.stop(run), self._apply_stop))
        self._spawn(self._watch(run, self.keys.policy(run), self._apply_policy))

    async def _watch(self, run: str, key: str, apply: Callable[[str, bytes | None], None]) -> None:
        assert self.store is not None and self.loop is not None
        store, loop = self.store, self.loop
        delay = 0.2
        while not self._closing:
            try:
                kvs, revision = await self._io(store.get_prefix, key)
                apply(run, kvs[0].value if kvs else None)

                def on_event(event: Any) -> None:
                    kvs = getattr(event, "kvs", None)
                    if kvs is not None:  # relisted after a compaction: the key as it is now
                        value = kvs[0].value if kvs else None
                    else:
                        value = event.value if event.type.value == "PUT" else None
                    loop.call_soon_threadsafe(apply, run, value)

                self._watches.append(await self._io(store.watch_prefix, key, revision + 1, on_event))
                return
            except StoreError as exc:
                log.warning("cannot watch %s yet (retrying): %s", key, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _apply_stop(self, run: str, value: bytes | None) -> None:
        request: store_pb2.StopRequest | None = None
        if value is not None:
            try:
                request = store_pb2.StopRequest.FromString(value)
            except DecodeError:
                request = store_pb2.StopRequest(reason="stop requested (unreadable stop record)")
        now = time.time()
        for agent in self.agents.values():
            if not agent.dark and run in agent.attempts:
                agent.stop_key(run, request, now)
                self.flush(agent, now)

    def _apply_policy(self, run: str, value: bytes | None) -> None:
        try:
            policy = run_policy.AgentPolicy() if value is None else run_policy.AgentPolicy.parse(value)
        except ValueError as exc:
            log.warning("run %s: policy record refused, keeping the last one: %s", run, exc)
            return
        for agent in self.agents.values():
            agent.progress_interval[run] = policy.progress_interval_s

    # --- faults ----------------------------------------------------------------------------------

    async def apply(self, fault: Fault) -> str:
        """Inject one fault (FaultError when it cannot apply here); returns what happened."""
        fault = fault.stamped(time.time()) if fault.kind in STAMPED else fault
        now = fault.at if fault.at is not None else time.time()
        if fault.kind == "hang":
            return self._hang(fault)
        if fault.kind == "stall":
            return self._stall(fault.node, now)
        agent = self.agents.get(fault.node)
        if agent is None:
            raise FaultError(f"node {fault.node} is not hosted by this process")
        if agent.dark and fault.kind != "clear":
            raise FaultError(f"node {fault.node} is dark (lease-loss)")
        if fault.kind == "crash":
            code = fault.exit_code if fault.exit_code is not None or fault.signal is not None else 1
            ended = agent.crash(now, code=code, signal=fault.signal)
            if not ended:
                raise FaultError(f"node {fault.node} runs no attempt")
            self.flush(agent, now)
            self._stall(fault.node, now)  # its peers here wait for ranks that are gone
            exits = ", ".join(
                f"{a.run} attempt {a.attempt} at step {a.end_step}: {a.exit.detail if a.exit else ''}"
                for a in ended
            )
            return f"crashed local rank {fault.rank}: {exits}"
        if fault.kind == "lease-loss":
            lease_id = agent.lease.lease_id
            agent.go_dark(now)
            self._stall(fault.node, now)
            self._by_lease.pop(lease_id, None)
            if self.leases is not None:
                self.leases.discard(lease_id)
            if fault.revoke:
                await self._io(self._revoke_quietly, lease_id)
            if fault.return_after_s is not None:
                assert self.loop is not None
                self.loop.call_later(fault.return_after_s, lambda: self._spawn(self._come_back(agent)))
            how = (
                "revoked"
                if fault.revoke
                else f"no longer kept alive (expires within {self.settings.lease_ttl_s:g} s)"
            )
            back = f"; back in {fault.return_after_s:g} s" if fault.return_after_s is not None else ""
            return f"dark: lease {lease_id:x} {how}{back}"
        if fault.kind == "xid":
            evidence = agent.xid(fault.xid, fault.gpu, now)
            self.publish(agent, evidence)
            self.flush(agent, now)
            return f"evidence {agent.evidence_seq}: {evidence.detail}"
        if fault.kind == "slow-preflight":
            agent.faults.slow, agent.faults.slow_times = fault.latency, fault.times
            return f"preflights take {fault.latency} s ({'every one' if fault.times < 0 else fault.times})"
        if fault.kind == "fail-preflight":
            agent.faults.fail_check, agent.faults.fail_times = fault.check, fault.times
            return f"preflights fail {fault.check} ({'every one' if fault.times < 0 else fault.times})"
        if fault.kind == "drain":
            agent.drain(fault.reason or "drain requested on the lightfleet control channel")
        elif fault.kind == "undrain":
            agent.undrain()
        elif fault.kind == "clear":
            agent.faults = PreflightFaults()
        self.flush(agent, now)
        return f"{fault.kind} done"

    def _hang(self, fault: Fault) -> str:
        assert fault.at is not None
        owner = self.agents.get(fault.node)
        if owner is not None:
            if owner.dark:
                raise FaultError(f"node {fault.node} is dark (lease-loss)")
            if fault.rank >= owner.settings.local_ranks:
                raise FaultError(
                    f"culprit-rank {fault.rank}: node {fault.node} has {owner.settings.local_ranks} ranks"
                )
            if not owner.running():
                raise FaultError(f"node {fault.node} runs no attempt")
        frozen = []
        for agent in self.agents.values():
            frozen += [
                (agent.node, a)
                for a in agent.hang(fault.node, culprit=fault.rank, at=fault.at, stopped=fault.stopped)
            ]
        steps = sorted({a.frozen_at for _, a in frozen if a.frozen_at is not None})
        return f"{len(frozen)} node(s) here frozen at step {', '.join(map(str, steps)) or '-'}"

    def _stall(self, node: str, at: float) -> str:
        """The other nodes of `node`'s attempt hosted here stop at the step they had reached at `at`."""
        stalled = [
            a.node for a in self.agents.values() if a.node != node and a.hang(node, culprit=None, at=at)
        ]
        return f"{len(stalled)} node(s) here stalled"

    async def _come_back(self, agent: LightAgent) -> None:
        """The host's agent restarts. A lease that outlived the outage is revoked first (as liveness
        does before it registers again): the controller sees the node leave and come back as a new
        node, never a silent resume under another lease."""
        old = agent.lease.lease_id
        agent.come_back()
        await self._register(agent, revoke=old)
        log.warning("node %s is back under lease %x", agent.node, agent.lease.lease_id)

    async def control(self, line: str) -> str:
        """One control line -> its answer line (`ok ...` or `error ...`)."""
        text = line.strip()
        if text == "stats":
            return f"ok stats {json.dumps(self.stats(), sort_keys=True)}"
        try:
            return f"ok {text} -> {await self.apply(parse(text))}"
        except (FaultError, StoreError) as exc:
            return f"error {text}: {exc}"

    def stats(self) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            **self.counts,
            "agents": len(self.agents),
            "leases": len(self.leases) if self.leases is not None else 0,
            "refreshes": self.leases.refreshes if self.leases is not None else 0,
            "running": sum(1 for a in self.agents.values() if a.running()),
            "dark": sum(1 for a in self.agents.values() if a.dark),
            "rss_mib": round(_rss_kib() / 1024, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "threads": threading.active_count(),
            "registered_in_s": round(self.registered_in_s, 3),
            "received": self.receipts.as_dict(),
        }


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Hosted:
    """A LightProcess on its own event loop in a daemon thread: `start()`, `inject(...)`, `stop()`."""

    def __init__(self, process: LightProcess) -> None:
        self.process = process
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="lightfleet", daemon=True)

    def start(self, timeout_s: float = 60.0) -> Hosted:
        self._thread.start()
        self.call(self.process.start(), timeout_s)
        return self

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def inject(self, fault: Fault | str) -> str:
        """Apply a fault (a Fault or a control line); FaultError when it cannot apply."""
        return self.call(self.process.apply(parse(fault) if isinstance(fault, str) else fault))

    def agent(self, node: str) -> LightAgent:
        return self.process.agents[node]

    def address(self, node: str) -> str:
        return self.process.agents[node].address

    def stop(self) -> None:
        if self._thread.is_alive():
            try:
                self.call(self.process.close())
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout=10)
        self.loop.close()

    def __enter__(self) -> Hosted:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- python -m lightfleet.process ---------------------------------------------------------------


async def _serve(args: argparse.Namespace) -> int:
    nodes = cli.node_names(args.prefix, args.first_index, args.count, args.width)
    ports = [args.first_port + i if args.first_port else 0 for i in range(args.count)]
    process = LightProcess(
        cli.store_config(args),
        list(zip(nodes, ports, strict=True)),
        cli.settings(args),
        io_threads=args.io_threads,
        revoke_on_close=not args.no_revoke,
    )
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    try:
        seconds = await process.start()
    except (OSError, StoreError) as exc:
        print(f"failed {exc}", flush=True)
        await process.close()
        return 1
    bound = [a.port for a in process.agents.values()]
    print(
        f"ready pid={os.getpid()} nodes={nodes[0]}..{nodes[-1]} agents={len(nodes)} "
        f"ports={min(bound)}..{max(bound)} seconds={seconds:.3f}",
        flush=True,
    )

    def read_stdin() -> None:  # the control channel; EOF (the fleet is gone) ends the process
        for line in sys.stdin:
            if line.strip():
                future = asyncio.run_coroutine_threadsafe(process.control(line), loop)
                print(future.result(), flush=True)
        loop.call_soon_threadsafe(done.set)

    threading.Thread(target=read_stdin, name="control", daemon=True).start()
    await done.wait()
    await process.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightfleet.process", description=__doc__.split("\n\n")[0]
    )
    cli.add_common(parser)
    parser.add_argument("--first-index", type=int, default=0, help="the first node's index")
    parser.add_argument("--count", type=int, required=True, help="how many agents this process hosts")
    parser.add_argument("--width", type=int, default=4, help="digits of the node index in its name")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return asyncio.run(_serve(args))
    except cli.UsageError as exc:
        print(f"failed {exc}", flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
