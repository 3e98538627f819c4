"""MeasureAllReduce: this node as one rank of a multi-node all-reduce (the controller's bandwidth gate).

The agent runs `python -m preflight.collective` with its own interpreter as rank `rank` of
`world_size` (one rank per node) and answers with a stream:

* rank 0: its agent binds a listening socket on its own advertised host, on a port the kernel
  chooses there, and hands it to the rank (the store serves on it; nothing races for the port).
  The first message is `master` (that host and port), sent before the rank has even imported
  torch; the caller then asks the other ranks' agents with it. The last message is `result`.
* other ranks: connect to the master they are given; the last message is an empty `result`.

Every rank is bounded by the request's `timeout_s`: the rank's own store and process-group timeouts
are set to it, and the agent kills the rank's process group when it runs past it, or as soon as the
caller goes away. So a caller that never asks the other ranks costs rank 0 its timeout, no more, and
nothing can wait on anything forever. The rank uses the agent's collective interface
(`collective_ifname`: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, as for the workers); without one, its
gloo connections are bound to the agent's advertised host.

Refused while workers run on the node (the all-reduce would compete with them for the network and
the GPUs), and while a preflight or another all-reduce runs (one at a time, after a short wait for
one that is ending; the node shows PREFLIGHT meanwhile).
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from nodeagent.daemon import validate as v
from nodeagent.daemon.config import split_host_port
from runwarden.config import ConfigError
from runwarden.launch import collective_env
from runwarden.v1 import agent_pb2

log = logging.getLogger(__name__)

MAX_WORLD = 4096
MAX_SIZE_BYTES = 1 << 30
MAX_ITERATIONS = 1000
MAX_WARMUP = 100
MAX_TIMEOUT_S = 600.0
_POLL_S = 0.05
_BUSY_WAIT_S = 2.0
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9][A-Za-z0-9-]{0,62})*$")


def validate(req: agent_pb2.MeasureAllReduceRequest) -> None:
    v.run_name(req.group_id, "group_id")
    v.integer(req.world_size, "world_size", low=2, high=MAX_WORLD)
    v.integer(req.rank, "rank", low=0, high=req.world_size - 1)
    if req.rank == 0:
        if req.master_addr or req.master_port:
            raise v.ValidationError(
                "master_addr, master_port: rank 0 chooses them (its own host, a free port); leave them unset"
            )
    else:
        _host(req.master_addr, "master_addr")
        v.integer(req.master_port, "master_port", low=1, high=65535)
    v.integer(req.size_bytes, "size_bytes", low=4, high=MAX_SIZE_BYTES)
    v.integer(req.iterations, "iterations", low=1, high=MAX_ITERATIONS)
    v.integer(req.warmup, "warmup", low=0, high=MAX_WARMUP)
    if not math.isfinite(req.timeout_s) or not 0 < req.timeout_s <= MAX_TIMEOUT_S:
        raise v.ValidationError(f"timeout_s: must be in (0, {MAX_TIMEOUT_S:g}], got {req.timeout_s!r}")


def _host(value: str, field: str) -> str:
    try:
        ipaddress.ip_address(value.strip("[]"))
    except ValueError:
        if not _HOSTNAME.match(value):
            raise v.ValidationError(f"{field}: not a host name or IP address: {value[:64]!r}") from None
    return value.strip("[]")


def serve(
    agent: Any,
    request: agent_pb2.MeasureAllReduceRequest,
    context: grpc.ServicerContext,
    require_admin: Callable[[grpc.ServicerContext], None],
) -> Iterator[agent_pb2.MeasureAllReduceResponse]:
    """The handler: access, validation, then the rank; timed; errors become a status, never a crash."""
    start = time.perf_counter()
    code = "OK"
    try:
        require_admin(context)
        validate(request)
        yield from _measure(agent, request, context)
    except v.ValidationError as exc:
        code = "INVALID_ARGUMENT"
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except Exception as exc:
        status = context.code()  # type: ignore[attr-defined]  # grpc-stubs lacks code()
        if status is not None and status != grpc.StatusCode.OK:
            code = status.name
            raise  # context.abort() already set the status
        code = "INTERNAL"
        log.exception("MeasureAllReduce failed")
        context.abort(grpc.StatusCode.INTERNAL, f"MeasureAllReduce: {type(exc).__name__}: {exc}"[:500])
    finally:
        agent.metrics.rpc_latency.labels(method="MeasureAllReduce", code=code).observe(
            time.perf_counter() - start
        )


def _measure(
    agent: Any, req: agent_pb2.MeasureAllReduceRequest, context: grpc.ServicerContext
) -> Iterator[agent_pb2.MeasureAllReduceResponse]:
    root = _project_root()
    if root is None or importlib.util.find_spec("torch") is None:
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"node {agent.config.node} cannot run an all-reduce: preflight.collective or torch is not installed",
        )
    host = _advertised_host(agent, context)
    _refuse_if_workers(agent, context)
    # A measurement that was just cancelled is still stopping its rank: wait for it briefly.
    if not agent.preflight_running.acquire(timeout=min(_BUSY_WAIT_S, req.timeout_s)):
        context.abort(
            grpc.StatusCode.ABORTED,
            f"node {agent.config.node} is busy: a preflight or an all-reduce is running",
        )
    try:
        _refuse_if_workers(agent, context)  # a launch may have landed in between
        agent.state_changed()
        with tempfile.TemporaryDirectory(prefix="runwarden-allreduce-") as tmp:
            yield from _run_rank(agent, req, context, host, root, Path(tmp))
    finally:
        agent.preflight_running.release()
        agent.state_changed()


def _refuse_if_workers(agent: Any, context: grpc.ServicerContext) -> None:
    running = [w for w in agent.launcher.workers() if w.running]
    if running:
        w = running[0]
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"workers of run {w.run!r} attempt {w.attempt} are running on node {agent.config.node}: "
            "an all-reduce now would compete with them for the network and the GPUs",
        )


def _advertised_host(agent: Any, context: grpc.ServicerContext) -> str:
    try:
        host = split_host_port(agent.advertise, "advertise")[0]
    except ConfigError as exc:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no advertised host to listen on: {exc}")
    if host in ("0.0.0.0", "::", ""):
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the advertised host {host!r} is a wildcard; peers cannot reach it (set advertise)",
        )
    return host


def _project_root() -> str | None:
    spec = importlib.util.find_spec("preflight.collective")
    return str(Path(spec.origin).resolve().parents[1]) if spec is not None and spec.origin else None


def _listen(host: str, backlog: int) -> socket.socket:
    """A socket listening on `host`, on a port the kernel chooses there."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def _run_rank(
    agent: Any,
    req: agent_pb2.MeasureAllReduceRequest,
    context: grpc.ServicerContext,
    host: str,
    root: str,
    tmp: Path,
) -> Iterator[agent_pb2.MeasureAllReduceResponse]:
    deadline = time.monotonic() + req.timeout_s
    listener = _listen(host, min(socket.SOMAXCONN, req.world_size + 8)) if req.rank == 0 else None
    master_addr = host if listener is not None else req.master_addr
    master_port = int(listener.getsockname()[1]) if listener is not None else req.master_port
    out, err_path = tmp / "result.json", tmp / "stderr"
    argv = [
        sys.executable,
        "-m",
        "preflight.collective",
        f"--rank={req.rank}",
        f"--world-size={req.world_size}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
        f"--bind-host={host}",
        f"--group={req.group_id}",
        f"--size-bytes={req.size_bytes}",
        f"--iterations={req.iterations}",
        f"--warmup={req.warmup}",
        f"--timeout={req.timeout_s}",
        f"--out={out}",
    ]
    if listener is not None:
        argv.append(f"--master-listen-fd={listener.fileno()}")
    env = {
        **os.environ,
        "RANK": str(req.rank),
        "WORLD_SIZE": str(req.world_size),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        **collective_env(agent.config.collective_ifname),
    }
    try:
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=tmp,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                pass_fds=(listener.fileno(),) if listener is not None else (),
                start_new_session=True,
            )
    finally:
        if listener is not None:
            listener.close()  # the rank holds its own copy now
    log.info(
        "all-reduce %s: rank %d/%d started (pid %d, master %s:%d)",
        req.group_id,
        req.rank,
        req.world_size,
        proc.pid,
        master_addr,
        master_port,
    )
    where = f"all-reduce {req.group_id}: rank {req.rank} of {req.world_size} on node {agent.config.node}"
    finished = False
    try:
        if req.rank == 0:
            yield agent_pb2.MeasureAllReduceResponse(
                master=agent_pb2.CollectiveMaster(addr=master_addr, port=master_port)
            )
        finished = _wait(proc, deadline, context)
    finally:  # also when the caller went away while the stream waited at the yield
        _kill(proc)
        if not finished and not context.is_active():
            log.info("%s: the caller went away; the rank was stopped", where)
    if not finished:
        if not context.is_active():
            return
        context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"{where} did not finish within {req.timeout_s:g} s (killed): {_tail(err_path)}",
        )
    result = _result(out) if req.rank == 0 else agent_pb2.AllReduceMeasurement()
    if result is None or (proc.returncode != 0 and not (req.rank == 0 and not result.correct)):
        context.abort(grpc.StatusCode.ABORTED, f"{where} exited {proc.returncode}: {_tail(err_path)}")
    assert result is not None  # context.abort() raised otherwise
    yield agent_pb2.MeasureAllReduceResponse(result=result)


def _wait(proc: subprocess.Popen[bytes], deadline: float, context: grpc.ServicerContext) -> bool:
    """True when the rank exited by itself; False at the deadline or when the caller went away."""
    while proc.poll() is None:
        if time.monotonic() >= deadline or not context.is_active():
            return False
        time.sleep(_POLL_S)
    return True


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - 4096))
            lines = fh.read().decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return "(no output)"
    return (lines[-1] if lines else "(no output)")[:300]


def _result(path: Path) -> agent_pb2.AllReduceMeasurement | None:
    """Rank 0's JSON result, checked field by field (None when absent or malformed)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        numbers = {k: float(data[k]) for k in ("time_s", "algbw_gbps", "busbw_gbps")}
        if not all(math.isfinite(x) and x >= 0 for x in numbers.values()):
            return None
        return agent_pb2.AllReduceMeasurement(
            world_size=int(data["world_size"]),
            backend=str(data["backend"])[:32],
            size_bytes=int(data["size_bytes"]),
            iterations=int(data["iterations"]),
            correct=data["correct"] is True,
            **numbers,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
