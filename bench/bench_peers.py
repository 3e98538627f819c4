"""Side by side with the tools people use instead: the same job, the same faults, one command.

    bash bench/peers/setup_venv.sh      # once: the peer virtualenv bench/.peer-venv (NVRx, torchft)
    flock /tmp/runwarden-heavy.lock timeout 2700 .venv/bin/python bench/bench_peers.py --trials 5 \
        --out bench/results/bench_peers.json

Every trial is a fresh deployment of one tool running examples/train.py (4 "nodes" x 1 rank, gloo on
CPU; runwarden also has its 2 spares): torchrun (TorchElastic, --max-restarts=3, c10d rendezvous, one
agent per node) at its defaults and with a 10 s process-group timeout; NVRx's ft_launcher (heartbeats,
10 s rank timeout); runwarden as the demo deploys it, at its shipped defaults (warm workers as the agent
ships them; bench/peers/ has each adapter). The fault comes once the job has settled, the same for
every tool: every rank has logged step WARM_STEP (past the first committed checkpoint) and `--settle`
seconds (20 by default) have passed since the job's first step, so each tool has finished what it does
after a start (runwarden's agents park their standby groups). It is injected into rank 1, the same way
for every tool:

    crash            SIGKILL the rank's process
    crash-again      a crash, and once the job has recovered from it, AGAIN_AFTER_S (3 s) after its first
                     new step, a crash of the same rank of the new attempt: the second one is measured
                     (a failure storm: a replacement that comes back faulty)
    hang             SIGSTOP the rank's process
    node-lost        SIGKILL node 1's launcher/agent alone (no cleanup), restarted 8 s later (systemd)
    node-lost-store  the same on node 0, whose launcher hosts the rendezvous store
    straggler        the rank sleeps 0.5 s in every progress report (once a step; thrice at a checkpoint)

Measured from what every tool shares: the job's own step log (loss-rank<r>.jsonl, tailed, each line
stamped when it appears) and the tool's own output: time to detect (fault -> the tool's first reaction:
an elastic/NVRx log line, runwarden's DETECTION event), fault -> first new step (the first step every
rank logged in the run's next attempt: a step done again after a restart counts again (`completions`);
after a crash, the first step completed once the killed rank's new process logged (`restarted_after`),
else the first step redone or after a stall; for the straggler, the first step at normal speed after
a slow one), steps
redone, whether the faulty node trained in the next attempt, whether the run survived, the processes
left behind after stopping the tool as an operator would, and whether the losses after the fault equal
an uninterrupted run's (a reference run of the same seed). A trial ends 3 steps after recovery, when
the tool gives up, or at `--cap` seconds after the fault (reported as "> cap"). Trials are interleaved
(round r runs every fault under every tool, in a rotating order) and the results are rewritten after
each trial, so a run cut short keeps its data.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import itertools

import torch

from bench.peers import launchers
from bench.peers.observe import (
    TRIAL_ENV,
    StepEntry,
    Tail,
    kill_all,
    node_of_worker,
    read_losses,
    step_entries,
)
from bench.peers.runwarden import RunwardenDeployment

FAULTS = ("crash", "crash-again", "hang", "node-lost", "node-lost-store", "straggler")
TOOLS = ("torchrun", "torchrun-10s", "nvrx", "runwarden")
WORLD = 4
VICTIM_RANK = 1
WARM_STEP = 14  # inject once every rank has logged this step (the first checkpoint is at 10) ...
SETTLE_S = 20.0  # ... and this long after the job's first step (the module docstring says why)
STEPS_AFTER_RECOVERY = 3
RESTART_FLOOR_S = 0.1  # crash: no new rank logs a step sooner after the kill (runwarden warm: 0.35 s)
AGAIN_AFTER_S = 3.0  # crash-again: the second crash this long after the first one's first new step
LOSS_RTOL = 1e-6
RESTART_LAUNCHER_AFTER_S = 8.0  # as the demo: systemd's Restart=always brings a dead agent back
UNINTERRUPTED_WINDOW_S = (
    30.0  # training that goes on this long after a fault with no restart: not interrupted
)
JOB_STEPS = 100_000


@dataclass(frozen=True, slots=True, kw_only=True)
class Trial:
    """One fault injected into one fresh deployment of one tool, and what followed."""

    tool: str
    fault: str
    round: int
    started: bool  # the job reached WARM_STEP (else nothing was injected)
    outcome: str  # recovered | not interrupted | no recovery within cap | run ended | not started
    detect_s: float | None  # fault -> the tool's first reaction
    first_new_step_s: float | None  # fault -> first new step (straggler: first step at normal speed)
    last_step_before: int | None  # the last step every rank had logged before the fault
    resumed_at_step: int | None  # the step index of the first new step
    steps_redone: int | None
    faulty_node_trained_after: bool | None  # did the faulty node run a rank of the recovered run?
    survived: bool
    left_behind: int  # processes of the run still alive after the tool was stopped
    left_behind_what: tuple[str, ...] = ()  # their command lines, cut short
    losses_compared: int
    losses_equal: bool | None
    wall_s: float
    reactions: tuple[str, ...] = ()  # the tool's first log lines / events after the fault
    note: str = ""


def job_args(root: Path, steps: int = JOB_STEPS) -> list[str]:
    """examples/train.py's arguments: the demo's job (ClusterSpec's defaults) for every peer."""
    spec = RunwardenDeployment.config()["spec"]
    assert isinstance(spec, dict)
    return [
        "--steps", str(steps), "--ckpt-dir", str(root / "checkpoints"), "--ckpt-every", str(spec["ckpt_every"]),
        "--out", str(root / "losses"), "--seed", str(spec["seed"]), "--step-sleep", str(spec["step_sleep"]),
    ]  # fmt: skip


def peer_configs() -> dict[str, launchers.LauncherPeer]:
    return {
        "torchrun": launchers.torchrun(),
        "torchrun-10s": launchers.torchrun(10.0),
        "nvrx": launchers.nvrx(),
    }


# -- reading the step log ---------------------------------------------------------------------


def completions(
    entries: Sequence[StepEntry], after: float, *, restarts: bool = False
) -> list[tuple[float, int]]:
    """(time, step) for each step that every rank logged after `after`, in time order: the step counts
    once its last rank's line is in (a rank whose line came before `after` did not redo it).

    restarts: a step done again after a restart counts again. A rank restarted (after `after`) where
    its line goes back in step (a resume from a checkpoint) or names a later attempt than its line
    before; a step counts once per restart every rank went through. Without it, a job that trains
    on for seconds after a fault (a lost agent) and resumes from a commit within them redoes steps
    already counted: its restart looks like no interruption at all."""
    by_step: dict[tuple[int, int], dict[int, float]] = {}
    epoch: dict[int, int] = {}
    last: dict[int, StepEntry] = {}
    for e in entries:
        prev = last.get(e.rank)
        if (
            restarts
            and e.t > after
            and prev is not None
            and (e.step <= prev.step or e.attempt > prev.attempt)
        ):
            epoch[e.rank] = epoch.get(e.rank, 0) + 1
        last[e.rank] = e
        if e.t > after:
            by_step.setdefault((epoch.get(e.rank, 0), e.step), {}).setdefault(e.rank, e.t)
    done = [(max(ranks.values()), step) for (_, step), ranks in by_step.items() if len(ranks) == WORLD]
    return sorted(done)


def last_complete_before(entries: Sequence[StepEntry], before: float) -> int | None:
    by_step: dict[int, set[int]] = {}
    for e in entries:
        if e.t <= before:
            by_step.setdefault(e.step, set()).add(e.rank)
    full = [s for s, ranks in by_step.items() if len(ranks) == WORLD]
    return max(full) if full else None


def interrupted_then_resumed(
    done: list[tuple[float, int]], before: int | None, base_step_s: float, fault_at: float
) -> int | None:
    """Index into `done` of the first step of the run's next attempt: a step redone (a restart from a
    checkpoint) or one after a stall (> max(2 s, 5 steps)). None while training simply goes on."""
    prev_t, highest = fault_at, -1 if before is None else before
    for i, (t, step) in enumerate(done):
        if step <= highest or t - prev_t > max(2.0, 5 * base_step_s):
            return i
        prev_t, highest = t, max(highest, step)
    return None


def restarted_after(
    entries: Sequence[StepEntry], done: list[tuple[float, int]], fault_at: float
) -> int | None:
    """Index into `done` of the first step completed once the killed rank logged a line after the
    fault by its own clock: its process was killed, so a process of the next attempt wrote it, and
    no step completes without it. (A recovery faster than the stall rule's 2 s from a crash just
    after a commit redoes no step: only this sees it.) Not the step number: the ranks still alive
    may have logged the same step in the old attempt. None while no line says when it was written.
    A line stamped within RESTART_FLOOR_S of the kill is the killed process's last (it stamped it as
    the signal came): no tool restarts a rank that fast."""
    new = [e.t for e in entries if e.rank == VICTIM_RANK and e.written > fault_at + RESTART_FLOOR_S]
    if not new:
        return None
    first = min(new)
    return next((i for i, (t, _step) in enumerate(done) if t >= first), None)


def normal_speed_after_slow(done: list[tuple[float, int]], base_step_s: float, fault_at: float) -> int | None:
    """Index into `done` of the first step at normal speed (< 2x the pre-fault step time) that follows
    a slow one (the slow-down takes a step or two to arrive)."""
    prev_t = fault_at
    seen_slow = False
    for i, (t, _step) in enumerate(done):
        gap = t - prev_t
        prev_t = t
        if gap > 2 * base_step_s + 0.2:
            seen_slow = True
        elif seen_slow:
            return i
    return None


def base_step_time(entries: Sequence[StepEntry], before: float) -> float:
    done = completions([e for e in entries if e.t <= before], 0.0)
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(done)][-8:]
    return statistics.median(gaps) if gaps else 0.2


