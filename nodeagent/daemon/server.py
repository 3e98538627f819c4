"""The gRPC NodeAgent service: TCP for the controller, a unix socket for the local ranks.

Every handler validates its request first (INVALID_ARGUMENT naming the field), answers NOT_FOUND
for a run this node does not know, and turns any unexpected exception into INTERNAL with one
line: the agent keeps serving whatever a client sends. Mutating RPCs (RunPreflight,
LaunchWorkers, StopWorkers, InjectFault, Drain) need a verified client certificate when TLS is on; on
the unix socket they are refused when TLS is on (only certificate holders mutate).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from nodeagent.daemon import allreduce, chaos, preflight_bridge, proctree
from nodeagent.daemon import validate as v
from nodeagent.daemon.agent import Agent, LaunchRefused, Refusal
from nodeagent.daemon.flight_recorder import CollectedDump, collect_dumps, discover_sockets
from nodeagent.daemon.launcher import LaunchError
from nodeagent.daemon.progress_socket import ProgressDatagramServer
from nodeagent.wire import FR_MAX_SOCKET_PATH, fr_socket_path, progress_socket_path
from runwarden.v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
SERVICE = agent_pb2.DESCRIPTOR.services_by_name["NodeAgent"].full_name


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> Any:
    context.abort(code, message)


def rpc(fn: F) -> F:
    """Time the call, map ValidationError to INVALID_ARGUMENT, anything unexpected to INTERNAL."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: NodeAgentServicer, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.perf_counter()
        code = "OK"
        try:
            return fn(self, request, context)
        except v.ValidationError as exc:
            code = "INVALID_ARGUMENT"
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            status = context.code()  # type: ignore[attr-defined]  # grpc-stubs lacks code()
            if status is not None and status != grpc.StatusCode.OK:
                code = status.name
                raise  # context.abort() already set the status
            code = "INTERNAL"
            log.exception("%s failed", name)
            _abort(context, grpc.StatusCode.INTERNAL, f"{name}: {type(exc).__name__}: {exc}"[:500])
        finally:
            self.agent.metrics.rpc_latency.labels(method=name, code=code).observe(time.perf_counter() - start)

    return cast(F, wrapper)  # functools.wraps: wrapper takes and returns what fn does


_REFUSAL_CODES = {
    Refusal.NOT_NOW: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Refusal.RUNNING: grpc.StatusCode.ALREADY_EXISTS,
}


