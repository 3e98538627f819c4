"""What every trial reads, the same way for every tool: files tailed with arrival times, the job's own
step log (examples/train.py's loss-rank<r>.jsonl), and the processes of a trial found through /proc."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Line:
    """One line of a tailed file and when the poller first saw it (wall clock, ~50 ms resolution)."""

    t: float
    path: Path
    text: str


@dataclass(frozen=True, slots=True)
class StepEntry:
    """One `{"step", "loss", "attempt", "ts"}` line of the job's step log, stamped at arrival (`t`);
    `written` is the line's own `ts` (the rank's clock when it wrote it; 0 when absent); `attempt` its
    own (RUNWARDEN_ATTEMPT under runwarden; 0 under the other tools)."""

    t: float
    rank: int
    step: int
    loss: float
    written: float = 0.0
    attempt: int = 0


class Tail:
    """Polls files (and a glob) every `interval_s` in a thread; keeps every complete line with its time."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.lines: list[Line] = []
        self._globs: list[tuple[Path, str]] = []
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, directory: Path, pattern: str) -> None:
        with self._lock:
            self._globs.append((directory, pattern))

    def start(self) -> Tail:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        with self._lock:
            now = time.time()
            for directory, pattern in self._globs:
                for path in sorted(directory.glob(pattern)):
                    self._read(path, now)

    def _read(self, path: Path, now: float) -> None:
        try:
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
        except OSError:
            return
        if not data:
            return
        self._offsets[path] = self._offsets.get(path, 0) + len(data)
        data = self._partial.pop(path, b"") + data
        *complete, rest = data.split(b"\n")
        if rest:
            self._partial[path] = rest
        for raw in complete:
            self.lines.append(Line(now, path, raw.decode(errors="replace")))

    def snapshot(self) -> list[Line]:
        with self._lock:
            return list(self.lines)


def step_entries(lines: list[Line]) -> list[StepEntry]:
    out = []
    for line in lines:
        if not line.path.name.startswith("loss-rank"):
            continue
        try:
            rec = json.loads(line.text)
        except json.JSONDecodeError:
            continue
        rank = int(line.path.stem.removeprefix("loss-rank"))
        written, attempt = rec.get("ts", 0.0), rec.get("attempt", 0)
        out.append(
            StepEntry(
                line.t,
                rank,
                int(rec["step"]),
                float(rec["loss"]),
                written if isinstance(written, float) else 0.0,
                attempt if isinstance(attempt, int) else 0,
            )
        )
    return out


def read_losses(loss_dir: Path) -> dict[tuple[int, int], float]:
    """(rank, step) -> loss, the last entry of each (an uninterrupted run logs each once)."""
    out: dict[tuple[int, int], float] = {}
    for path in sorted(loss_dir.glob("loss-rank*.jsonl")):
        rank = int(path.stem.removeprefix("loss-rank"))
        for raw in path.read_text().splitlines():
            rec = json.loads(raw)
            out[(rank, int(rec["step"]))] = float(rec["loss"])
    return out


# -- processes --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    cmdline: tuple[str, ...]
    env: dict[str, str]


TRIAL_ENV = "BENCH_TRIAL"  # set to the trial's root for everything a trial starts (children inherit it)


def processes_mentioning(needle: str) -> list[Proc]:
    """Every process (but this one) whose command line contains `needle` or whose environment carries
    BENCH_TRIAL=`needle` (a launcher's helpers, such as NVRx's rank monitor, name no trial path)."""
    out = []
    marker = f"{TRIAL_ENV}={needle}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            env_raw = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle.encode() not in cmd and marker not in env_raw.split(b"\0"):
            continue
        env = dict(kv.split("=", 1) for kv in env_raw.decode(errors="replace").split("\0") if "=" in kv)
        out.append(Proc(int(entry.name), tuple(cmd.decode(errors="replace").split("\0")), env))
    return out


def is_worker(p: Proc) -> bool:
    """A training rank: `python [-u] <train script> ...` (a launcher's command line carries the script
    too, further on; a launcher's helpers, such as NVRx's rank monitor, run no script)."""
    head = p.cmdline[1:3]
    return "RANK" in p.env and any(a.endswith(("train.py", "train_adapter.py")) for a in head)


def workers(needle: str) -> list[Proc]:
    return [p for p in processes_mentioning(needle) if is_worker(p)]


def node_of_worker(pid: int) -> str:
    """The node a rank runs on, from its environment: BENCH_NODE (the peers' launchers set it), or the
    runwarden agent's socket path (<root>/nodes/<node>/agent.sock). c10d hands out ranks in the order
    the nodes join, so rank r need not be on node rank r."""
    env = {p.pid: p.env for p in processes_mentioning("")}.get(pid, {})
    if "BENCH_NODE" in env:
        return env["BENCH_NODE"]
    return Path(env.get("RUNWARDEN_NODEAGENT_SOCKET") or env.get("RUNWARDEN_AGENT_SOCKET", "")).parent.name


def rank_pid(needle: str, rank: int) -> int | None:
    found = [p.pid for p in workers(needle) if p.env.get("RANK") == str(rank)]
    return max(found) if found else None  # the newest, should an old one linger


def kill_all(needle: str, keep: set[int] | None = None) -> int:
    """SIGCONT + SIGKILL every process mentioning `needle` (a stopped one too); returns how many."""
    n = 0
    for p in processes_mentioning(needle):
        if keep and p.pid in keep:
            continue
        try:
            os.kill(p.pid, signal.SIGCONT)
            os.kill(p.pid, signal.SIGKILL)
            n += 1
        except ProcessLookupError:
            pass
    return n