# -- one trial ----------------------------------------------------------------------------------


class Deployment:
    """The few things the harness asks of a tool (bench/peers/launchers.py, bench/peers/runwarden.py)."""

    def __init__(self, tool: str, root: Path, tail: Tail) -> None:
        self.tool = tool
        if tool == "runwarden":
            self.impl: launchers.LauncherDeployment | RunwardenDeployment = RunwardenDeployment(root, tail)
        else:
            self.impl = launchers.LauncherDeployment(peer_configs()[tool], root, job_args(root), tail)
        self.loss_dir = self.impl.loss_dir
        self.restart: threading.Timer | None = None

    def cancel_restart(self) -> None:
        if self.restart is not None:
            self.restart.cancel()
            self.restart.join()

    def inject(self, fault: str) -> tuple[float, str]:
        """Inject `fault` into rank VICTIM_RANK / its node; (the wall time it happened, the node)."""
        impl = self.impl
        if fault in ("crash", "hang"):
            pid = impl.rank_pid(VICTIM_RANK)
            if pid is None:
                raise RuntimeError(f"rank {VICTIM_RANK} has no process")
            # c10d hands out ranks in join order: the node is the one the rank's pid runs on
            found = impl.node_of_pid(pid) if isinstance(impl, RunwardenDeployment) else node_of_worker(pid)
            node = found or impl.node_of_rank(VICTIM_RANK)
            at = time.time()
            os.kill(pid, signal.SIGKILL if fault == "crash" else signal.SIGSTOP)
            return at, node
        if fault in ("node-lost", "node-lost-store"):
            node_rank = impl.store_node if fault == "node-lost-store" else VICTIM_RANK
            node = impl.node_of_rank(node_rank)
            at = time.time()
            impl.kill_launcher(node_rank)
            again = (node,) if isinstance(impl, RunwardenDeployment) else (node_rank,)
            self.restart = threading.Timer(RESTART_LAUNCHER_AFTER_S, impl.restart_launcher, args=again)
            self.restart.start()
            return at, node
        if fault == "straggler":
            node = impl.node_of_rank(VICTIM_RANK)
            at = time.time()
            impl.slow_rank(VICTIM_RANK, 0.5)
            return at, node
        raise ValueError(fault)

    def faulty_node_trained_after(self, node: str, fault_at: float) -> bool | None:
        if isinstance(self.impl, RunwardenDeployment):
            nodes = self.impl.nodes_after(fault_at)
            return None if nodes is None else node in nodes
        return node in self.impl.nodes_training()


