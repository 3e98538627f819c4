"""The contract every scheduler backend implements (local, Slurm, Kubernetes).

The supervisor decides *what* to do; a backend only knows *how* on one kind of cluster:

* ``allocate(nodes, spares)`` -- hold ``nodes + spares`` machines; spares sit inside the
  allocation so a replacement takes a minute, not a trip back through the queue.
* ``launch(spec)`` -- start one attempt on exactly ``spec.nodes``; every rank of the attempt
  rendezvouses under ``spec.rendezvous_id`` (``<run>-<attempt>``) and in-place restarts are off.
* ``stop(handle, grace_s)`` -- ask the attempt to end (SIGTERM), kill it after ``grace_s``.
* ``status(handle)`` -- what the scheduler knows: running, exited (code, signal), which of the
  attempt's nodes it considers dead. Never blocks for long; never raises for a finished attempt.
* ``quarantine(node, reason)`` / ``release(node)`` -- keep a node out of future placements and
  let it back in. ``release`` only undoes runwarden's own quarantine, never an operator's.

Every method raises :class:`BackendError` (one-line message) when the scheduler refuses or
cannot be reached; nothing else escapes. Backends hold no supervisor policy.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from runwarden import launch
from runwarden.names import check_name

# Run names end up in rendezvous ids, Slurm job names, Kubernetes object names and file paths:
# keep them to what all of those accept (a DNS-1123 label is the strictest of them).
_RUN_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class BackendError(Exception):
    """A scheduler refused a request, timed out, or answered something we could not parse."""


def validate_run_name(run: str) -> str:
    if not _RUN_NAME.match(run):
        raise BackendError(f"bad run name {run!r}: lowercase letters, digits and '-', at most 42")
    return run


def validate_node_name(node: str) -> str:
    if not _NODE_NAME.match(node):
        raise BackendError(f"bad node name {node!r}")
    return node


@dataclass(frozen=True, slots=True, kw_only=True)
class Allocation:
    """Machines held for a run: ``nodes`` (active + spares) in the scheduler's order."""

    id: str  # the scheduler's handle: a Slurm job id, a JobSet name, "local"
    nodes: tuple[str, ...]

    def __post_init__(self) -> None:
        for node in self.nodes:
            validate_node_name(node)
        if len(set(self.nodes)) != len(self.nodes):
            raise BackendError(f"allocation {self.id} lists a node twice: {self.nodes}")


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptSpec:
    """One attempt of a run, as the supervisor decided it.

    ``command`` is the full argv each rank runs (e.g. ``python train.py``); the backend wraps
    it in its launcher (``torchrun`` with ``--max-restarts=0``) -- see
    :func:`torchrun_argv`. ``resume_step`` is the last *committed* checkpoint step, -1 for none.
    """

    run: str
    attempt: int
    nodes: tuple[str, ...]
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    resume_step: int = -1
    procs_per_node: int = 1  # Slurm, Kubernetes; the local backend's agents each use their own local_ranks
    leader_fence: int = 0  # the leader's election fence; an agent refuses a launch from an older leader
    cold: bool = False  # agents go cold even where a parked group is ready (the local backend)
    launched_at: float = 0.0  # the controller's wall clock at the launch (the attempt record's)

    def __post_init__(self) -> None:
        # The one name rule (runwarden.names); a scheduler with a stricter one (a Kubernetes object
        # name, a Slurm job name) applies it in its own launch: `validate_run_name`, `validate_node_name`.
        try:
            check_name("AttemptSpec.run", self.run)
            for node in self.nodes:
                check_name("AttemptSpec.nodes", node)
        except ValueError as exc:
            raise BackendError(str(exc)) from None
        if self.attempt < 0:
            raise BackendError(f"attempt must be >= 0, got {self.attempt}")
        if not self.nodes:
            raise BackendError("an attempt needs at least one node")
        if len(set(self.nodes)) != len(self.nodes):
            raise BackendError(f"attempt lists a node twice: {self.nodes}")
        if not self.command or any(not isinstance(a, str) or "\0" in a for a in self.command):
            raise BackendError("command must be a non-empty argv of strings without NUL")
        if self.resume_step < -1:
            raise BackendError(f"resume_step must be >= -1, got {self.resume_step}")
        if self.procs_per_node < 1:
            raise BackendError(f"procs_per_node must be >= 1, got {self.procs_per_node}")
        if self.leader_fence < 0:
            raise BackendError(f"leader_fence must be >= 0, got {self.leader_fence}")
        for key, value in self.env.items():
            if not _ENV_NAME.match(key) or "\0" in value:
                raise BackendError(f"bad environment entry {key!r}")
        # Freeze the environment too: a spec is a value, shared between threads.
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))

    @property
    def rendezvous_id(self) -> str:
        return f"{self.run}-{self.attempt}"


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeStarted:
    """How one node started its ranks, as its agent said (LaunchWorkersResponse.launch_path/detail)."""

    node: str
    path: str  # "warm" | "cold" | "" (the agent did not say)
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptHandle:
    """What ``launch`` returns: the spec plus the backend's reference to the running thing."""

    spec: AttemptSpec
    ref: str  # e.g. "slurm:1234.5", "jobset:default/run-3"
    started: tuple[NodeStarted, ...] = ()  # per node, when the backend launches through the agents


