"""The Slurm scheduler: allocations whose batch script starts one node agent per node.

Every backend places one node agent per node and the agents place the ranks (the structured
torchrun launch through agent RPCs, controller/backends/local.py); Slurm only decides where the
agents run and keeps bad nodes out. `SlurmScheduler` is the `Scheduler` (controller/backends/base.py)
the live controller calls; it never resumes an operator's drain.
"""

from __future__ import annotations

import os
import pwd
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.backends.base import (
    Allocation,
    BackendError,
    NodeRequest,
    RunOutcome,
    validate_node_name,
)
from controller.backends.slurm_cli import JobInfo, NodeInfo, SlurmCli, parse_sbatch_parsable
from runwarden.config import ConfigError, load_section

REASON_PREFIX = "runwarden:"
_MAX_REASON = 200
# The batch script shipped with runwarden (deploy/slurm/agents.sbatch beside this package).
DEFAULT_BATCH_SCRIPT = str(Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "agents.sbatch")
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,58}$")
# Job states in which an allocation still is (or will be) ours: adopt it rather than submit.
_ALIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "RESIZING", "REQUEUED", "SUSPENDED"})
_ENDED = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmConfig:
    """The controller config's ``[slurm]`` table (unknown keys refused)."""

    job_name: str = "runwarden"  # the run's jobs: <job_name>, <job_name>-more; default runwarden-<run>
    # What every agent gets (the agent's own config holds the rest: listen, TLS, preflight, ...).
    agent_config: str = ""  # --config FILE, a path valid on every node ("" = none)
    etcd_endpoints: tuple[str, ...] = ()  # --etcd, repeated (empty: the agent config's own)
    etcd_root: str = ""  # --etcd-root ("" = the agent's default)
    agent_run_dir: str = "/run/runwarden"  # each agent's run dir is <this>/<node name>
    nodeagent: tuple[str, ...] = ("nodeagent",)  # the agent command on the nodes
    batch_script: str = DEFAULT_BATCH_SCRIPT
    output: str = "%x-%j.out"  # sbatch --output (the agents' logs), relative to the controller's cwd
    # Where and how long.
    partition: str = ""
    time_limit: str = ""  # sbatch --time, e.g. "24:00:00"
    sbatch_args: tuple[str, ...] = ()  # more sbatch options, e.g. ["--gres=gpu:8", "--account=ml"]
    signal_lead_s: int = 300  # --signal=USR1@<this> before the time limit (0 = no signal)
    preempt_grace_s: float = 0.0  # the partition's preemption GraceTime (0 = not known: unchecked)
    # The tools.
    slurm_conf: str = ""  # SLURM_CONF for every command ("" = Slurm's default)
    bin_dir: str = ""  # where sbatch/squeue/... live ("" = PATH)
    command_timeout_s: float = 30.0
    allocate_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not _JOB_NAME.match(self.job_name):
            raise BackendError(f"job_name: {self.job_name!r} is not a plain job name (letters, digits, ._-)")
        if not self.nodeagent or any(not a or any(c.isspace() for c in a) for a in self.nodeagent):
            raise BackendError("nodeagent: a non-empty argv whose words contain no whitespace")
        for endpoint in self.etcd_endpoints:
            if not re.match(r"^[^\s,]+:[0-9]+$", endpoint):
                raise BackendError(f"etcd_endpoints: {endpoint!r} is not host:port")
        if not self.agent_run_dir.startswith("/"):
            raise BackendError(f"agent_run_dir: must be an absolute path, got {self.agent_run_dir!r}")
        if not 0 <= self.signal_lead_s <= 65535:
            raise BackendError(f"signal_lead_s: must be within 0..65535, got {self.signal_lead_s}")
        if self.preempt_grace_s < 0:
            raise BackendError(f"preempt_grace_s: must be >= 0, got {self.preempt_grace_s}")
        if self.command_timeout_s <= 0 or self.allocate_timeout_s <= 0:
            raise BackendError("command_timeout_s and allocate_timeout_s must be > 0")
        if not os.path.isfile(self.batch_script):
            raise BackendError(f"batch_script: no such file {self.batch_script}")
        for arg in self.sbatch_args:
            if not arg.startswith("--") or "\0" in arg:
                raise BackendError(f"sbatch_args: {arg!r} is not a --long-option")

    @property
    def request_job_name(self) -> str:
        return f"{self.job_name}-more"


