"""The Slurm backend: one allocation of N + S nodes, one ``srun`` job step per attempt.

Why one long allocation with spares inside it: replacing a node from a spare that is already
ours takes a job step launch (about a second here, a minute with a real image); going back to
the queue can take hours. The allocation is submitted with ``--no-kill`` so that a node dying
shrinks it instead of ending it (Slurm then relinquishes the dead node and keeps the rest).

Each attempt is ``srun --kill-on-bad-exit=1 --nodelist=<the N chosen> ... torchrun ...`` with a
rendezvous id of ``<run>-<attempt>``; the srun process is our child, so its exit code is the
attempt's. Quarantine is a Slurm DRAIN whose reason starts with ``runwarden:`` -- the mark that
lets ``release`` resume our own drains and never an operator's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from controller.backends.base import (
    Allocation,
    AttemptHandle,
    AttemptSpec,
    AttemptState,
    AttemptStatus,
    BackendError,
    attempt_env,
    torchrun_argv,
    validate_node_name,
    validate_run_name,
)
from controller.backends.slurm_cli import NodeInfo, SlurmCli, check_job_id, parse_sbatch_parsable

REASON_PREFIX = "runwarden:"
_MAX_REASON = 200


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmConfig:
    slurm_conf: str | None = None  # SLURM_CONF for every command; None: Slurm's default
    bin_dir: str | None = None  # where sbatch/srun/... live; None: PATH
    job_id: str | None = (
        None  # run inside this existing allocation (e.g. $SLURM_JOB_ID) instead of submitting
    )
    job_name: str = "runwarden"
    partition: str | None = None
    time_limit: str | None = None  # sbatch --time, e.g. "24:00:00"
    exclusive: bool = True
    command_timeout_s: float = 30.0
    allocate_timeout_s: float = 600.0
    rdzv_port: int = 29500  # the attempt's port is rdzv_port + attempt % rdzv_port_span
    rdzv_port_span: int = 100
    torchrun: tuple[str, ...] = ("torchrun",)
    log_dir: str = "."  # one <rendezvous id>.log per attempt (srun's stdout and stderr)

    def __post_init__(self) -> None:
        if self.job_id is not None:
            check_job_id(self.job_id)
        if not 1024 <= self.rdzv_port <= 65535 - self.rdzv_port_span or self.rdzv_port_span < 1:
            raise BackendError(f"bad rendezvous port range {self.rdzv_port}+{self.rdzv_port_span}")
        if self.command_timeout_s <= 0 or self.allocate_timeout_s <= 0:
            raise BackendError("timeouts must be positive")
        if not self.torchrun:
            raise BackendError("torchrun argv must not be empty")


def reason_text(reason: str) -> str:
    """``runwarden: <evidence>`` on one line, short enough for Slurm's reason field."""
    one_line = " ".join(reason.split())
    return f"{REASON_PREFIX} {one_line}"[:_MAX_REASON]