class NodeAgentServicer(agent_pb2_grpc.NodeAgentServicer):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    # --- access ------------------------------------------------------------------------------------

    def _require_admin(self, context: grpc.ServicerContext) -> None:
        tls = self.agent.config.tls_enabled
        if context.peer().startswith("unix:"):
            if tls:
                _abort(
                    context,
                    grpc.StatusCode.PERMISSION_DENIED,
                    "mutating RPCs are refused on the unix socket when TLS is on; use TCP with a client cert",
                )
            return
        if not tls:
            return  # plain TCP is bound to loopback only (config refuses anything else)
        auth = context.auth_context()
        if not auth.get("x509_pem_cert"):
            _abort(context, grpc.StatusCode.UNAUTHENTICATED, "this RPC needs a client certificate")

    def _require_known(self, run: str, context: grpc.ServicerContext) -> None:
        if not self.agent.knows_run(run):
            _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"run {run!r} is not known on node {self.agent.config.node}",
            )

    # --- RPCs ----------------------------------------------------------------------------------------

    def RunPreflight(
        self, request: Any, context: grpc.ServicerContext
    ) -> Iterator[agent_pb2.RunPreflightResponse]:
        start = time.perf_counter()
        code = "OK"
        try:
            self._require_admin(context)
            v.preflight_request(request)
            yield from preflight_bridge.stream(self.agent, request, context)
        except v.ValidationError as exc:
            code = "INVALID_ARGUMENT"
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            status = context.code()  # type: ignore[attr-defined]  # grpc-stubs lacks code()
            if status is not None and status != grpc.StatusCode.OK:
                code = status.name
                raise
            code = "INTERNAL"
            log.exception("RunPreflight failed")
            _abort(context, grpc.StatusCode.INTERNAL, f"RunPreflight: {type(exc).__name__}: {exc}"[:500])
        finally:
            self.agent.metrics.rpc_latency.labels(method="RunPreflight", code=code).observe(
                time.perf_counter() - start
            )

    @rpc
    def GetNodeStatus(self, request: Any, context: grpc.ServicerContext) -> agent_pb2.GetNodeStatusResponse:
        a = self.agent
        reg = a.registration
        hb = reg.last_heartbeat_at() if reg is not None else None
        response = agent_pb2.GetNodeStatusResponse(
            node=a.config.node,
            state=a.node_state(),
            lease_held=reg.lease_held if reg is not None else False,
            last_heartbeat_age_s=time.monotonic() - hb if hb is not None else -1.0,
            ranks=a.progress.ranks(),
            recent_evidence=a.evidence.recent(),
            agent_version=a.node_record().agent_version,
        )
        if a.last_preflight is not None:
            response.last_preflight.CopyFrom(a.last_preflight)
        for w in a.launcher.workers():
            response.workers.append(_worker_status(w))
        return response

    @rpc
    def ReportProgress(self, request: Any, context: grpc.ServicerContext) -> agent_pb2.ReportProgressResponse:
        v.progress_request(request)
        return self.agent.report_progress(request)

    @rpc
    def RequestStop(self, request: Any, context: grpc.ServicerContext) -> agent_pb2.RequestStopResponse:
        v.run_name(request.run)
        if len(request.reason) > 1024:
            raise v.ValidationError("reason: at most 1024 characters")
        self._require_known(request.run, context)
        self.agent.set_stop(request.run, request.reason or "stop requested")
        log.info("stop requested for run %s: %s", request.run, request.reason)
        return agent_pb2.RequestStopResponse(accepted=True)

    @rpc
    def GetStopState(self, request: Any, context: grpc.ServicerContext) -> agent_pb2.GetStopStateResponse:
        v.run_name(request.run)
        self._require_known(request.run, context)
        stop = self.agent.stops.get(request.run)
        return agent_pb2.GetStopStateResponse(
            stop_requested=stop is not None, reason=stop.reason if stop else ""
        )

    @rpc
    def CollectFlightRecorder(
        self, request: Any, context: grpc.ServicerContext
    ) -> agent_pb2.CollectFlightRecorderResponse:
        v.run_name(request.run)
        timeout = (
            v.seconds(request.timeout_s, "timeout_s", high=300) or self.agent.config.flight_recorder_timeout_s
        )
        self._require_known(request.run, context)
        attempt = self.agent.attempts.get(request.run, self.agent.progress.attempt(request.run) or 0)
        socket_dir = self.agent.config.fr_socket_dir(request.run, attempt)
        sockets = discover_sockets(socket_dir)
        # The attempt's ranks that opened no socket answer too (a rank the controller expects but
        # nobody answers for is "no dump" without its /proc state: a stopped rank looks like the rest)
        known = (
            self.agent.progress.ranks(request.run)
            if self.agent.progress.attempt(request.run) == attempt
            else []
        )
        unserved = sorted(r.rank for r in known if r.rank not in sockets)
        # A stopped rank (SIGSTOP, a debugger) cannot answer: it is not asked, so the collection does
        # not wait out its timeout (the hang's detection -> relaunch path); "no dump" plus its state
        # is the evidence, exactly as after a timeout.
        stopped = {r: st for r, st in self._process_states(request.run, list(sockets)).items() if st in "Tt"}
        dumps = (
            collect_dumps(
                {r: p for r, p in sockets.items() if r not in stopped},
                timeout,
                max_bytes=self.agent.config.max_message_bytes // 2,
                since_ns=self.agent.attempt_started_ns.get(request.run, 0),
            )
            if len(sockets) > len(stopped)
            else []
        )
        dumps += [
            CollectedDump(rank=r, ok=False, error="no dump: its process is stopped", format="", data=b"")
            for r in stopped
        ]
        dumps += [
            CollectedDump(
                rank=r, ok=False, error=_no_socket(fr_socket_path(socket_dir, r)), format="", data=b""
            )
            for r in unserved
        ]
        dumps.sort(key=lambda d: d.rank)
        silent_states = self._process_states(request.run, [d.rank for d in dumps if not d.ok])
        response = agent_pb2.CollectFlightRecorderResponse(node=self.agent.config.node)
        budget = self.agent.config.max_message_bytes - 64 * 1024
        for d in dumps:
            data = d.data if len(d.data) <= budget else b""
            budget -= len(data)
            error = d.error if data or not d.ok else "no dump: over the agent's message size limit"
            response.dumps.append(
                agent_pb2.RankDump(
                    rank=d.rank,
                    ok=d.ok and bool(data),
                    error=error,
                    format=d.format,
                    data=data,
                    process_state=silent_states.get(d.rank, ""),
                )
            )
        return response

    def _process_states(self, run: str, ranks: list[int]) -> dict[int, str]:
        """/proc state of the ranks that gave no dump: a stopped ("T") rank is the hang's cause, not a
        guess. Only pids inside this agent's own worker trees are read (a reused pid says nothing)."""
        if not ranks:
            return {}
        pids = {r.rank: r.pid for r in self.agent.progress.ranks(run) if r.pid > 0}
        states: dict[int, str] = {}
        for rank in ranks:
            pid = pids.get(rank)
            if pid is None or not self.agent.launcher.owns(pid):
                continue
            info = proctree.read_proc(pid)
            if info is not None:
                states[rank] = info.state
        return states

    @rpc
    def LaunchWorkers(self, request: Any, context: grpc.ServicerContext) -> agent_pb2.LaunchWorkersResponse:
        self._require_admin(context)
        v.launch_request(request)
        # a warm launch waits for its parked group at most until shortly before the caller gives up
        remaining = context.time_remaining()
        try:
            worker, path, stopped = self.agent.launch_workers(
                request, None if remaining is None else remaining - 1.0
            )
        except LaunchRefused as exc:
            _abort(context, _REFUSAL_CODES[exc.kind], str(exc))
        except LaunchError as exc:
            code = (
                grpc.StatusCode.PERMISSION_DENIED
                if exc.permission
                else grpc.StatusCode.UNAVAILABLE
                if exc.temporary
                else grpc.StatusCode.FAILED_PRECONDITION
            )
            _abort(context, code, str(exc))
        self.agent.state_changed()
        return agent_pb2.LaunchWorkersResponse(
            pid=worker.pid,
            launch_path=path.kind,
            launch_detail=path.detail[:500],
            stopped=[_worker_status(w) for w in stopped],
        )

    @rpc
    def StopWorkers(self, request: Any, context: grpc.ServicerContext) -> agent_pb2.StopWorkersResponse:
        self._require_admin(context)
        v.run_name(request.run)
        v.integer(request.attempt, "attempt", low=0, high=v.MAX_STEP)
        grace = v.seconds(request.grace_s, "grace_s", high=3600) or self.agent.config.stop_grace_s
        park = v.seconds(request.park_within_s, "park_within_s", high=60)
        if not self.agent.launcher.workers(request.run):
            _abort(context, grpc.StatusCode.NOT_FOUND, f"run {request.run!r} has no workers on this node")
        stopped = self.agent.stop_workers(request.run, request.attempt, grace, park_within_s=park)
        self.agent.state_changed()
        return agent_pb2.StopWorkersResponse(stopped=[_worker_status(w) for w in stopped])

    @rpc
    def Drain(self, request: Any, context: grpc.ServicerContext) -> agent_pb2.DrainResponse:
        """Drain (a reason) or undo; answers the state that results. An agent leaving after a
        SIGTERM cannot be put back, and keeps its reason: it is going away."""
        self._require_admin(context)
        v.drain_request(request)
        a = self.agent
        if request.undo:
            if a.leaving:
                _abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"node {a.config.node} is leaving ({a.drain_reason}): it cannot be put back in service",
                )
            a.undrain()
        elif not a.leaving:
            a.drain(request.reason)
        reason = a.drain_reason
        return agent_pb2.DrainResponse(draining=bool(reason), reason=reason)

    @rpc
    def InjectFault(self, request: Any, context: grpc.ServicerContext) -> agent_pb2.InjectFaultResponse:
        self._require_admin(context)
        if not self.agent.config.chaos_enabled:
            _abort(
                context, grpc.StatusCode.PERMISSION_DENIED, "fault injection is off (chaos_enabled = false)"
            )
        v.fault_request(request)
        try:
            detail = chaos.inject(self.agent, request)
        except chaos.ChaosError as exc:
            _abort(context, exc.code, str(exc))
        return agent_pb2.InjectFaultResponse(detail=detail)

    def MeasureAllReduce(
        self, request: Any, context: grpc.ServicerContext
    ) -> Iterator[agent_pb2.MeasureAllReduceResponse]:
        yield from allreduce.serve(self.agent, request, context, self._require_admin)