def wait_warm(tail: Tail, dep: Deployment, timeout_s: float, settle_s: float = 0.0) -> bool:
    """Whether the job settled within `timeout_s`: every rank logged WARM_STEP and `settle_s` seconds
    have passed since the first step every rank logged."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = completions(step_entries(tail.snapshot()), 0.0)
        if done and max(s for _, s in done) >= WARM_STEP and time.time() >= done[0][0] + settle_s:
            return True
        if not dep.impl.alive():
            return False
        time.sleep(0.2)
    return False


def await_recovery(
    tail: Tail, dep: Deployment, fault: str, fault_at: float, base: float, cap_s: float
) -> tuple[str, int | None]:
    """(outcome, index into the completions after the fault of the first new step, None unless
    recovered), once the run recovered, went on uninterrupted, ended, or `cap_s` passed."""
    while time.time() - fault_at < cap_s:
        time.sleep(0.2)
        entries = step_entries(tail.snapshot())
        before = last_complete_before(entries, fault_at)
        done = completions(entries, fault_at, restarts=True)
        if fault == "straggler":
            idx = normal_speed_after_slow(done, base, fault_at)
        elif fault in ("crash", "crash-again"):
            idx = restarted_after(entries, done, fault_at)
            if idx is None and not any(e.written for e in entries):
                idx = interrupted_then_resumed(done, before, base, fault_at)
        else:
            idx = interrupted_then_resumed(done, before, base, fault_at)
        if idx is not None and len(done) > idx + STEPS_AFTER_RECOVERY:
            return "recovered", idx
        quiet = fault == "straggler" or idx is not None or time.time() - fault_at <= UNINTERRUPTED_WINDOW_S
        if not quiet and done and time.time() - done[-1][0] < 2.0:  # training went on, no restart
            return "not interrupted", None
        if not dep.impl.alive() and time.time() - fault_at > RESTART_LAUNCHER_AFTER_S + 2:
            return "run ended", None
    return "no recovery within cap", None


def run_trial(
    tool: str,
    fault: str,
    rnd: int,
    cap_s: float,
    reference: dict[tuple[int, int], float],
    workdir: Path,
    settle_s: float | None = None,
) -> Trial:
    t_start = time.time()
    root = Path(tempfile.mkdtemp(prefix=f"peer-{tool}-{fault}-", dir=workdir))
    os.environ[TRIAL_ENV] = str(root)  # everything this trial starts inherits it: found afterwards by it
    tail = Tail()
    dep = Deployment(tool, root, tail)
    tail.watch(dep.loss_dir, "loss-rank*.jsonl")
    tail.start()
    stopped = False
    try:
        dep.impl.start()
        settle = SETTLE_S if settle_s is None else settle_s
        if not wait_warm(tail, dep, 240 + settle, settle):
            left_procs, stopped = dep.impl.stop(), True
            return failed_trial(tool, fault, rnd, "not started", len(left_procs), time.time() - t_start)
        base = base_step_time(step_entries(tail.snapshot()), time.time())
        before = last_complete_before(step_entries(tail.snapshot()), time.time())
        if fault == "crash-again":
            # The first crash, its recovery, then the same rank of the new attempt AGAIN_AFTER_S later:
            # only the second is measured.
            first_at, _ = dep.inject("crash")
            first, first_idx = await_recovery(tail, dep, "crash", first_at, base, cap_s)
            if first_idx is None:
                left_procs, stopped = dep.impl.stop(), True
                return failed_trial(
                    tool, fault, rnd, f"first crash: {first}", len(left_procs), time.time() - t_start
                )
            resumed_t = completions(step_entries(tail.snapshot()), first_at, restarts=True)[first_idx][0]
            time.sleep(max(0.0, resumed_t + AGAIN_AFTER_S - time.time()))
            fault_at, node = dep.inject("crash")
        else:
            fault_at, node = dep.inject(fault)
        outcome, recovered_idx = await_recovery(tail, dep, fault, fault_at, base, cap_s)
        dep.cancel_restart()  # a launcher restart due after the trial would outlive it
        entries = step_entries(tail.snapshot())
        done = completions(entries, fault_at, restarts=True)
        before = last_complete_before(entries, fault_at)
        first_new: tuple[float, int] | None = done[recovered_idx] if recovered_idx is not None else None
        if first_new is None and fault == "straggler" and done:
            first_new = None  # still slow at the cap: no step at normal speed
        dead = node if fault.startswith("node-lost") else ""
        redone = None
        if first_new is not None and recovered_idx is not None:
            # the steps done before the restart (the fault's moment, or any the run went on to do) again
            prior = max([before if before is not None else -1, *(step for _, step in done[:recovered_idx])])
            redone = max(0, prior + 1 - first_new[1])
        detect = dep.impl.first_reaction(fault_at, dead)
        trained_after = dep.faulty_node_trained_after(node, fault_at) if first_new is not None else None
        recent = bool(done) and time.time() - done[-1][0] < 10.0
        survived = outcome == "recovered" or (recent and dep.impl.alive())
        reactions = tuple(dep.impl.reaction_lines(fault_at, dead))
        compared, equal = compare_losses(entries, fault_at, reference)
        note = ""
        if fault == "straggler" and outcome != "recovered":
            note = "still slow at the cap" if recent else "no step in the last 10 s"
        if outcome == "not interrupted":
            note = f"training went on for {UNINTERRUPTED_WINDOW_S:.0f} s after the fault with no restart"
        left_procs, stopped = dep.impl.stop(), True
        left = len(left_procs)
        return Trial(
            tool=tool,
            fault=fault,
            round=rnd,
            started=True,
            outcome=outcome,
            detect_s=None if detect is None or detect - fault_at > cap_s else detect - fault_at,
            first_new_step_s=None if first_new is None else first_new[0] - fault_at,
            last_step_before=before,
            resumed_at_step=None if first_new is None else first_new[1],
            steps_redone=redone,
            faulty_node_trained_after=trained_after,
            survived=survived,
            left_behind=left,
            left_behind_what=tuple(left_procs),
            losses_compared=compared,
            losses_equal=equal,
            wall_s=time.time() - t_start,
            reactions=reactions,
            note=note,
        )
    finally:
        dep.cancel_restart()
        if not stopped:
            with contextlib.suppress(Exception):
                dep.impl.stop()
        tail.stop()
        kill_all(str(root))
        os.environ.pop(TRIAL_ENV, None)


def failed_trial(tool: str, fault: str, rnd: int, outcome: str, left: int = 0, wall_s: float = 0.0) -> Trial:
    return Trial(tool=tool, fault=fault, round=rnd, started=False, outcome=outcome, detect_s=None,
                 first_new_step_s=None, last_step_before=None, resumed_at_step=None, steps_redone=None,
                 faulty_node_trained_after=None, survived=False, left_behind=left, losses_compared=0,
                 losses_equal=None, wall_s=wall_s)  # fmt: skip


def compare_losses(
    entries: Sequence[StepEntry], fault_at: float, reference: dict[tuple[int, int], float]
) -> tuple[int, bool | None]:
    """Every loss logged after the fault against the uninterrupted reference (and, for a step the
    reference lacks, against this run's own line for that step from before the fault)."""
    own_before = {(e.rank, e.step): e.loss for e in entries if e.t <= fault_at}
    n, equal = 0, True
    for e in entries:
        if e.t <= fault_at:
            continue
        want = reference.get((e.rank, e.step), own_before.get((e.rank, e.step)))
        if want is None:
            continue
        n += 1
        equal = equal and abs(e.loss - want) <= LOSS_RTOL * max(1.0, abs(want))
    return n, (equal if n else None)


def reference_losses(steps: int, workdir: Path) -> dict[tuple[int, int], float]:
    """An uninterrupted run of the same job (4 ranks, same seed) under plain torchrun."""
    root = Path(tempfile.mkdtemp(prefix="peer-reference-", dir=workdir))
    os.environ[TRIAL_ENV] = str(root)
    tail = Tail()
    dep = launchers.LauncherDeployment(launchers.torchrun(), root, job_args(root, steps), tail)
    try:
        dep.start()
        deadline = time.monotonic() + 60 + steps
        while dep.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        dep.stop()
        kill_all(str(root))
        os.environ.pop(TRIAL_ENV, None)
    return read_losses(root / "losses")


# -- the report -----------------------------------------------------------------------------------


def _stats(values: list[float | None], n: int, cap_s: float) -> dict[str, object]:
    """Median and worst of the trials; a trial without a value counts as > cap (worst)."""
    got = sorted(v for v in values if v is not None)
    missing = n - len(got)
    if n == 0:
        return {"median": None, "worst": None, "over_cap": 0}
    # The median over all n trials, a missing value ranking above every measured one.
    ranked: list[float] = got + [float("inf")] * missing
    med = statistics.median(ranked) if missing * 2 < n else float("inf")
    return {
        "median": None if med == float("inf") else med,
        "worst": None if missing else (got[-1] if got else None),
        "over_cap": missing,
    }


def summarize(trials: list[Trial], cap_s: float) -> dict[str, dict[str, object]]:
    cells: dict[str, dict[str, object]] = {}
    for fault in FAULTS:
        for tool in TOOLS:
            rows = [t for t in trials if t.tool == tool and t.fault == fault and t.started]
            if not rows:
                continue
            n = len(rows)
            cells[f"{fault}/{tool}"] = {
                "tool": tool,
                "fault": fault,
                "n": n,
                "not_started": len(
                    [t for t in trials if t.tool == tool and t.fault == fault and not t.started]
                ),
                "detect_s": _stats([t.detect_s for t in rows], n, cap_s),
                "first_new_step_s": _stats([t.first_new_step_s for t in rows], n, cap_s),
                "steps_redone": _stats(
                    [float(t.steps_redone) if t.steps_redone is not None else None for t in rows], n, cap_s
                ),
                "recovered": sum(t.outcome == "recovered" for t in rows),
                "not_interrupted": sum(t.outcome == "not interrupted" for t in rows),
                "survived": sum(t.survived for t in rows),
                "faulty_node_trained_after": sum(bool(t.faulty_node_trained_after) for t in rows),
                "left_behind_max": max(t.left_behind for t in rows),
                "losses_equal": sum(t.losses_equal is True for t in rows),
                "losses_differ": sum(t.losses_equal is False for t in rows),
            }
    return cells


def _fmt(stats: object) -> str:
    assert isinstance(stats, dict)
    med, worst, over = stats["median"], stats["worst"], stats["over_cap"]
    m = "> cap" if med is None else f"{med:.1f}"
    w = "> cap" if over else ("-" if worst is None else f"{worst:.1f}")
    return f"{m} / {w}"


def print_table(cells: dict[str, dict[str, object]]) -> None:
    print(f"\n{'fault':<16}{'tool':<14}{'n':>3}  {'detect med/worst':>17}  {'1st new step':>14}  "
          f"{'redone':>9}  {'recov':>5} {'surv':>5} {'node again':>10} {'left':>4} {'loss=':>5}")  # fmt: skip
    for c in cells.values():
        n = c["n"]
        print(
            f"{c['fault']:<16}{c['tool']:<14}{n:>3}  {_fmt(c['detect_s']):>17}  {_fmt(c['first_new_step_s']):>14}  "
            f"{_fmt(c['steps_redone']):>9}  {c['recovered']:>2}/{n:<2} {c['survived']:>2}/{n:<2} "
            f"{c['faulty_node_trained_after']:>7}/{n:<2} {c['left_behind_max']:>4} {c['losses_equal']:>2}/{n:<2}",
            flush=True,
        )


def _med_worst(values: list[float | None], cap_s: float, unit: str = " s") -> str:
    """'median (worst)' over every trial, a trial without a value (> cap) ranking above all others."""
    if not values:
        return "-"
    ranked = sorted(float("inf") if v is None else v for v in values)
    med = _median(ranked)

    def one(v: float) -> str:
        return f"> {cap_s:.0f} s" if v == float("inf") else f"{v:.1f}{unit}" if unit else f"{v:.0f}"

    return f"{one(med)} ({one(ranked[-1])})"


def _median(ranked: list[float]) -> float:
    """The median of sorted values that may hold inf (> cap): inf when the middle is."""
    mid = len(ranked) // 2
    return ranked[mid] if len(ranked) % 2 else (ranked[mid - 1] + ranked[mid]) / 2


def markdown(results: dict[str, object]) -> str:
    """BENCHMARKS.md's tables from a results file: one per fault, one row per tool."""
    env = results["environment"]
    assert isinstance(env, dict)
    cap_s = float(env["cap_s"])
    trials = [Trial(**{**t, "reactions": tuple(t["reactions"]), "left_behind_what": tuple(t["left_behind_what"])})
              for t in results["trials"]]  # fmt: skip
    out: list[str] = []
    best: dict[str, tuple[str, float]] = {}
    for fault in FAULTS:
        rows = [t for t in trials if t.fault == fault]
        if not rows:
            continue
        out += [f"**{fault}**", "",
                "| tool | n | survived | recovered | detect, median (worst) | fault -> first new step, median (worst) "
                "| steps redone | faulty node in next attempt | left behind (max) | losses = uninterrupted |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for tool in TOOLS:
            mine = [t for t in rows if t.tool == tool and t.started]
            if not mine:
                continue
            n = len(mine)
            calm = sum(t.outcome == "not interrupted" for t in mine)
            hit = [t for t in mine if t.outcome != "not interrupted"]
            first = _med_worst([t.first_new_step_s for t in hit], cap_s) if hit else "-"
            if calm:
                first += f"; {calm}/{n} not interrupted"
            ended = sum(t.outcome == "run ended" for t in mine)
            n_rec = sum(t.outcome == "recovered" for t in mine)
            recovered = f"{n_rec}/{n}" + (f" ({ended} ended)" if ended else "")
            # steps redone: of the trials that recovered (no restart, nothing redone yet)
            redone_of = [float(t.steps_redone) for t in hit if t.steps_redone is not None]
            redone = _med_worst(list(redone_of), cap_s, "") if redone_of else "-"
            detect = (
                _med_worst([t.detect_s for t in hit], cap_s)
                if hit
                else f"none in {UNINTERRUPTED_WINDOW_S:.0f} s"
            )
            again = [t.faulty_node_trained_after for t in hit if t.faulty_node_trained_after is not None]
            again_s = f"{sum(again)}/{len(again)}" if again else "-"
            compared = [t for t in mine if t.losses_equal is not None]
            losses = f"{sum(bool(t.losses_equal) for t in compared)}/{len(compared)}" if compared else "-"
            out.append(
                f"| {tool} | {n} | {sum(t.survived for t in mine)}/{n} | {recovered} "
                f"| {detect} | {first} | {redone} | {again_s} "
                f"| {max(t.left_behind for t in mine)} | {losses} |"
            )
            times = sorted(float("inf") if t.first_new_step_s is None else t.first_new_step_s for t in hit)
            med = _median(times) if times else float("inf")
            if tool != "runwarden" and med != float("inf") and (fault not in best or med < best[fault][1]):
                best[fault] = (tool, med)
        rw = sorted(float("inf") if t.first_new_step_s is None else t.first_new_step_s
                    for t in rows if t.tool == "runwarden" and t.started and t.outcome != "not interrupted")  # fmt: skip
        if rw:
            out.append("")
            if fault in best:
                peer, peer_med = best[fault]
                ratio = _median(rw) / peer_med
                out.append(f"runwarden / best peer ({peer}), fault -> first new step, medians: {ratio:.2f}")
            else:
                out.append(
                    f"runwarden / best peer: no peer had a first new step after a restart within {cap_s:.0f} s"
                )
        out.append("")
    return "\n".join(out)


def environment(
    tools: Sequence[str], cap_s: float, settle_s: float, argv: Sequence[str]
) -> dict[str, object]:
    configs: dict[str, object] = {
        name: peer.config() for name, peer in peer_configs().items() if name in tools
    }
    if "runwarden" in tools:
        configs["runwarden"] = RunwardenDeployment.config()
    return {
        "command": " ".join(argv),
        "versions": {
            "torch": torch.__version__,
            "nvidia-resiliency-ext": launchers.nvrx_version() if "nvrx" in tools else "not run",
            "python": platform.python_version(),
        },
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "cap_s": cap_s,
        "world": f"{WORLD} nodes x 1 rank (runwarden: +2 spares)",
        "victim_rank": VICTIM_RANK,
        "warm_step": WARM_STEP,
        "settle_s": settle_s,
        "job": job_args(Path("<trial>")),
        "configs": configs,
    }


def write(out: Path | None, env: dict[str, object], trials: list[Trial], cap_s: float, wall_s: float) -> None:
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"environment": env, "wall_s": wall_s, "cells": summarize(trials, cap_s),
            "trials": [asdict(t) for t in trials]}  # fmt: skip
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--trials", type=int, default=5, help="trials per (tool, fault)")
    p.add_argument("--cap", type=float, default=120.0, help="seconds after the fault before a trial gives up")
    p.add_argument(
        "--settle", type=float, default=SETTLE_S, help="seconds after the job's first step before the fault"
    )
    p.add_argument("--reference-steps", type=int, default=150, help="0: no reference run (own losses only)")
    p.add_argument(
        "--budget", type=float, default=0.0, help="start no trial after this many seconds (0: none)"
    )
    p.add_argument("--end-by", default="", help="HH:MM (local): start no trial that could run past it")
    p.add_argument("--out", type=Path)
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument(
        "--markdown", type=Path, help="print BENCHMARKS.md's tables from this results file, run nothing"
    )
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    # `timeout`'s SIGTERM: unwind, so the running trial's cleanup (its finally) still kills its processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tools = [t for t in args.tools.split(",") if t]
    faults = [f for f in args.faults.split(",") if f]
    for t in tools:
        if t not in TOOLS:
            p.error(f"unknown tool {t}; choose from {TOOLS}")
    for f in faults:
        if f not in FAULTS:
            p.error(f"unknown fault {f}; choose from {FAULTS}")
    t0 = time.time()
    end_by = None
    if args.end_by:
        hh, mm = (int(x) for x in args.end_by.split(":"))
        now = time.localtime()
        end_by = time.mktime((now.tm_year, now.tm_mon, now.tm_mday, hh, mm, 0, 0, 0, -1))
    env = environment(
        tools, args.cap, args.settle, ["bench/bench_peers.py", *(sys.argv[1:] if argv is None else argv)]
    )
    print(json.dumps(env, indent=1), flush=True)
    reference = reference_losses(args.reference_steps, args.workdir) if args.reference_steps > 0 else {}
    print(f"reference run: {len(reference)} losses", flush=True)
    trials: list[Trial] = []
    for rnd in range(args.trials):
        for fi, fault in enumerate(faults):
            k = (rnd + fi) % len(tools)
            for tool in tools[k:] + tools[:k]:  # rotate so no tool always runs first or last
                late = end_by is not None and time.time() + args.cap + 90 > end_by
                if late or (args.budget and time.time() - t0 > args.budget):
                    print(
                        f"time is up (--budget / --end-by): stopping after {len(trials)} trials",
                        flush=True,
                    )
                    write(args.out, env, trials, args.cap, time.time() - t0)
                    print_table(summarize(trials, args.cap))
                    return 0
                try:
                    trial = run_trial(tool, fault, rnd, args.cap, reference, args.workdir, args.settle)
                except Exception as exc:  # one broken trial is a result too; the others go on
                    trial = failed_trial(tool, fault, rnd, f"error: {type(exc).__name__}: {exc}")
                trials.append(trial)
                print(
                    f"[{time.time() - t0:6.0f}s] round {rnd} {fault:<16} {tool:<13} {trial.outcome:<22} "
                    f"detect={trial.detect_s} first_new={trial.first_new_step_s} redone={trial.steps_redone} "
                    f"node_again={trial.faulty_node_trained_after} left={trial.left_behind} "
                    f"loss_eq={trial.losses_equal}({trial.losses_compared}) wall={trial.wall_s:.0f}s",
                    flush=True,
                )
                write(args.out, env, trials, args.cap, time.time() - t0)
    print_table(summarize(trials, args.cap))
    return 0


if __name__ == "__main__":
    sys.exit(main())