class AttemptState(enum.Enum):
    PENDING = "pending"  # accepted, not running yet (queued, pods scheduling)
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # every rank exited 0 (a clean stop ends here too)
    FAILED = "failed"  # some rank failed or the scheduler killed the attempt
    STOPPED = "stopped"  # ended by our own ``stop``
    UNKNOWN = "unknown"  # the scheduler no longer knows it (purged, lost)

    @property
    def finished(self) -> bool:
        return self in (AttemptState.SUCCEEDED, AttemptState.FAILED, AttemptState.STOPPED)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptStatus:
    state: AttemptState
    exit_code: int | None = None  # of the launcher process (srun, the JobSet's leader), if known
    signal: int | None = None
    failed_nodes: tuple[str, ...] = ()  # nodes of the attempt the scheduler reports down
    detail: str = ""  # one line for the event log, e.g. "node2 not responding"


@runtime_checkable
class Backend(Protocol):
    """What the supervisor's shell calls. Implementations: local, slurm, kubernetes."""

    name: str

    def allocate(self, nodes: int, spares: int) -> Allocation: ...

    def launch(self, spec: AttemptSpec) -> AttemptHandle: ...

    def stop(self, handle: AttemptHandle, grace_s: float) -> AttemptStatus: ...

    def status(self, handle: AttemptHandle) -> AttemptStatus: ...

    def quarantine(self, node: str, reason: str) -> None: ...

    def release(self, node: str) -> bool:
        """Undo runwarden's quarantine; False (and nothing changed) if the node is held by someone else."""
        ...


def torchrun_argv(
    spec: AttemptSpec,
    *,
    endpoint: str,
    torchrun: tuple[str, ...] = ("torchrun",),
    node_rank: int | None = None,
    no_python: bool = True,
) -> list[str]:
    """The launcher line of a backend that starts torchrun itself (`runwarden.launch.torchrun_argv`,
    the one rule the node agent follows too): one rendezvous per attempt, no in-place restarts.

    node_rank: given when the backend starts each node's torchrun itself: ``--node-rank`` and node
    rank 0 hosting the c10d store (``--rdzv-conf=is_host=true``). None when the scheduler starts the
    same line on every node (srun, a JobSet) and torchrun ranks the nodes at the rendezvous. (The
    local backend does neither: each agent builds its own node's line from a structured launch.)
    no_python: ``spec.command`` is a full argv with its own interpreter (``--no-python``); False when
    it starts at a script that torchrun runs with its own interpreter.
    """
    return launch.torchrun_argv(
        prefix=torchrun,
        nnodes=len(spec.nodes),
        nproc_per_node=spec.procs_per_node,
        endpoint=endpoint,
        rdzv_id=spec.rendezvous_id,
        command=spec.command,
        node_rank=node_rank,
        is_host=None if node_rank is None else node_rank == 0,
        no_python=no_python,
    )


