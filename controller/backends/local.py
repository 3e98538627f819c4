"""The local backend: a static fleet of node agents, one per host, and no scheduler.

Nodes join by starting an agent (its lease registers it in etcd) and leave when it stops; nothing
is allocated, drained or released here. `LocalBackend` starts and stops attempts through the agents'
RPCs with a structured launch, so each agent builds its own torchrun line with the rule every
backend uses (`runwarden.launch.torchrun_argv`); nothing about the launch is chosen on the
controller's host. The live controller launches through it on every backend.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from controller.backends.agents import AgentClients, RpcOutcome
from controller.backends.base import (
    Allocation,
    AttemptHandle,
    AttemptSpec,
    AttemptState,
    AttemptStatus,
    BackendError,
    NodeStarted,
    attempt_env,
)
from runwarden import launch as launch_rule
from runwarden.v1 import agent_pb2

SCRIPT_MODES = {
    "instrumented": agent_pb2.SCRIPT_MODE_INSTRUMENTED,
    "unmodified": agent_pb2.SCRIPT_MODE_UNMODIFIED,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalConfig:
    """no_python: the command is a full argv with its own interpreter (its argv[0] must be allowed by
    every agent); by default it starts at the training script, which torchrun runs with the agent's
    interpreter. script_mode: "instrumented" (the script calls nodeagent.trainer) or "unmodified"
    (no runwarden calls: each agent runs it through nodeagent.trainer.bootstrap)."""

    rpc_timeout_s: float = 10.0
    # A launch may wait for a node's parked warm group that is still importing (the agent waits at
    # most its warm_wait_s, 30 s by default, and never past this deadline): a host whose rank
    # crashed seconds after a launch starts the next attempt on its standby group, which parks in
    # ~3 s on a quiet host and took 15.5 s on 2 loaded cores; refused at 10 s, that launch counted
    # as the node's second failure and quarantined a healthy node.
    launch_timeout_s: float = 40.0
    no_python: bool = False
    script_mode: str = "instrumented"

    def __post_init__(self) -> None:
        if not self.rpc_timeout_s > 0:
            raise BackendError(f"local backend: rpc_timeout_s must be > 0, got {self.rpc_timeout_s}")
        if not self.launch_timeout_s > 0:
            raise BackendError(f"local backend: launch_timeout_s must be > 0, got {self.launch_timeout_s}")
        if self.script_mode not in SCRIPT_MODES:
            raise BackendError(
                f"local backend: script_mode must be one of {', '.join(SCRIPT_MODES)}, got {self.script_mode!r}"
            )
        if self.script_mode == "unmodified" and self.no_python:
            raise BackendError(
                "local backend: an unmodified script cannot be no_python (it runs through the bootstrap)"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Rendezvous:
    """Where a node hosts torchrun's c10d store as node rank 0 (from its node record)."""

    host: str
    port: int

    @property
    def endpoint(self) -> str:
        return launch_rule.endpoint(self.host, self.port)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLaunchFailure:
    node: str
    temporary: bool  # the agent could not be reached in time (it may answer later)
    reason: str


class LaunchIncomplete(BackendError):
    """Some nodes of the attempt did not start their workers; the others did."""

    def __init__(self, handle: AttemptHandle, failures: tuple[NodeLaunchFailure, ...]) -> None:
        super().__init__("; ".join(f"{f.node}: {f.reason}" for f in failures))
        self.handle = handle
        self.failures = failures