class SlurmBackend:
    name = "slurm"

    def __init__(self, config: SlurmConfig):
        self.config = config
        self.cli = SlurmCli(
            slurm_conf=config.slurm_conf, bin_dir=config.bin_dir, timeout_s=config.command_timeout_s
        )
        self._allocation: Allocation | None = None
        self._submitted = False  # True when we submitted the holding job (and so cancel it on close)
        self._lock = threading.Lock()
        self._sruns: dict[str, subprocess.Popen[bytes]] = {}
        self._stopped: set[str] = set()

    # ---- allocation ------------------------------------------------------------------------------

    def allocate(self, nodes: int, spares: int) -> Allocation:
        if nodes < 1 or spares < 0:
            raise BackendError(f"need nodes >= 1 and spares >= 0, got {nodes}+{spares}")
        job_id = self.config.job_id or self._submit_holding_job(nodes + spares)
        nodelist = self._wait_running(job_id)
        held = self.cli.hostnames(nodelist)
        if len(held) < nodes + spares:
            raise BackendError(f"allocation {job_id} has {len(held)} nodes, need {nodes}+{spares}")
        self._allocation = Allocation(id=job_id, nodes=tuple(held))
        return self._allocation

    def _submit_holding_job(self, count: int) -> str:
        args = [
            "--parsable",
            f"--job-name={self.config.job_name}",
            f"--nodes={count}",
            "--ntasks-per-node=1",
            "--no-kill",  # a dead node shrinks the allocation instead of ending it
            "--no-requeue",
            "--output=/dev/null",
        ]
        if self.config.exclusive:
            args.append("--exclusive")
        if self.config.partition:
            args.append(f"--partition={self.config.partition}")
        if self.config.time_limit:
            args.append(f"--time={self.config.time_limit}")
        # The holding job only keeps the nodes; attempts are job steps inside it.
        args.append("--wrap=exec sleep infinity")
        job_id = parse_sbatch_parsable(self.cli.run("sbatch", args))
        self._submitted = True
        return job_id

    def _wait_running(self, job_id: str) -> str:
        deadline = time.monotonic() + self.config.allocate_timeout_s
        while True:
            state = self.cli.job_state(job_id)
            if state is not None and state[0] == "RUNNING":
                return state[1]
            if state is None or state[0] in ("FAILED", "CANCELLED", "TIMEOUT", "COMPLETED", "NODE_FAIL"):
                raise BackendError(f"allocation {job_id} is {state[0] if state else 'gone'}")
            if time.monotonic() > deadline:
                raise BackendError(
                    f"allocation {job_id} still {state[0]} after {self.config.allocate_timeout_s:.0f}s"
                )
            time.sleep(0.5)

    def allocation(self) -> Allocation:
        """The allocation as Slurm sees it now (a dead node has left it)."""
        if self._allocation is None:
            raise BackendError("no allocation: call allocate() first")
        state = self.cli.job_state(self._allocation.id)
        if state is None or state[0] != "RUNNING":
            raise BackendError(f"allocation {self._allocation.id} is {state[0] if state else 'gone'}")
        return Allocation(id=self._allocation.id, nodes=tuple(self.cli.hostnames(state[1])))

    def close(self) -> None:
        """Stops every attempt we launched and cancels the holding job if we submitted it."""
        with self._lock:
            rdzv_ids = list(self._sruns)
        for rdzv in rdzv_ids:
            with contextlib.suppress(BackendError):
                self._terminate(rdzv, grace_s=2.0)
        if self._allocation is not None and self._submitted:
            with contextlib.suppress(BackendError):
                self.cli.run("scancel", [self._allocation.id])
        self._allocation = None

    # ---- attempts --------------------------------------------------------------------------------

    def launch(self, spec: AttemptSpec) -> AttemptHandle:
        validate_run_name(spec.run)  # it becomes the job name and a path segment
        if self._allocation is None:
            raise BackendError("no allocation: call allocate() first")
        outside = [n for n in spec.nodes if n not in self._allocation.nodes]
        if outside:
            raise BackendError(f"nodes {outside} are not in allocation {self._allocation.id}")
        with self._lock:
            if spec.rendezvous_id in self._sruns:
                raise BackendError(f"attempt {spec.rendezvous_id} was already launched")
        ordered = self.cli.hostnames(",".join(spec.nodes))
        head = self.cli.nodes([ordered[0]]).get(ordered[0])
        if head is None:
            raise BackendError(f"sinfo does not know head node {ordered[0]}")
        port = self.config.rdzv_port + spec.attempt % self.config.rdzv_port_span
        argv = [
            self.cli.binary("srun"),
            f"--jobid={self._allocation.id}",
            f"--job-name={spec.rendezvous_id}",  # names the step, so it can be found again
            f"--nodes={len(ordered)}",
            f"--ntasks={len(ordered)}",
            "--ntasks-per-node=1",
            f"--nodelist={','.join(ordered)}",
            "--kill-on-bad-exit=1",
            # A step that had a node die stays "ending" in slurmctld for a minute or more and keeps
            # its CPUs on the live nodes; without --overlap the next attempt would queue behind it.
            "--overlap",
            "--export=ALL",
            *torchrun_argv(spec, endpoint=f"{head.address}:{port}", torchrun=self.config.torchrun),
        ]
        env = {**self.cli.env, **attempt_env(spec)}
        log_path = os.path.join(self.config.log_dir, f"{spec.rendezvous_id}.log")
        try:
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as exc:
            raise BackendError(f"cannot start srun: {exc.strerror}") from None
        with self._lock:
            self._sruns[spec.rendezvous_id] = proc
        return AttemptHandle(spec=spec, ref=f"slurm:{self._allocation.id}:{spec.rendezvous_id}")

    def status(self, handle: AttemptHandle) -> AttemptStatus:
        spec = handle.spec
        dead = self._dead_nodes(spec.nodes)
        detail = "; ".join(f"{n.name} {n.state}" for n in dead)
        failed = tuple(n.name for n in dead)
        with self._lock:
            proc = self._sruns.get(spec.rendezvous_id)
            stopped = spec.rendezvous_id in self._stopped
        if proc is None:
            return AttemptStatus(
                state=AttemptState.UNKNOWN, failed_nodes=failed, detail=detail or "not launched here"
            )
        rc = proc.poll()
        if rc is None:
            return AttemptStatus(state=AttemptState.RUNNING, failed_nodes=failed, detail=detail)
        sig = -rc if rc < 0 else None
        code = rc if rc >= 0 else None
        if stopped:
            state = AttemptState.STOPPED
        elif rc == 0:
            state = AttemptState.SUCCEEDED
        else:
            state = AttemptState.FAILED
        return AttemptStatus(state=state, exit_code=code, signal=sig, failed_nodes=failed, detail=detail)

    def _dead_nodes(self, names: tuple[str, ...]) -> list[NodeInfo]:
        infos = self.cli.nodes(names)
        return [infos[n] for n in names if n in infos and infos[n].dead]

    def stop(self, handle: AttemptHandle, grace_s: float) -> AttemptStatus:
        with self._lock:
            self._stopped.add(handle.spec.rendezvous_id)
        self._terminate(handle.spec.rendezvous_id, grace_s=grace_s)
        return self.status(handle)

    def _terminate(self, rdzv: str, *, grace_s: float) -> None:
        """SIGTERM to the step's tasks, cancel after ``grace_s``, then make sure srun is gone."""
        with self._lock:
            proc = self._sruns.get(rdzv)
        if proc is None or proc.poll() is not None:
            return
        alloc = self._allocation.id if self._allocation else None
        step = self.cli.steps(alloc).get(rdzv) if alloc else None
        if step is not None:
            # Fails with "Communication connection failure" when one node of the step is dead;
            # the live nodes still get the signal.
            with contextlib.suppress(BackendError):
                self.cli.run("scancel", ["--signal=TERM", step])
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
            return
        if step is not None:
            with contextlib.suppress(BackendError):
                self.cli.run("scancel", [step])
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
            return
        # srun itself is stuck (e.g. waiting on a dead node): end it; Slurm reaps the step.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5.0)

    # ---- node health -----------------------------------------------------------------------------

    def quarantine(self, node: str, reason: str) -> None:
        """DRAIN with ``runwarden: <evidence>``; an operator's existing drain is left as it is."""
        info = self._node(node)
        if info.drained and not info.reason.startswith(REASON_PREFIX):
            return  # already out, and the operator's reason is the one to keep
        self.cli.run(
            "scontrol", ["update", f"NodeName={node}", "State=DRAIN", f"Reason={reason_text(reason)}"]
        )

    def release(self, node: str) -> bool:
        """RESUME a node only if runwarden drained it; False if someone else holds it."""
        info = self._node(node)
        if not info.drained:
            return True
        if not info.reason.startswith(REASON_PREFIX):
            return False
        self.cli.run("scontrol", ["update", f"NodeName={node}", "State=RESUME"])
        return True

    def node(self, node: str) -> NodeInfo:
        return self._node(node)

    def _node(self, node: str) -> NodeInfo:
        validate_node_name(node)
        info = self.cli.nodes([node]).get(node)
        if info is None:
            raise BackendError(f"Slurm does not know node {node}")
        return info
