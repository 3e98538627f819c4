"""gRPC clients for the node agents, as the controller's shell uses them.

Every call has a deadline and turns a failure into a value (kopf's habit: an RPC error is an
outcome the core reasons about, never an exception that kills the loop). Each outcome says whether
the failure is *temporary* (kopf's `TemporaryError`: the agent may answer if asked again) or
*permanent* (`PermanentError`: asking again cannot help); see `is_temporary`. Temporary failures are
retried here with exponential backoff until the call's own deadline runs out, so a caller sees a
temporary outcome only when the whole deadline passed without an answer.

Every call runs on one asyncio loop (grpc.aio), not on a thread of its own: a 2,048-host fan-out
is 2,048 coroutines on one thread, so a fleet's preflights, launches and dumps never crowd the
threads that keep the leader's lease alive. Callers on other threads wait on a call (`launch`,
`stop`, ...), fan calls out and wait once (`gather` of the `*_async` coroutines), or start a call
and take its answer in a callback (`submit`). Channels are cached per node registration (address
and lease): a node that re-registers gets a new channel, and one seen again by a new leader keeps
its channel and the calls in flight on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc import aio

from runwarden.v1 import agent_pb2, agent_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # flight-recorder dumps of 8 ranks fit with room to spare

# The first retry waits this long, each next one twice as long, at most RETRY_MAX_S.
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0
_CANCEL_POLL_S = 0.1  # a cancelled all-reduce call ends within this
_CLOSE_WAIT_S = 2.0  # close(): how long the calls in flight get to return their outcomes

# UNAVAILABLE: no connection (agent restarting, host unreachable) or the server is shutting down.
# DEADLINE_EXCEEDED: no answer in time (a loaded host). RESOURCE_EXHAUSTED: the agent's server is at
# its concurrent-RPC limit -- temporary too, unless it is a message over the size limit (the same
# request gives the same too-large answer every time).
_TEMPORARY_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})


def is_temporary(code: str, error: str = "") -> bool:
    """Whether a failed call with gRPC status `code` (its name) may succeed if made again."""
    if code == "RESOURCE_EXHAUSTED" and "larger than max" in error:
        return False
    return code in _TEMPORARY_CODES


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentTLS:
    """Client side of mTLS to the agents: the CA that signed them and the controller's cert."""

    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True, slots=True, kw_only=True)
class RpcOutcome:
    """The result of one agent RPC: ok, or the gRPC code and a one-line reason."""

    node: str
    ok: bool
    code: str = "OK"
    error: str = ""
    tries: int = 1

    @property
    def temporary(self) -> bool:
        """A failure that may pass (only meaningful when not ok)."""
        return not self.ok and is_temporary(self.code, self.error)


@dataclass(frozen=True, slots=True, kw_only=True)
class PreflightOutcome:
    """A preflight call: `rpc` says whether the agent answered; `summary` and `failed` what it found."""

    node: str
    rpc: RpcOutcome
    summary: common_pb2.PreflightSummary
    failed: tuple[common_pb2.CheckResult, ...] = ()

    @property
    def ok(self) -> bool:
        return self.rpc.ok


_Resp = TypeVar("_Resp")
T = TypeVar("T")