def attempt_env(spec: AttemptSpec, *, node: str | None = None) -> dict[str, str]:
    """Environment every rank of an attempt gets on top of ``spec.env``.

    node: the node these ranks run on, when the backend launches each node on its own (the local
    backend); a scheduler that starts one line everywhere leaves it out.
    """
    return {
        **spec.env,
        "RUNWARDEN_RUN": spec.run,
        "RUNWARDEN_ATTEMPT": str(spec.attempt),
        "RUNWARDEN_RENDEZVOUS_ID": spec.rendezvous_id,
        "RUNWARDEN_RESUME_STEP": str(spec.resume_step),
        **({"RUNWARDEN_NODE": node} if node is not None else {}),
        # Fail fast on a dead peer instead of hanging for the collective timeout.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }


# --- the scheduler half, in the live shell ------------------------------------------------------
#
# Every backend places one node agent per node -- a systemd unit (agents), an `srun` task of the
# allocation (slurm), a pod of the allocation's JobSet (kubernetes), an actor of a STRICT_SPREAD
# placement group (ray) -- and the agents place the ranks (controller/backends/local.py, the
# structured torchrun launch). So every backend's ranks get the same contract from one attempt
# environment (agent socket, stop file, flight-recorder directory, `<run>-<attempt>`,
# `--max-restarts=0`), and the supervisor core sees the same events on every backend. What a
# scheduler adds is where the nodes come from and how a node is kept out: `Scheduler`.


class RunOutcome(enum.Enum):
    """How a run ended, as the scheduler is told (and `controller run`'s exit code says)."""

    COMPLETED = "completed"  # every rank exited 0 at the end of training
    STOPPED = "stopped"  # a planned stop that ends the run (time limit, preemption): requeue it
    FAILED = "failed"  # crash loop, exhausted restart budget: do not requeue

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self]


# The exit code contract of `controller run --exit-when-done` (and of a batch script that runs it):
# 0 done, 75 (EX_TEMPFAIL) "stopped cleanly, requeue me", 3 "failed: do not requeue".
EXIT_COMPLETED, EXIT_REQUEUE, EXIT_DO_NOT_REQUEUE = 0, 75, 3
EXIT_CODES = {
    RunOutcome.COMPLETED: EXIT_COMPLETED,
    RunOutcome.STOPPED: EXIT_REQUEUE,
    RunOutcome.FAILED: EXIT_DO_NOT_REQUEUE,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeRequest:
    """An ask to the queue for more nodes (the core's `AllocateFromQueue`). The nodes join the run
    when their agents register in etcd; nothing waits for them here."""

    id: str  # the scheduler's handle: "slurm:1234", a JobSet name, a placement group id
    count: int
    submitted_at: float


@runtime_checkable
class Scheduler(Protocol):
    """What the live shell calls for the nodes themselves. Implementations: `StaticFleet` (agents),
    Slurm, Ray, Kubernetes. Every method raises `BackendError` (one line) and nothing else; the shell
    runs them off its loop and reports a failure as `ActionFailed` (a quarantine that did not reach
    the scheduler is still a quarantine in the pool, persisted in etcd)."""

    name: str

    def allocate(self, nodes: int, spares: int) -> Allocation:
        """Hold ``nodes + spares`` machines with one agent on each (spares inside the allocation).
        Returns once the scheduler granted them; the agents register by themselves."""
        ...

    def request_nodes(self, count: int, *, exclude: tuple[str, ...], reason: str) -> NodeRequest:
        """Ask the queue for ``count`` more machines (never one of ``exclude``), agents on them."""
        ...

    def quarantine(self, node: str, reason: str) -> None:
        """Keep the node out of future placements with runwarden's own mark (never an operator's)."""
        ...

    def release(self, node: str) -> bool:
        """Undo runwarden's quarantine; False (and nothing changed) if someone else holds the node."""
        ...

    def check_stop_fits(self, save_commit_s: float) -> None:
        """Before a launch: raise `BackendError` if the scheduler's notice before a kill (a pod's
        termination grace period, a preemption grace time) cannot fit the observed checkpoint save
        plus commit (``save_commit_s``, 0 when none was seen yet)."""
        ...

    def finish(self, outcome: RunOutcome) -> None:
        """The run is over: give back what `allocate` and `request_nodes` hold."""
        ...


class StaticFleet:
    """`backend = "agents"`: a fleet of agents started by systemd, and no scheduler. Nodes come and go
    as their agents do; the pool (in etcd) is the only quarantine; there is no queue to ask."""

    name = "agents"

    def allocate(self, nodes: int, spares: int) -> Allocation:
        return Allocation(id="static", nodes=())

    def request_nodes(self, count: int, *, exclude: tuple[str, ...], reason: str) -> NodeRequest:
        raise BackendError(
            f"the agents backend has no queue to ask for {count} node(s): start an agent on a new host"
        )

    def quarantine(self, node: str, reason: str) -> None:
        return None

    def release(self, node: str) -> bool:
        return True

    def check_stop_fits(self, save_commit_s: float) -> None:
        return None

    def finish(self, outcome: RunOutcome) -> None:
        return None