def reason_text(reason: str) -> str:
    """``runwarden: <evidence>`` on one line, short enough for Slurm's reason field."""
    one_line = " ".join(reason.split())
    return f"{REASON_PREFIX} {one_line}"[:_MAX_REASON]


class SlurmScheduler:
    """`backend = "slurm"`. Thread-safe: the shell calls it off its loop.

    * ``allocate(nodes, spares)`` submits ``deploy/slurm/agents.sbatch`` for ``nodes + spares``
      nodes (``--exclusive``: one agent per node, the node name is its identity; ``--no-kill``: a
      dead node shrinks the allocation instead of ending it; ``--signal=USR1@<lead>`` without
      ``B:``: Slurm signals the job steps, i.e. the agents, before the time limit), waits until the
      job runs and returns its nodes. The job is named ``job_name`` (``runwarden-<run>``): a leader
      that takes office while one of this run's allocations is alive adopts it instead of
      submitting a second, so ``allocate`` is idempotent across controller restarts and failovers.
    * ``request_nodes(count, exclude, reason)`` submits another such job (``<job_name>-more``,
      ``--exclude``) and returns at once; its agents register in etcd when Slurm starts it.
    * ``quarantine`` is a Slurm DRAIN whose reason starts with ``runwarden:`` -- the mark that lets
      ``release`` resume our own drains and never an operator's.
    * ``finish(outcome)`` cancels every job of the run (the agents get SIGTERM and leave).
    """

    name = "slurm"

    def __init__(self, config: SlurmConfig):
        self.config = config
        self.cli = SlurmCli(
            slurm_conf=config.slurm_conf or None,
            bin_dir=config.bin_dir or None,
            timeout_s=config.command_timeout_s,
        )
        self.user = pwd.getpwuid(os.geteuid()).pw_name
        self._lock = threading.Lock()

    @classmethod
    def from_section(cls, raw: dict[str, Any], where: str, *, run: str = "") -> SlurmScheduler:
        """The `[slurm]` table; ``run`` (the controller's run name) makes the default job name
        ``runwarden-<run>``, so two runs on one cluster never adopt each other's allocation."""
        if run and "job_name" not in raw:
            raw = {**raw, "job_name": f"runwarden-{run}"}
        try:
            config = load_section(SlurmConfig, raw, where)
        except ConfigError as exc:
            raise BackendError(str(exc)) from None
        return cls(config)

    # ---- the run's jobs --------------------------------------------------------------------------

    def jobs(self) -> list[JobInfo]:
        """This run's allocations that are alive (pending or running), oldest first."""
        names = (self.config.job_name, self.config.request_job_name)
        return [j for j in self.cli.jobs(names=names, user=self.user) if j.state in _ALIVE]

    def _submit(self, name: str, count: int, exclude: tuple[str, ...] = ()) -> str:
        c = self.config
        args = [
            "--parsable",
            f"--job-name={name}",
            f"--nodes={count}",
            "--ntasks-per-node=1",
            "--exclusive",  # one agent per node: the node name is the agent's identity
            "--no-kill",  # a dead node shrinks the allocation instead of ending it
            "--no-requeue",  # a lost allocation is the supervisor's to replace, not Slurm's
            f"--output={c.output}",
            "--open-mode=append",
        ]
        if c.signal_lead_s:
            # No "B:": the signal goes to the job steps (the agents), not to the batch shell.
            args.append(f"--signal=USR1@{c.signal_lead_s}")
        if c.partition:
            args.append(f"--partition={c.partition}")
        if c.time_limit:
            args.append(f"--time={c.time_limit}")
        if exclude:
            args.append("--exclude=" + ",".join(validate_node_name(n) for n in exclude))
        args.extend(c.sbatch_args)
        args.append(c.batch_script)
        if c.agent_config:
            args += ["--config", c.agent_config]
        for endpoint in c.etcd_endpoints:
            args += ["--etcd", endpoint]
        if c.etcd_root:
            args += ["--etcd-root", c.etcd_root]
        env = {"RUNWARDEN_SLURM_RUN_DIR": c.agent_run_dir, "RUNWARDEN_SLURM_NODEAGENT": " ".join(c.nodeagent)}
        return parse_sbatch_parsable(self.cli.run("sbatch", args, env=env))

    # ---- Scheduler -------------------------------------------------------------------------------

    def allocate(self, nodes: int, spares: int) -> Allocation:
        """Adopt this run's alive allocation or submit one of ``nodes + spares``; wait until it runs.

        An adopted allocation is returned as Slurm holds it now (a node that died under --no-kill
        has left it). On a timeout the job stays queued: the next call adopts it."""
        if nodes < 1 or spares < 0:
            raise BackendError(f"need nodes >= 1 and spares >= 0, got {nodes}+{spares}")
        with self._lock:
            mine = [j for j in self.jobs() if j.name == self.config.job_name]
            running = [j for j in mine if j.state == "RUNNING"]
            job_id = (running or mine)[0].id if mine else self._submit(self.config.job_name, nodes + spares)
            nodelist = self._wait_running(job_id)
            return Allocation(id=job_id, nodes=tuple(self.cli.hostnames(nodelist)))

    def _wait_running(self, job_id: str) -> str:
        deadline = time.monotonic() + self.config.allocate_timeout_s
        while True:
            state = self.cli.job_state(job_id)
            if state is not None and state[0] == "RUNNING":
                return state[1]
            if state is None or state[0] in _ENDED or state[0] == "COMPLETING":
                raise BackendError(f"allocation {job_id} is {state[0] if state else 'gone'}")
            if time.monotonic() > deadline:
                raise BackendError(
                    f"allocation {job_id} still {state[0]} after {self.config.allocate_timeout_s:.0f}s"
                    " (left queued: the next allocate adopts it)"
                )
            time.sleep(0.5)

    def request_nodes(self, count: int, *, exclude: tuple[str, ...], reason: str) -> NodeRequest:
        """Submit ``count`` more nodes (never one of ``exclude``) with an agent on each; no wait."""
        if count < 1:
            raise BackendError(f"need count >= 1, got {count}")
        with self._lock:
            job_id = self._submit(self.config.request_job_name, count, tuple(sorted(set(exclude))))
        return NodeRequest(id=f"slurm:{job_id}", count=count, submitted_at=time.time())

    def quarantine(self, node: str, reason: str) -> None:
        """DRAIN with ``runwarden: <evidence>``; an operator's existing drain is left as it is."""
        info = self.node(node)
        if info.drained and not info.reason.startswith(REASON_PREFIX):
            return  # already out, and the operator's reason is the one to keep
        self.cli.run(
            "scontrol", ["update", f"NodeName={node}", "State=DRAIN", f"Reason={reason_text(reason)}"]
        )

    def release(self, node: str) -> bool:
        """RESUME a node only if runwarden drained it; False if someone else holds it."""
        info = self.node(node)
        if not info.drained:
            return True
        if not info.reason.startswith(REASON_PREFIX):
            return False
        self.cli.run("scontrol", ["update", f"NodeName={node}", "State=RESUME"])
        return True

    def check_stop_fits(self, save_commit_s: float) -> None:
        """The notice Slurm gives before a kill must hold a save plus commit: the time-limit
        signal's lead (``signal_lead_s``) and, when configured, the preemption GraceTime."""
        c = self.config
        if c.signal_lead_s and save_commit_s > c.signal_lead_s:
            raise BackendError(
                f"a checkpoint save + commit takes {save_commit_s:.0f}s, but the time-limit signal comes"
                f" {c.signal_lead_s}s before the kill: raise [slurm] signal_lead_s"
            )
        if c.preempt_grace_s and save_commit_s > c.preempt_grace_s:
            raise BackendError(
                f"a checkpoint save + commit takes {save_commit_s:.0f}s, longer than the preemption"
                f" GraceTime of {c.preempt_grace_s:.0f}s"
            )

    def finish(self, outcome: RunOutcome) -> None:
        """Cancel every job of the run (its agents get SIGTERM and leave) and wait until Slurm
        lists none of them as alive or completing."""
        with self._lock:
            ids = [j.id for j in self.jobs()]
            if ids:
                self.cli.run("scancel", ids)
            deadline = time.monotonic() + self.config.command_timeout_s
            names = (self.config.job_name, self.config.request_job_name)
            while True:
                left = [j for j in self.cli.jobs(names=names, user=self.user) if j.state not in _ENDED]
                if not left:
                    return
                if time.monotonic() > deadline:
                    raise BackendError(
                        f"jobs {', '.join(f'{j.id} {j.state}' for j in left)} still there after scancel"
                    )
                time.sleep(0.3)

    # ---- node state ------------------------------------------------------------------------------

    def node(self, node: str) -> NodeInfo:
        validate_node_name(node)
        info = self.cli.nodes([node]).get(node)
        if info is None:
            raise BackendError(f"Slurm does not know node {node}")
        return info
