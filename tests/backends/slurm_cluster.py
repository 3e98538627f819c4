"""A real, throwaway Slurm cluster on loopback: one slurmctld and one ``slurmd -N nodeK`` per node.

Debian bookworm's Slurm 22.05 as root, no systemd, ``auth/none`` bound to 127.0.0.1 (see
shared/recipes/SLURM.md). Everything (conf, state, spool, logs) lives in one directory; ``down``
leaves no slurmd, slurmctld or slurmstepd of this cluster behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")


def missing_binaries() -> list[str]:
    return [b for b in SLURM_BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return "Z" not in line.split()[1]
    except OSError:
        return False
    return False


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def _with_descendants(roots: list[int]) -> list[int]:
    children = _children_map()
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


class SlurmCluster:
    def __init__(self, root: Path, nodes: int = 4, *, cpus: int = 4, prolog: str | None = None):
        self.root = root
        self.node_names = [f"node{i}" for i in range(1, nodes + 1)]
        self.cpus = cpus
        self.prolog = prolog
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._ctld: subprocess.Popen[bytes] | None = None
        self._slurmd: dict[str, subprocess.Popen[bytes]] = {}

    # ---- lifecycle -------------------------------------------------------------------------------

    def write_conf(self) -> None:
        for sub in ("state", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for node in self.node_names:
            (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)
        ports = _free_ports(len(self.node_names) + 2)
        node_lines = "\n".join(
            f"NodeName={n} NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
            for n, p in zip(self.node_names, ports[2:], strict=True)
        )
        prolog = f"Prolog={self.prolog}\nPrologFlags=Alloc\n" if self.prolog else ""
        r = self.root
        self.conf.write_text(
            f"""ClusterName=rwtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=5
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=1
SlurmdTimeout=5
KillWait=5
MinJobAge=600
SlurmdParameters=config_overrides
SchedulerParameters=sched_interval=1,bf_interval=1
{prolog}{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )

    def up(self, timeout_s: float = 30.0) -> None:
        self.write_conf()
        self._ctld = self._spawn("slurmctld", ["slurmctld", "-D"])
        for node in self.node_names:
            self.start_node(node)
        self.wait_states({n: "idle" for n in self.node_names}, timeout_s=timeout_s)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        out = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 -- lives as long as the daemon
        return subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)

    def start_node(self, node: str) -> None:
        self._slurmd[node] = self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node])

    def down(self) -> None:
        """Cancels every job, kills this cluster's steps, then slurmd before slurmctld."""
        with contextlib.suppress(Exception):
            jobs = self.cmd("squeue", "--noheader", "--format=%A").split()
            if jobs:
                self.cmd("scancel", *jobs)
        self.kill_steps()
        for proc in self._slurmd.values():
            if proc.poll() is None:
                proc.terminate()
        self._reap(list(self._slurmd.values()))
        if self._ctld is not None and self._ctld.poll() is None:
            self._ctld.terminate()
            self._reap([self._ctld])
        self.kill_steps()  # any step that started while we were stopping

    @staticmethod
    def _reap(procs: list[subprocess.Popen[bytes]]) -> None:
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    # ---- processes of this cluster ---------------------------------------------------------------

    def stepds(self, node: str | None = None) -> list[int]:
        """slurmstepd processes of this cluster (or of one node: it keeps that node's log open)."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() != "slurmstepd":
                        continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if f"SLURM_CONF={self.conf}".encode() not in f.read().split(b"\0"):
                        continue
                if node is not None:
                    log = str(self.root / "log" / f"slurmd-{node}.log")
                    fds = os.listdir(f"/proc/{pid}/fd")
                    if not any(_readlink(f"/proc/{pid}/fd/{fd}") == log for fd in fds):
                        continue
            except OSError:
                continue
            if _alive(pid):
                found.append(pid)
        return found

    def kill_steps(self, node: str | None = None) -> None:
        pids = _with_descendants(self.stepds(node))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)

    def kill_node(self, node: str) -> None:
        """The host dies: its slurmd and every process of its job steps get SIGKILL at once."""
        proc = self._slurmd[node]
        roots = [proc.pid, *self.stepds(node)]
        for pid in _with_descendants(roots):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=5)

    # ---- queries ---------------------------------------------------------------------------------

    def cmd(self, *argv: str, timeout_s: float = 20.0) -> str:
        done = subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: rc={done.returncode} {done.stderr.strip()}")
        return done.stdout

    def node_states(self) -> dict[str, tuple[str, str]]:
        out = self.cmd("sinfo", "--noheader", "--Node", "--format=%N|%T|%E")
        states = {}
        for line in out.splitlines():
            name, state, reason = line.split("|", 2)
            states[name] = (state, reason)
        return states

    def wait_states(self, want: dict[str, str], timeout_s: float = 30.0) -> dict[str, tuple[str, str]]:
        deadline = time.monotonic() + timeout_s
        states: dict[str, tuple[str, str]] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                states = self.node_states()
                if all(states.get(n, ("",))[0] == s for n, s in want.items()):
                    return states
            time.sleep(0.2)
        raise AssertionError(f"nodes not {want} after {timeout_s}s: {states}")

    def job_fields(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as key -> value (values here never contain spaces we need)."""
        out = self.cmd("scontrol", "show", "job", "-o", job_id)
        fields = {}
        for token in out.split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: str, states: set[str], timeout_s: float = 60.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job_fields(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} not in {states} after {timeout_s}s: {fields.get('JobState')}")


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