class LocalBackend:
    """Starts and stops attempts on the nodes' agents.

    `launch` sends each node a structured launch (`LaunchWorkersRequest.torchrun`): the command, the
    attempt's environment with the node's name (`attempt_env`), the node count and the node's rank, and the
    rendezvous endpoint; each agent builds its own torchrun line from its own config (its interpreter,
    its ranks per node, its advertised host, its collective interface) with the same rule the other
    backends use (`runwarden.launch.torchrun_argv`).

    Nothing about the launch is chosen on the controller's host. The rendezvous lives where torchrun
    hosts it: node rank 0's c10d store, at the host and port that node's agent reported in its node
    record (`rendezvous`, the live shell's view of the records). A spare that replaces node rank 0
    brings its own. No known rendezvous for node rank 0 is a `BackendError`: nothing is launched.

    Every node's call is sent at once, on the agent clients' loop (controller/backends/agents.py), which
    retries temporary RPC failures within the launch deadline.
    A node that still did not start is reported in `LaunchIncomplete`, with whether its failure was
    temporary; the other nodes of the attempt keep running (the supervisor decides what happens to
    them, as when a node's workers exit at once).
    """

    name = "local"

    def __init__(
        self,
        agents: AgentClients,
        rendezvous: Callable[[str], Rendezvous | None],
        config: LocalConfig | None = None,
    ) -> None:
        self.agents = agents
        self.rendezvous = rendezvous  # node -> where it hosts the store (its node record), or None
        self.config = config or LocalConfig()

    def allocate(self, nodes: int, spares: int) -> Allocation:
        raise BackendError("the local fleet is static: a node joins when its agent starts")

    def endpoint(self, spec: AttemptSpec) -> str:
        """The attempt's rendezvous: node rank 0's reported host and port."""
        head = spec.nodes[0]
        rdzv = self.rendezvous(head)
        if rdzv is None:
            raise BackendError(
                f"node rank 0 ({head}) reported no rendezvous address and port in its node record "
                "(an agent too old for structured launches, or the node is gone)"
            )
        return rdzv.endpoint

    def requests(
        self,
        spec: AttemptSpec,
        *,
        endpoint: str,
        stop_older: Mapping[str, agent_pb2.StopOlder] | None = None,
    ) -> list[tuple[str, agent_pb2.LaunchWorkersRequest]]:
        """Each node's launch request; node rank = the node's place in `spec.nodes`; `stop_older`:
        the nodes whose launch stops the older attempt first (LaunchWorkersRequest.stop_older)."""
        stop_older = stop_older or {}
        return [
            (
                node,
                agent_pb2.LaunchWorkersRequest(
                    run=spec.run,
                    attempt=spec.attempt,
                    rendezvous_id=spec.rendezvous_id,
                    env=attempt_env(spec, node=node),
                    node_rank=rank,
                    nnodes=len(spec.nodes),
                    resume_step=spec.resume_step,
                    leader_fence=spec.leader_fence,
                    launched_at=spec.launched_at,
                    torchrun=agent_pb2.TorchrunLaunch(
                        command=list(spec.command),
                        rdzv_endpoint=endpoint,
                        is_host=rank == 0,
                        no_python=self.config.no_python,
                        script_mode=SCRIPT_MODES[self.config.script_mode],
                        peers=[
                            a
                            for n in launch_rule.liveness_peers(spec.nodes, rank)
                            if (a := self.agents.address(n))
                        ],
                        cold=spec.cold,
                    ),
                    stop_older=stop_older.get(node),
                ),
            )
            for rank, node in enumerate(spec.nodes)
        ]

    def launch(
        self,
        spec: AttemptSpec,
        *,
        after: Callable[[str], Awaitable[None]] | None = None,
        stop_older: Mapping[str, agent_pb2.StopOlder] | None = None,
    ) -> AttemptHandle:
        """Start the attempt on every node at once (each once `after(node)` has returned: the
        executor's wait for the node's stop in flight; a node in `stop_older` stops the older
        attempt itself first, within the same call); raises `LaunchIncomplete` naming the nodes
        that did not start, or `BackendError` (nothing started) when node rank 0 reported no
        rendezvous."""
        reqs = self.requests(spec, endpoint=self.endpoint(spec), stop_older=stop_older)
        launch_s = max(self.config.launch_timeout_s, self.config.rpc_timeout_s)

        async def launch_one(
            node: str, req: agent_pb2.LaunchWorkersRequest
        ) -> tuple[RpcOutcome, agent_pb2.LaunchWorkersResponse | None]:
            if after is not None:
                await after(node)
            stopping = req.stop_older.grace_s + req.stop_older.park_within_s  # 0 when unset
            return await self.agents.launch_async(node, req, launch_s + stopping)  # its deadline from here

        answers = self.agents.gather(launch_one(n, r) for n, r in reqs)
        started = tuple(
            NodeStarted(
                node=o.node,
                path=resp.launch_path if resp is not None else "",
                detail=resp.launch_detail
                if resp is not None
                else "its launch answer was lost (a retry found it running)",
            )
            for o, resp in answers
            if o.ok
        )
        handle = AttemptHandle(spec=spec, ref=f"local:{spec.rendezvous_id}", started=started)
        failures = tuple(
            NodeLaunchFailure(node=o.node, temporary=o.temporary, reason=o.error)
            for o, _ in answers
            if not o.ok
        )
        if failures:
            raise LaunchIncomplete(handle, failures)
        return handle

    def stop(self, handle: AttemptHandle, grace_s: float) -> AttemptStatus:
        """SIGTERM every node's workers of the attempt, SIGKILL after `grace_s` (the agent does both)."""
        spec = handle.spec
        req = agent_pb2.StopWorkersRequest(run=spec.run, attempt=spec.attempt, grace_s=grace_s)
        outcomes = self.agents.gather(
            self.agents.stop_async(n, req, grace_s + self.config.rpc_timeout_s) for n in spec.nodes
        )
        failed = tuple(o.node for o in outcomes if not o.ok)
        return AttemptStatus(
            state=AttemptState.UNKNOWN if failed else AttemptState.STOPPED,
            failed_nodes=failed,
            detail="; ".join(f"{o.node}: {o.error}" for o in outcomes if not o.ok),
        )

    def status(self, handle: AttemptHandle) -> AttemptStatus:
        """Running while any node runs a worker of the attempt; an agent that does not answer is a failed node."""
        spec = handle.spec
        running, unreachable = False, []
        for node in spec.nodes:
            _, resp = self.agents.status(node, timeout_s=2.0)
            if resp is None:
                unreachable.append(node)
                continue
            running |= any(
                w.run == spec.run and w.attempt == spec.attempt and w.running for w in resp.workers
            )
        state = AttemptState.RUNNING if running else AttemptState.UNKNOWN
        return AttemptStatus(state=state, failed_nodes=tuple(unreachable))

    def quarantine(self, node: str, reason: str) -> None:
        """Nothing to tell: the pool entry in etcd keeps the node out of placements."""

    def release(self, node: str) -> bool:
        return True
