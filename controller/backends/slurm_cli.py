"""Slurm's command-line tools, called with argument lists and parsed strictly.

No shell anywhere: every call is ``subprocess.run([...])`` with a timeout, and every answer is
checked against the shape we asked for (a ``|``-separated ``--format``), so a Slurm upgrade that
changes an output surfaces as a :class:`BackendError` naming the line, not as a wrong decision.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from controller.backends.base import BackendError, validate_node_name

_JOB_ID = re.compile(r"^[0-9]+$")
# Node states Slurm prints (lowercase, long form); a trailing "*" means "not responding",
# "~" powered off, "#" powering up, "!" pending power down, "%" powering down, "$" maintenance,
# "@" pending reboot, "^" rebooting, "-" planned by backfill.
_NODE_STATE = re.compile(r"^[a-z_+]+[*~#!%$@^-]?$")


@dataclass(frozen=True, slots=True, kw_only=True)
class JobInfo:
    id: str
    name: str
    state: str  # squeue's long form: PENDING, RUNNING, COMPLETING, CANCELLED, ...
    nodelist: str  # "" while pending


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeInfo:
    name: str
    address: str
    state: str  # e.g. "idle", "mixed", "drained", "draining", "down", "mixed*"
    reason: str  # "none" when Slurm has none

    @property
    def drained(self) -> bool:
        return "drain" in self.state


class SlurmCli:
    """Runs Slurm commands for one cluster (``SLURM_CONF`` may point at a non-default one)."""

    def __init__(self, *, slurm_conf: str | None = None, bin_dir: str | None = None, timeout_s: float = 30.0):
        self._env = dict(os.environ)
        if slurm_conf is not None:
            self._env["SLURM_CONF"] = slurm_conf
        self._bin_dir = bin_dir
        self.timeout_s = timeout_s

    def binary(self, name: str) -> str:
        return os.path.join(self._bin_dir, name) if self._bin_dir else name

    def run(
        self,
        name: str,
        args: Sequence[str],
        *,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """Runs one command (``env``: variables on top of this cluster's environment)."""
        argv = [self.binary(name), *args]
        try:
            done = subprocess.run(
                argv,
                env={**self._env, **(env or {})},
                capture_output=True,
                text=True,
                timeout=timeout_s or self.timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise BackendError(f"{name} timed out after {exc.timeout:.0f}s: {' '.join(argv[1:])}") from None
        except OSError as exc:
            raise BackendError(f"cannot run {name}: {exc.strerror}") from None
        if done.returncode != 0:
            lines = (
                done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}"
            ).splitlines()
            raise BackendError(f"{name} {' '.join(args[:3])}... failed: {lines[-1][:300]}")
        return done.stdout

    # ---- queries ---------------------------------------------------------------------------------

    def hostnames(self, nodelist: str) -> list[str]:
        """Expands ``node[1-3,7]`` in Slurm's order (``scontrol show hostnames``)."""
        names = self.run("scontrol", ["show", "hostnames", nodelist]).split()
        if not names:
            raise BackendError(f"scontrol show hostnames {nodelist!r} printed nothing")
        return [validate_node_name(n) for n in names]

    def nodes(self, names: Sequence[str] = ()) -> dict[str, NodeInfo]:
        args = ["--noheader", "--Node", "--format=%N|%o|%T|%E"]
        if names:
            args.append("--nodes=" + ",".join(names))
        return parse_sinfo_nodes(self.run("sinfo", args))

    def job_state(self, job_id: str) -> tuple[str, str] | None:
        """(state, nodelist) of a job, None if Slurm no longer lists it."""
        out = self.run("squeue", ["--noheader", f"--jobs={check_job_id(job_id)}", "--format=%i|%T|%N"])
        for line in out.splitlines():
            fields = line.strip().split("|")
            if len(fields) != 3 or not _JOB_ID.match(fields[0]):
                raise BackendError(f"unexpected squeue line: {line!r}")
            if fields[0] == job_id:
                return fields[1], fields[2]
        return None

    def jobs(self, *, names: Sequence[str], user: str) -> list[JobInfo]:
        """The user's jobs with one of these names that squeue still lists, oldest first."""
        out = self.run(
            "squeue",
            ["--noheader", f"--name={','.join(names)}", f"--user={user}", "--format=%i|%j|%T|%N"],
        )
        return sorted(parse_squeue_jobs(out), key=lambda j: int(j.id))


def check_job_id(job_id: str) -> str:
    if not _JOB_ID.match(job_id):
        raise BackendError(f"bad Slurm job id {job_id!r}")
    return job_id


def parse_sinfo_nodes(text: str) -> dict[str, NodeInfo]:
    """Parses ``sinfo -h -N -o '%N|%o|%T|%E'``; a node in two partitions appears twice (same data)."""
    nodes: dict[str, NodeInfo] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|", 3)  # the reason is last and may itself contain '|'
        if len(fields) != 4 or not _NODE_STATE.match(fields[2]):
            raise BackendError(f"unexpected sinfo line: {line!r}")
        name = validate_node_name(fields[0])
        nodes[name] = NodeInfo(name=name, address=fields[1], state=fields[2], reason=fields[3])
    return nodes


def parse_squeue_jobs(text: str) -> list[JobInfo]:
    """Parses ``squeue -h -o '%i|%j|%T|%N'`` (job names never contain '|': ours are checked)."""
    jobs = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.strip().split("|")
        if len(fields) != 4 or not _JOB_ID.match(fields[0]) or not re.match(r"^[A-Z_]+$", fields[2]):
            raise BackendError(f"unexpected squeue line: {line!r}")
        jobs.append(JobInfo(id=fields[0], name=fields[1], state=fields[2], nodelist=fields[3]))
    return jobs


def parse_sbatch_parsable(text: str) -> str:
    """``sbatch --parsable`` prints ``jobid`` or ``jobid;cluster``."""
    job_id = text.strip().split(";", 1)[0]
    return check_job_id(job_id)
