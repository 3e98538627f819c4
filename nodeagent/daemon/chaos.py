"""Fault injection for drills and demos; the servicer refuses it unless `chaos_enabled`.

Signals go only to processes inside a tree this agent launched: chaos never kills a stranger.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import grpc

from runwarden.v1 import agent_pb2

log = logging.getLogger(__name__)


class ChaosError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _rank_pid(agent: Any, local_rank: int) -> int:
    pid = agent.progress.pid_of_local_rank(local_rank)
    if pid is None:
        raise ChaosError(grpc.StatusCode.NOT_FOUND, f"local rank {local_rank} has not reported a pid")
    if not agent.launcher.owns(pid):
        raise ChaosError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"pid {pid} of local rank {local_rank} is not in a worker tree this agent launched",
        )
    return pid


def inject(agent: Any, req: agent_pb2.InjectFaultRequest) -> str:
    kind = req.kind
    if kind in (agent_pb2.FAULT_KIND_KILL_RANK, agent_pb2.FAULT_KIND_STOP_RANK):
        pid = _rank_pid(agent, req.local_rank)
        sig = signal.SIGKILL if kind == agent_pb2.FAULT_KIND_KILL_RANK else signal.SIGSTOP
        os.kill(pid, sig)
        detail = f"sent {sig.name} to local rank {req.local_rank} (pid {pid})"
    elif kind == agent_pb2.FAULT_KIND_SLOW_RANK:
        if req.value > 0:
            agent.slow_s[req.local_rank] = req.value
        else:
            agent.slow_s.pop(req.local_rank, None)
        detail = f"local rank {req.local_rank} sleeps {req.value:g} s per step"
    elif kind == agent_pb2.FAULT_KIND_XID:
        evidence = agent.xid.feed(req.line, "chaos")
        if evidence is None:
            raise ChaosError(
                grpc.StatusCode.INVALID_ARGUMENT, "line: not an Xid line (NVRM: Xid (PCI:...): N, ...)"
            )
        detail = f"fed Xid {evidence.xid} to the monitor"
    elif kind == agent_pb2.FAULT_KIND_KILL_AGENT:
        # After the response is on its way; the lease is not revoked, so it expires like a crash.
        threading.Timer(0.2, os._exit, args=(137,)).start()
        detail = "the agent exits in 0.2 s without releasing its lease"
    else:
        raise ChaosError(grpc.StatusCode.INVALID_ARGUMENT, f"kind: unknown fault {kind}")
    log.warning("chaos: %s", detail)
    return detail