def _worker_status(w: Any) -> agent_pb2.WorkerStatus:
    status = agent_pb2.WorkerStatus(
        run=w.run,
        attempt=w.attempt,
        pid=w.pid,
        running=w.running,
        started_at=w.started_at,
        parked=getattr(w, "parked", False),
    )
    if w.exit is not None:
        status.exit.CopyFrom(w.exit.to_proto())
    return status


class AgentServer:
    """The grpc.Server with both listeners, health and reflection. `.tcp_port` is the bound port."""

    def __init__(self, agent: Agent) -> None:
        cfg = agent.config
        limit = cfg.max_message_bytes
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="rpc"),
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=64,
        )
        agent_pb2_grpc.add_NodeAgentServicer_to_server(NodeAgentServicer(agent), self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self.tcp_port = 0
        if cfg.listen:
            if cfg.tls_enabled:
                creds = grpc.ssl_server_credentials(
                    [(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())],
                    root_certificates=Path(cfg.tls_client_ca).read_bytes() if cfg.tls_client_ca else None,
                    require_client_auth=bool(cfg.tls_client_ca),
                )
                self.tcp_port = self.server.add_secure_port(cfg.listen, creds)
            else:
                self.tcp_port = self.server.add_insecure_port(cfg.listen)
            if self.tcp_port == 0:
                raise OSError(f"cannot listen on {cfg.listen}")
            if cfg.advertise.endswith(":0"):
                agent.advertise = cfg.advertise[:-1] + str(self.tcp_port)
        self.unix_socket = cfg.unix_socket
        if self.unix_socket:
            Path(self.unix_socket).parent.mkdir(parents=True, exist_ok=True)
            Path(self.unix_socket).unlink(missing_ok=True)  # a stale socket of a dead agent
            if self.server.add_insecure_port(f"unix:{self.unix_socket}") == 0:
                raise OSError(f"cannot listen on unix:{self.unix_socket}")
        self.progress_dgram: ProgressDatagramServer | None = None
        if self.unix_socket:
            latency = agent.metrics.rpc_latency
            self.progress_dgram = ProgressDatagramServer(
                progress_socket_path(self.unix_socket),
                agent.report_progress,
                lambda code, s: latency.labels(method="ReportProgressDatagram", code=code).observe(s),
            )

    def start(self) -> None:
        self.server.start()
        if self.progress_dgram is not None:
            self.progress_dgram.start()
        if self.unix_socket:
            os.chmod(self.unix_socket, 0o660)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace_s: float = 2.0) -> None:
        if self.progress_dgram is not None:
            self.progress_dgram.stop()
        self.health.enter_graceful_shutdown()
        done: threading.Event = self.server.stop(grace_s)
        done.wait(grace_s + 1)


def _no_socket(path: Path) -> str:
    """Why a rank of the attempt has no flight-recorder socket, as far as the agent can tell."""
    size = len(os.fsencode(path))
    if size > FR_MAX_SOCKET_PATH:
        return (
            f"no dump: its flight-recorder socket path is {size} bytes, over the {FR_MAX_SOCKET_PATH}-byte "
            f"limit of a unix socket ({path}): shorten the agent's run_dir"
        )
    return "no dump: no flight-recorder socket (the rank opened none, or it has exited)"