def _code_of(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    return code.name if code is not None else "UNKNOWN"


def _why(exc: grpc.RpcError) -> str:
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{_code_of(exc)}: {(details or '')[:200]}"


async def with_retries(
    call: Callable[[float], Awaitable[tuple[RpcOutcome, _Resp | None]]],
    *,
    deadline_s: float,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
    stopped: Callable[[], bool] = lambda: False,
) -> tuple[RpcOutcome, _Resp | None]:
    """Call `call(timeout_s)` until it succeeds, fails permanently, or `deadline_s` has passed.

    Each try gets what is left of the deadline as its timeout; between tries the wait doubles from
    RETRY_FIRST_S up to RETRY_MAX_S (never past the deadline), and none once `stopped()` (the
    clients are closed: the controller is exiting). The last outcome is returned, with the number of
    tries made."""
    end = clock() + deadline_s
    wait = RETRY_FIRST_S
    tries = 0
    while True:
        tries += 1
        out, resp = await call(max(0.05, end - clock()))
        if out.ok or not out.temporary or stopped() or clock() + wait >= end:
            if tries > 1:
                out = RpcOutcome(node=out.node, ok=out.ok, code=out.code, error=out.error, tries=tries)
            return out, resp
        log.info("agent %s: temporary failure (%s); retrying in %.2f s", out.node, out.error, wait)
        await sleep(wait)
        wait = min(RETRY_MAX_S, wait * 2)


@dataclass(frozen=True, slots=True)
class _Target:
    """Where a node's agent is: its address and the registration (the node record's lease) it
    answers for; a channel belongs to one target."""

    address: str
    registration: int = 0


class AgentClients:
    """Agent RPCs on one asyncio loop thread, one channel per node registration; thread-safe.

    Never call a blocking method (`launch`, `gather`, ...) from a callback given to `submit`: those
    run on the loop's thread, which the blocking call would wait for."""

    def __init__(self, tls: AgentTLS | None = None) -> None:
        self._tls = tls
        self._lock = threading.Lock()
        self._targets: dict[str, _Target] = {}
        # the loop thread's own: node -> (target, channel, stub)
        self._channels: dict[str, tuple[_Target, aio.Channel, agent_pb2_grpc.NodeAgentStub]] = {}
        self._closed = threading.Event()  # set by close(): calls in flight end, none is retried
        self._creds: grpc.ChannelCredentials | None = None
        if tls is not None:
            self._creds = grpc.ssl_channel_credentials(
                root_certificates=tls.ca.read_bytes(),
                private_key=tls.key.read_bytes(),
                certificate_chain=tls.cert.read_bytes(),
            )
        self._loop = asyncio.new_event_loop()
        self._closing = asyncio.Event()  # the loop's view of `_closed`: ends retry waits at once
        self._thread = threading.Thread(target=self._loop.run_forever, name="agent-rpc", daemon=True)
        self._thread.start()

    def address(self, node: str) -> str:
        """The node's agent address as last set ("" unknown)."""
        with self._lock:
            cur = self._targets.get(node)
            return cur.address if cur is not None else ""

    def set_address(self, node: str, address: str, registration: int = 0) -> None:
        """Where `node`'s agent answers, for its registration `registration` (the node record's
        lease). A new address or registration closes the old channel: its calls end (CANCELLED), and
        a channel to an agent that died may sit in gRPC's reconnect backoff and fail the next call."""
        target = _Target(address, registration)
        with self._lock:
            if self._targets.get(node) == target:
                return
            self._targets[node] = target
        self._on_loop(self._drop_stale, node)

    def forget(self, node: str) -> None:
        """The node is gone: its channel is closed and its calls in flight end (CANCELLED)."""
        with self._lock:
            self._targets.pop(node, None)
        self._on_loop(self._drop_stale, node)

    def close(self) -> None:
        """End every call in flight, close every channel, stop the loop."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            self._targets.clear()

        async def shut() -> None:
            # Closed channels end their calls (each a CANCELLED outcome, not an exception) and the
            # retry waits end: every call in flight returns its value before the loop stops.
            self._closing.set()
            chans = [ch for _, ch, _ in self._channels.values()]
            self._channels.clear()
            await asyncio.gather(*(ch.close(None) for ch in chans), return_exceptions=True)
            left = asyncio.all_tasks() - {asyncio.current_task()}
            if left:
                await asyncio.wait(left, timeout=_CLOSE_WAIT_S)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    # -- running calls -------------------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start `coro` on the loop; its future is done on the loop's thread (so are its callbacks).
        Once closed, it runs here and now: with no channel left, every call answers at once that
        its node has no address."""
        if self._closed.is_set():
            done: Future[T] = Future()
            try:
                done.set_result(asyncio.run(coro))
            except Exception as exc:
                done.set_exception(exc)
            return done
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def gather(self, coros: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
        """Run every coroutine at once on the loop and wait for all: one round trip for a fan-out,
        however many hosts, and no thread per call. Not from the loop's own thread."""
        todo = list(coros)
        if not todo:
            return []

        async def all_of() -> list[T]:
            return list(await asyncio.gather(*todo))

        return self.submit(all_of()).result()

    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        assert threading.current_thread() is not self._thread, "a blocking agent call on the loop's thread"
        return self.submit(coro).result()

    def _on_loop(self, fn: Callable[[str], None], node: str) -> None:
        if not self._closed.is_set():
            with contextlib.suppress(RuntimeError):  # closed meanwhile: nothing left to drop
                self._loop.call_soon_threadsafe(fn, node)

    def _drop_stale(self, node: str) -> None:
        """(loop) Close `node`'s channel if it no longer matches the node's target."""
        cur = self._channels.get(node)
        with self._lock:
            target = self._targets.get(node)
        if cur is not None and cur[0] != target:
            del self._channels[node]
            self._loop.create_task(cur[1].close(None))

    def _stub(self, node: str) -> agent_pb2_grpc.NodeAgentStub | None:
        """(loop) The stub of the node's current target; its channel is made on first use."""
        with self._lock:
            target = self._targets.get(node)
        if target is None:
            return None
        cur = self._channels.get(node)
        if cur is not None and cur[0] == target:
            return cur[2]
        if cur is not None:
            self._loop.create_task(cur[1].close(None))
        opts = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # the channel's own connection: gRPC's global pool would hand a re-registered agent's new
            # channel the old one's connection, still in its reconnect backoff after the agent died
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if self._creds is not None:
            channel = aio.secure_channel(target.address, self._creds, options=opts)
        else:
            channel = aio.insecure_channel(target.address, options=opts)
        stub = agent_pb2_grpc.NodeAgentStub(channel)
        self._channels[node] = (target, channel, stub)
        return stub

    # -- calls: each `*_async` runs on the loop; its blocking twin waits for it from any other thread

    async def run_preflight_async(
        self, node: str, request: agent_pb2.RunPreflightRequest, timeout_s: float
    ) -> PreflightOutcome:
        """Stream the checks; a failed check is in `failed`, an RPC failure in `rpc` (retried if temporary)."""
        found: list[tuple[common_pb2.PreflightSummary | None, tuple[common_pb2.CheckResult, ...]]] = []

        async def once(timeout: float) -> tuple[RpcOutcome, common_pb2.PreflightSummary | None]:
            stub = self._stub(node)
            if stub is None:
                return _no_address(node), None
            failed: list[common_pb2.CheckResult] = []
            summary: common_pb2.PreflightSummary | None = None
            try:
                async for item in stub.RunPreflight(request, timeout=timeout):
                    if item.HasField("result") and item.result.status == common_pb2.CHECK_STATUS_FAIL:
                        failed.append(item.result)
                    elif item.HasField("summary"):
                        summary = item.summary
            except grpc.RpcError as exc:
                log.info("agent %s RunPreflight failed: %s", node, _why(exc))
                return _failed(node, exc), None
            except asyncio.CancelledError:
                return _cancelled(node), None
            found.append((summary, tuple(failed)))
            if summary is None:
                return RpcOutcome(node=node, ok=False, code="DATA_LOSS", error="agent sent no summary"), None
            return RpcOutcome(node=node, ok=True), summary

        out, summary = await self._retried(once, timeout_s)
        failed = found[-1][1] if found else ()
        return PreflightOutcome(
            node=node,
            rpc=out,
            summary=summary or common_pb2.PreflightSummary(mode=request.mode),
            failed=failed,
        )

    def run_preflight(
        self, node: str, request: agent_pb2.RunPreflightRequest, timeout_s: float
    ) -> PreflightOutcome:
        return self._wait(self.run_preflight_async(node, request, timeout_s))

    async def launch_async(
        self, node: str, request: agent_pb2.LaunchWorkersRequest, timeout_s: float
    ) -> tuple[RpcOutcome, agent_pb2.LaunchWorkersResponse | None]:
        """Start the node's workers; retried while temporary. A retry refused with ALREADY_EXISTS
        succeeded if the node now runs this very attempt (an earlier try landed but its answer was
        lost: then there is no response to say which path started it)."""
        tries = 0

        async def once(timeout: float) -> tuple[RpcOutcome, agent_pb2.LaunchWorkersResponse | None]:
            nonlocal tries
            tries += 1
            out, resp = await self._call(
                node, "LaunchWorkers", lambda s: s.LaunchWorkers(request, timeout=timeout)
            )
            if (
                out.code == "ALREADY_EXISTS"
                and tries > 1
                and await self._runs_attempt(node, request, timeout)
            ):
                return RpcOutcome(node=node, ok=True), None
            return out, resp

        return await self._retried(once, timeout_s)

    def launch(
        self, node: str, request: agent_pb2.LaunchWorkersRequest, timeout_s: float
    ) -> tuple[RpcOutcome, agent_pb2.LaunchWorkersResponse | None]:
        return self._wait(self.launch_async(node, request, timeout_s))

    async def _runs_attempt(
        self, node: str, request: agent_pb2.LaunchWorkersRequest, timeout_s: float
    ) -> bool:
        _, status = await self._call(
            node,
            "GetNodeStatus",
            lambda s: s.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=min(timeout_s, 5.0)),
        )
        return status is not None and any(
            w.run == request.run and w.attempt == request.attempt and w.running for w in status.workers
        )

    async def stop_workers_async(
        self, node: str, request: agent_pb2.StopWorkersRequest, timeout_s: float
    ) -> tuple[RpcOutcome, agent_pb2.StopWorkersResponse | None]:
        """Stop the node's workers; NOT_FOUND (nothing of the run runs there) counts as stopped (and
        answers None). The answer names the workers stopped, with their exits."""

        async def once(timeout: float) -> tuple[RpcOutcome, agent_pb2.StopWorkersResponse | None]:
            out, resp = await self._call(
                node, "StopWorkers", lambda s: s.StopWorkers(request, timeout=timeout)
            )
            return (RpcOutcome(node=node, ok=True), resp) if out.code == "NOT_FOUND" else (out, resp)

        return await self._retried(once, timeout_s)

    async def stop_async(
        self, node: str, request: agent_pb2.StopWorkersRequest, timeout_s: float
    ) -> RpcOutcome:
        return (await self.stop_workers_async(node, request, timeout_s))[0]

    def stop(self, node: str, request: agent_pb2.StopWorkersRequest, timeout_s: float) -> RpcOutcome:
        return self._wait(self.stop_async(node, request, timeout_s))

    async def request_stop_async(
        self, node: str, request: agent_pb2.RequestStopRequest, timeout_s: float = 5.0
    ) -> RpcOutcome:
        async def once(timeout: float) -> tuple[RpcOutcome, agent_pb2.RequestStopResponse | None]:
            return await self._call(node, "RequestStop", lambda s: s.RequestStop(request, timeout=timeout))

        return (await self._retried(once, timeout_s))[0]

    def request_stop(
        self, node: str, request: agent_pb2.RequestStopRequest, timeout_s: float = 5.0
    ) -> RpcOutcome:
        return self._wait(self.request_stop_async(node, request, timeout_s))

    def drain(
        self, node: str, request: agent_pb2.DrainRequest, timeout_s: float = 5.0
    ) -> tuple[RpcOutcome, agent_pb2.DrainResponse | None]:
        """Drain the node (or end its drain) through its agent; the record it re-puts says the rest."""

        async def once(timeout: float) -> tuple[RpcOutcome, agent_pb2.DrainResponse | None]:
            return await self._call(node, "Drain", lambda s: s.Drain(request, timeout=timeout))

        return self._wait(self._retried(once, timeout_s))

    async def collect_dumps_async(
        self, node: str, request: agent_pb2.CollectFlightRecorderRequest, timeout_s: float
    ) -> tuple[RpcOutcome, agent_pb2.CollectFlightRecorderResponse | None]:
        """One try: a rank that cannot answer in time is itself evidence; a retry would spend the deadline."""
        return await self._call(
            node, "CollectFlightRecorder", lambda s: s.CollectFlightRecorder(request, timeout=timeout_s)
        )

    def collect_dumps(
        self, node: str, request: agent_pb2.CollectFlightRecorderRequest, timeout_s: float
    ) -> tuple[RpcOutcome, agent_pb2.CollectFlightRecorderResponse | None]:
        return self._wait(self.collect_dumps_async(node, request, timeout_s))

    def measure_all_reduce(
        self,
        node: str,
        request: agent_pb2.MeasureAllReduceRequest,
        timeout_s: float,
        on_master: Callable[[agent_pb2.CollectiveMaster], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> tuple[RpcOutcome, agent_pb2.AllReduceMeasurement | None]:
        """One rank of an all-reduce group; one try (the group's other ranks do not wait for a retry).

        `on_master` is called (on the loop's thread) with rank 0's master (address and port) as soon as
        its stream carries it, while the rank waits for the others; the answer is the rank's result
        (rank 0: the figures). Setting `cancel` ends the call (CANCELLED) and the agent stops its rank
        at once: a group whose other rank failed need not wait out its timeout."""

        async def measure() -> tuple[RpcOutcome, agent_pb2.AllReduceMeasurement | None]:
            stub = self._stub(node)
            if stub is None:
                return _no_address(node), None
            result: agent_pb2.AllReduceMeasurement | None = None
            call = stub.MeasureAllReduce(request, timeout=timeout_s)

            async def cancel_when_asked() -> None:
                while cancel is not None and not cancel.is_set():
                    await asyncio.sleep(_CANCEL_POLL_S)
                call.cancel()

            watcher = asyncio.ensure_future(cancel_when_asked()) if cancel is not None else None
            try:
                async for item in call:
                    if item.HasField("master") and on_master is not None:
                        on_master(item.master)
                    elif item.HasField("result"):
                        result = item.result
            except grpc.RpcError as exc:
                log.info("agent %s MeasureAllReduce failed: %s", node, _why(exc))
                return _failed(node, exc), None
            except asyncio.CancelledError:
                return _cancelled(node, "the group stopped it"), None
            finally:
                if watcher is not None:
                    watcher.cancel()
            if result is None:
                return RpcOutcome(node=node, ok=False, code="DATA_LOSS", error="agent sent no result"), None
            return RpcOutcome(node=node, ok=True), result

        return self._wait(measure())

    def inject_fault(
        self, node: str, request: agent_pb2.InjectFaultRequest, timeout_s: float = 5.0
    ) -> RpcOutcome:
        return self._wait(
            self._call(node, "InjectFault", lambda s: s.InjectFault(request, timeout=timeout_s))
        )[0]

    async def status_async(
        self, node: str, request: agent_pb2.GetNodeStatusRequest | None = None, timeout_s: float = 5.0
    ) -> tuple[RpcOutcome, agent_pb2.GetNodeStatusResponse | None]:
        req = request or agent_pb2.GetNodeStatusRequest()

        async def once(timeout: float) -> tuple[RpcOutcome, agent_pb2.GetNodeStatusResponse | None]:
            return await self._call(node, "GetNodeStatus", lambda s: s.GetNodeStatus(req, timeout=timeout))

        return await self._retried(once, timeout_s)

    def status(
        self, node: str, request: agent_pb2.GetNodeStatusRequest | None = None, timeout_s: float = 5.0
    ) -> tuple[RpcOutcome, agent_pb2.GetNodeStatusResponse | None]:
        return self._wait(self.status_async(node, request, timeout_s))

    # -- plumbing ------------------------------------------------------------------------------

    async def _retried(
        self, once: Callable[[float], Awaitable[tuple[RpcOutcome, _Resp | None]]], timeout_s: float
    ) -> tuple[RpcOutcome, _Resp | None]:
        return await with_retries(once, deadline_s=timeout_s, sleep=self._sleep, stopped=self._closed.is_set)

    async def _sleep(self, seconds: float) -> None:
        """A retry's wait, cut short by `close()`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing.wait(), seconds)

    async def _call(
        self, node: str, name: str, call: Callable[[agent_pb2_grpc.NodeAgentStub], Awaitable[_Resp]]
    ) -> tuple[RpcOutcome, _Resp | None]:
        """One unary call on the node's stub; an RPC error becomes an outcome."""
        stub = self._stub(node)
        if stub is None:
            return _no_address(node), None
        try:
            resp = await call(stub)
        except grpc.RpcError as exc:
            log.info("agent %s %s failed: %s", node, name, _why(exc))
            return _failed(node, exc), None
        except asyncio.CancelledError:
            return _cancelled(node), None
        return RpcOutcome(node=node, ok=True), resp


def _no_address(node: str) -> RpcOutcome:
    return RpcOutcome(node=node, ok=False, code="UNAVAILABLE", error="no address known")


def _failed(node: str, exc: grpc.RpcError) -> RpcOutcome:
    return RpcOutcome(node=node, ok=False, code=_code_of(exc), error=_why(exc))


def _cancelled(
    node: str, why: str = "its channel closed: the node re-registered, left, or the clients closed"
) -> RpcOutcome:
    """A call ended on this side. The caller's own task being cancelled is not this: that re-raises."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
    return RpcOutcome(node=node, ok=False, code="CANCELLED", error=f"CANCELLED: {why}")
