"""The NodeAgent service of one light agent, on grpc.aio: the real servicer's validation and codes.

Every handler validates with the real agent's nodeagent.daemon.validate (INVALID_ARGUMENT naming the
field), maps a refusal to the real agent's status code and message, and turns anything unexpected
into INTERNAL with one line. A host gone dark (the lease-loss fault) answers UNAVAILABLE, as a dead
host's port would. What the controller never calls on a light agent answers UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc

from lightfleet.agent import WARM_OFF, WARM_ON, Attempt, LightAgent, Refused
from nodeagent.daemon import validate as v
from runwarden.v1 import agent_pb2, agent_pb2_grpc, common_pb2, store_pb2

log = logging.getLogger(__name__)
Context = grpc.aio.ServicerContext[Any, Any]
R = TypeVar("R")
DEFAULT_STOP_GRACE_S = 30.0  # nodeagent.daemon.config.AgentConfig.stop_grace_s
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # AgentConfig.max_message_bytes


async def _refuse(context: Context, exc: Exception, name: str) -> None:
    if isinstance(exc, v.ValidationError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, Refused):
        await context.abort(grpc.StatusCode[exc.code], str(exc))
    log.exception("%s failed", name)
    await context.abort(grpc.StatusCode.INTERNAL, f"{name}: {type(exc).__name__}: {exc}"[:500])


def unary(
    fn: Callable[[NodeAgent, Any, Context], Awaitable[R]],
) -> Callable[[NodeAgent, Any, Context], Awaitable[R]]:
    """ValidationError -> INVALID_ARGUMENT, Refused -> its code, anything else -> INTERNAL."""

    @functools.wraps(fn)
    async def wrapper(self: NodeAgent, request: Any, context: Context) -> R:
        self.process.received(fn.__name__, getattr(request, "attempt", 0))
        await self._alive(context)
        try:
            return await fn(self, request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await _refuse(context, exc, fn.__name__)
            raise  # unreachable: abort raised

    return wrapper


class Host(Protocol):
    """What a servicer needs of the process hosting it (lightfleet.process.LightProcess)."""

    def flush(self, agent: LightAgent, now: float | None = None) -> None: ...
    def publish(self, agent: LightAgent, evidence: common_pb2.Evidence) -> None: ...
    async def attempt_record(self, run: str) -> store_pb2.AttemptRecord | None: ...
    def follow(self, run: str) -> None: ...
    def confirmed_at(self, agent: LightAgent) -> float | None: ...
    def received(self, rpc: str, attempt: int = 0) -> None: ...


class NodeAgent(agent_pb2_grpc.NodeAgentServicer):
    def __init__(self, agent: LightAgent, process: Host) -> None:
        self.agent = agent
        self.process = process

    async def _alive(self, context: Context) -> None:
        if self.agent.dark:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"node {self.agent.node} is unreachable (lightfleet lease-loss fault)",
            )

    async def _require_known(self, run: str, context: Context) -> None:
        if not self.agent.knows_run(run):
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"run {run!r} is not known on node {self.agent.node}"
            )

    # --- preflight (server stream) -----------------------------------------------------------------

    async def RunPreflight(
        self, request: agent_pb2.RunPreflightRequest, context: Context
    ) -> AsyncIterator[agent_pb2.RunPreflightResponse]:
        self.process.received("RunPreflight")
        await self._alive(context)
        a = self.agent
        try:
            v.preflight_request(request)
            plan = a.begin_preflight(request.mode)
        except (v.ValidationError, Refused) as exc:
            await _refuse(context, exc, "RunPreflight")
            return
        self.process.flush(a)  # the record says PREFLIGHT
        start = time.monotonic()
        try:
            await asyncio.sleep(plan.latency_s)
            await self._alive(context)
            results, summary, evidence = a.finish_preflight(plan, time.monotonic() - start, time.time())
        except BaseException:
            a.end_preflight()
            self.process.flush(a)
            raise
        self.process.flush(a)
        if evidence is not None:
            self.process.publish(a, evidence)
        for result in results:
            yield agent_pb2.RunPreflightResponse(result=result)
        yield agent_pb2.RunPreflightResponse(summary=summary)

    # --- attempts ------------------------------------------------------------------------------------

    @unary
    async def LaunchWorkers(
        self, request: agent_pb2.LaunchWorkersRequest, context: Context
    ) -> agent_pb2.LaunchWorkersResponse:
        v.launch_request(request)
        a = self.agent
        stopped = await self._stop_older(request) if request.HasField("stop_older") else []
        a.check_launch(request)
        await asyncio.sleep(a.settings.launch.sample(a.rng))
        record = await self.process.attempt_record(request.run)
        await self._alive(context)
        a.start_attempt(request, time.time(), record)
        self.process.follow(request.run)
        self.process.flush(a)
        path, detail = ("warm", WARM_ON) if a.settings.warm else ("cold", WARM_OFF)
        return agent_pb2.LaunchWorkersResponse(
            pid=a.pid, launch_path=path, launch_detail=detail, stopped=stopped
        )

    async def _stop_older(self, request: agent_pb2.LaunchWorkersRequest) -> list[agent_pb2.WorkerStatus]:
        """LaunchWorkers.stop_older (Agent._stop_older): the run's older attempt, stopped as StopWorkers
        stops it, unless the launch is stale."""
        a = self.agent
        a.check_fence(request)
        targets = a.older_than(request.run, request.attempt)
        if not targets:
            return []
        return await self._stop(targets, request.stop_older.grace_s, request.stop_older.park_within_s)

    @unary
    async def StopWorkers(
        self, request: agent_pb2.StopWorkersRequest, context: Context
    ) -> agent_pb2.StopWorkersResponse:
        v.run_name(request.run)
        v.integer(request.attempt, "attempt", low=0, high=v.MAX_STEP)
        grace = v.seconds(request.grace_s, "grace_s", high=3600)
        park = v.seconds(request.park_within_s, "park_within_s", high=60)  # cold workers do not park
        targets = self.agent.stoppable(request.run, request.attempt)
        return agent_pb2.StopWorkersResponse(stopped=await self._stop(targets, grace, park))

    async def _stop(self, targets: list[Attempt], grace: float, park: float) -> list[agent_pb2.WorkerStatus]:
        a = self.agent
        grace = grace or DEFAULT_STOP_GRACE_S
        if park > 0 and (a.unhealthy or any(t.culprit_stopped for t in targets)):
            # Agent.stop_workers: an unplanned stop on a node with fatal evidence, or of a stopped
            # process (it cannot act on a TERM), KILLs at once
            grace = 0.0
        await asyncio.sleep(a.stop_delay(targets, grace, park))
        stopped = a.finish_stop(targets, grace, time.time(), park)
        self.process.flush(a)
        return stopped

    @unary
    async def RequestStop(
        self, request: agent_pb2.RequestStopRequest, context: Context
    ) -> agent_pb2.RequestStopResponse:
        v.run_name(request.run)
        if len(request.reason) > 1024:
            raise v.ValidationError("reason: at most 1024 characters")
        await self._require_known(request.run, context)
        self.agent.request_stop(request.run, request.reason or "stop requested", time.time())
        self.process.flush(self.agent)
        return agent_pb2.RequestStopResponse(accepted=True)

    @unary
    async def GetStopState(
        self, request: agent_pb2.GetStopStateRequest, context: Context
    ) -> agent_pb2.GetStopStateResponse:
        v.run_name(request.run)
        await self._require_known(request.run, context)
        stop = self.agent.stops.get(request.run)
        return agent_pb2.GetStopStateResponse(
            stop_requested=stop is not None, reason=stop.reason if stop else ""
        )

    @unary
    async def CollectFlightRecorder(
        self, request: agent_pb2.CollectFlightRecorderRequest, context: Context
    ) -> agent_pb2.CollectFlightRecorderResponse:
        v.run_name(request.run)
        v.seconds(request.timeout_s, "timeout_s", high=300)
        await self._require_known(request.run, context)
        a = self.agent
        await asyncio.sleep(a.settings.dump.sample(a.rng))
        return a.dumps(request.run, time.time())

    # --- the node --------------------------------------------------------------------------------

    @unary
    async def GetNodeStatus(
        self, request: agent_pb2.GetNodeStatusRequest, context: Context
    ) -> agent_pb2.GetNodeStatusResponse:
        a = self.agent
        a.lease.confirmed_at = self.process.confirmed_at(a) or a.lease.confirmed_at
        return a.status(time.time(), time.monotonic())

    @unary
    async def Drain(self, request: agent_pb2.DrainRequest, context: Context) -> agent_pb2.DrainResponse:
        v.drain_request(request)
        a = self.agent
        if request.undo:
            a.undrain()
        else:
            a.drain(request.reason)
        self.process.flush(a)
        return agent_pb2.DrainResponse(draining=bool(a.drain_reason), reason=a.drain_reason)

    # --- not on a light agent ----------------------------------------------------------------------

    @unary
    async def ReportProgress(self, request: Any, context: Context) -> Any:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "a light agent (lightfleet) has no local ranks to report progress"
        )

    @unary
    async def InjectFault(self, request: Any, context: Context) -> Any:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "a light agent (lightfleet) takes faults on its fleet's control channel (stdin), not InjectFault",
        )

    async def MeasureAllReduce(self, request: Any, context: Context) -> AsyncIterator[Any]:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "a light agent (lightfleet) runs no all-reduce: the controller releases a burn-in on its "
            "node-local stages",
        )
        yield  # an async generator, as the streaming RPC's handler must be


def make_server(agent: LightAgent, process: Host) -> tuple[grpc.aio.Server, int]:
    """The agent's grpc.aio server bound to host:port (port 0: the kernel's choice); returns it and its port."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),  # a port taken by someone else is an error, never shared
        ],
        maximum_concurrent_rpcs=64,
    )
    agent_pb2_grpc.add_NodeAgentServicer_to_server(NodeAgent(agent, process), server)
    port = server.add_insecure_port(f"{agent.host}:{agent.port}")
    return server, port
