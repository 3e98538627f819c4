"""Issue 19: an LLM-style job supervised end to end, and the loss rules on it.

One cluster for the module (etcd, 6 agents, the controller; torchrun + gloo on CPU) runs
examples/decoder.py (a decoder-only transformer: gradient accumulation, AdamW, a cosine schedule,
DCP async saves, dropout) with two test-only switches. In order:

1. a clean start: attempt 1 reports a NaN loss for step 8 (`--test-nan-at-step`): a LOSS_ANOMALY
   within one report interval; and 200 steps in which nobody is flagged a straggler;
2. a straggler: `controllerctl chaos NODE slow-rank` on node rank 2; the decoder's loop has no
   timer, so the flag comes from the reporter's own measurements (a hook on DDP's all-reduce);
3. node loss, hang and crash (examples/demo.py's faults, one at a time, each recovered before the
   next);
4. the crash's resume skips restoring the RNG states (`--test-skip-rng-restore-if`, a file the test
   creates just before that fault, injected 5-15 steps past a commit): its replay diverges, a
   DIVERGENCE within the replayed steps.

Every loss rank 0 logged before that last resume, replays included, equals an uninterrupted run's
(torchrun --standalone, same seed and world size) within 1e-6 (not bit for bit: DDP's first
iteration after a resume reduces with its initial bucket layout, which differs from the rebuilt
one, so a resumed attempt's losses differ from the uninterrupted run's in the last bits). The
reference run trains alongside the cluster at nice 19 (it takes the CPU the cluster leaves idle:
start-up, detection and restarts), for the run's `steps` (the supervised run is capped there). This module replaced
tests/e2e/test_loss_checks.py, which started a cluster of its own for item 1's NaN and item 4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from examples.cluster import REPO, ClusterSpec, LocalCluster, leftover_processes
from examples.demo import Recovery, current_nodes, last_seq, recoveries, run_faults
from nodeagent.checkpoint import read_commit, step_dir
from runwarden.eventlog import read_events
from runwarden.v1 import events_pb2
from tests.e2e.five_faults import EXPECTED_DETECTOR

E = events_pb2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(540)]
FAULTS = ["node-lost", "hang", "crash"]  # the crash last: its resume skips the RNG states
CLEAN_STEPS = 200
STEPS = 800  # the supervised run's cap and the reference run's length
NAN_STEP = 8
REPORT_INTERVAL_S = 1.0 + 0.5  # the trainer's flush_interval_s + the test agents' progress_interval_s


@dataclass
class DecoderRun:
    cluster: LocalCluster
    events: list[events_pb2.Event]
    recoveries: list[Recovery]
    straggler_victim: str
    straggler_at_seq: int
    skip_rng_attempt: int  # the first attempt whose resume skipped the RNG states
    reference: Path  # the uninterrupted run's loss dir
    torn_tail: str | None
    log_errors: int


def _tail(cluster: LocalCluster) -> str:
    return (cluster.run_dir / "controller.log").read_text()[-4000:]


def _step(cluster: LocalCluster) -> int:
    return int(str(cluster.status().get("current_step", -1)))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DecoderRun]:
    root = tmp_path_factory.mktemp("decoder")
    skip_rng = root / "skip-rng-restore"
    spec = ClusterSpec(
        run="decoder",
        script="examples/decoder.py",
        steps=STEPS,
        ckpt_every=50,
        step_sleep=0.05,
        train_args=("--test-nan-at-step", str(NAN_STEP), "--test-skip-rng-restore-if", str(skip_rng)),
    )
    cluster = LocalCluster(root / "cluster", spec)
    reference: subprocess.Popen[bytes] | None = None
    try:
        reference = _start_reference(spec, root)
        cluster.start()
        assert cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 150) is not None, _tail(cluster)
        deadline = time.monotonic() + 90
        while _step(cluster) < CLEAN_STEPS:
            assert time.monotonic() < deadline, f"no step {CLEAN_STEPS} in 90 s\n{_tail(cluster)}"
            time.sleep(0.5)
        victim = current_nodes(cluster)[2]
        straggler_at = last_seq(cluster)
        out = cluster.ctl("chaos", victim, "slow-rank", "--seconds", "0.15")
        assert out.returncode == 0, out.stderr
        flagged = cluster.wait_for_event(
            E.EVENT_KIND_DETECTION,
            straggler_at,
            60,
            pred=lambda e: e.detection.detector == E.DETECTOR_STRAGGLER,
        )
        assert flagged is not None, _tail(cluster)
        injections = run_faults(cluster, FAULTS[:-1], timeout_s=90)
        _wait_past_a_commit(cluster)  # so the node loss rolls back steps the controller has losses of
        skip_rng.touch()  # the next resume (after the crash) skips the RNG states
        injections += run_faults(cluster, FAULTS[-1:], timeout_s=90)
        div = cluster.wait_for_event(E.EVENT_KIND_DIVERGENCE, injections[-1].after_seq, 60)
        assert div is not None, _tail(cluster)
        time.sleep(REPORT_INTERVAL_S)
        cluster.ctl("stop", spec.run, "--reason", "test finished")
        assert cluster.wait_for_event(E.EVENT_KIND_RUN_END, 0, 90) is not None, _tail(cluster)
    finally:
        cluster.stop()
        if reference is not None:
            try:
                reference.wait(timeout=300)
            finally:
                if reference.poll() is None:
                    reference.kill()
    assert reference is not None and reference.returncode == 0, (root / "reference.log").read_text()[-3000:]
    read = read_events(cluster.event_log)
    skip_launch = next(
        e for e in read.events if e.kind == E.EVENT_KIND_LAUNCH and e.seq > injections[-1].after_seq
    )
    yield DecoderRun(
        cluster=cluster,
        events=read.events,
        recoveries=recoveries(read.events, injections),
        straggler_victim=victim,
        straggler_at_seq=straggler_at,
        skip_rng_attempt=skip_launch.attempt,
        reference=root / "reference",
        torn_tail=read.torn_tail,
        log_errors=len(read.errors),
    )
    assert leftover_processes(cluster.root) == []


def _start_reference(spec: ClusterSpec, root: Path) -> subprocess.Popen[bytes]:
    """The same job uninterrupted: torchrun --standalone, same world size and seed, no sleep, at
    nice 19 (the cluster's ranks come first)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNWARDEN_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    with (root / "reference.log").open("wb") as log:
        return subprocess.Popen(
            [
                "nice",
                "-n",
                "19",
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={spec.active}",
                "--max-restarts=0",
                str(REPO / spec.script),
                *("--steps", str(spec.steps), "--ckpt-every", str(spec.steps), "--seed", str(spec.seed)),
                *(
                    "--step-sleep",
                    "0",
                    "--ckpt-dir",
                    str(root / "reference-ckpt"),
                    "--out",
                    str(root / "reference"),
                ),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=root,
        )


def _wait_past_a_commit(cluster: LocalCluster) -> None:
    """Until the run is 5 to 15 steps past its newest commit (it commits every 50): the crash then
    rolls back steps whose losses the controller has, and lands before the next save."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        commits = [e.step for e in cluster.events() if e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT]
        if commits and 5 <= _step(cluster) - max(commits) <= 15:
            return
        time.sleep(0.2)
    raise AssertionError(f"never 5..15 steps past a commit in 30 s\n{_tail(cluster)}")


def _of(run: DecoderRun, kind: int) -> list[events_pb2.Event]:
    return [e for e in run.events if e.kind == kind]


def _rank0(run: DecoderRun) -> list[dict[str, float]]:
    return [json.loads(x) for x in (run.cluster.loss_dir / "loss-rank0.jsonl").read_text().splitlines()]


def test_crash_hang_and_node_loss_detected_blamed_and_recovered(run: DecoderRun) -> None:
    assert [r.injection.fault for r in run.recoveries] == FAULTS
    for r in run.recoveries:
        fault, node = r.injection.fault, r.injection.node
        assert r.injection.recovered and r.first_step is not None, f"{fault}: no first step after it"
        assert r.detection is not None and r.detection.detection.detector == EXPECTED_DETECTOR[fault], fault
        assert r.attribution is not None and r.attribution.attribution.suspects, f"{fault}: no suspect"
        blamed = r.attribution.attribution.suspects[0].node
        assert blamed == node, f"{fault}: blamed {blamed}, injected into {node}: {r.attribution.message}"
    assert run.torn_tail is None and run.log_errors == 0
    assert [e.seq for e in run.events] == list(range(1, len(run.events) + 1))


def test_every_resume_is_a_committed_dcp_step_with_a_fresh_rendezvous(run: DecoderRun) -> None:
    committed: set[int] = set()
    launches = 0
    for ev in run.events:
        if ev.kind == E.EVENT_KIND_CHECKPOINT_COMMIT:
            committed.add(ev.step)
        elif ev.kind == E.EVENT_KIND_LAUNCH:
            launches += 1
            assert ev.launch.rendezvous_id == f"{ev.run}-{ev.attempt}"
            assert ev.launch.resume_step == (max(committed) if committed else -1), ev.message
    assert launches >= 1 + len(FAULTS)
    # Each resume point is a whole DCP commit on disk (not the newest directory: a superseded
    # attempt may commit after the controller moved on, and is never resumed from).
    for ev in run.events:
        if ev.kind == E.EVENT_KIND_LAUNCH and ev.launch.resume_step >= 0:
            commit = read_commit(step_dir(run.cluster.ckpt_dir, ev.launch.resume_step))
            assert commit is not None and commit.meta["format"] == "dcp", ev.message


def test_automatic_timing_flags_the_slowed_rank_and_no_one_on_the_clean_run(run: DecoderRun) -> None:
    source = (REPO / "examples" / "decoder.py").read_text()
    for timing_code in ("perf_counter", "monotonic", "waiting(", "compute_s", "wait_s", "step_time_s"):
        assert timing_code not in source, f"examples/decoder.py times itself: {timing_code}"
    before = [e for e in _of(run, E.EVENT_KIND_DETECTION) if e.seq <= run.straggler_at_seq]
    assert before == [], [e.message for e in before]
    first_attempt_steps = {int(r["step"]) for r in _rank0(run) if r["attempt"] == 1}
    assert max(first_attempt_steps) >= CLEAN_STEPS
    flagged = [
        e
        for e in _of(run, E.EVENT_KIND_DETECTION)
        if e.detection.detector == E.DETECTOR_STRAGGLER and e.seq > run.straggler_at_seq
    ]
    assert flagged and list(flagged[0].detection.nodes) == [run.straggler_victim], flagged[0].message
    assert flagged[0].seq <= run.recoveries[0].injection.after_seq  # flagged before the first fault


def test_an_injected_nan_is_caught_within_one_report_interval(run: DecoderRun) -> None:
    (nan,) = [e for e in _of(run, E.EVENT_KIND_LOSS_ANOMALY) if e.loss.rule == "non_finite"]
    assert nan.attempt == 1 and nan.step == NAN_STEP and nan.loss.action == "page"
    stepped = next(r for r in _rank0(run) if r["attempt"] == 1 and r["step"] == NAN_STEP - 1)  # 0-based
    assert nan.ts - stepped["ts"] <= REPORT_INTERVAL_S + 1.0, nan.ts - stepped["ts"]
    assert any(e.kind == E.EVENT_KIND_PAGE and e.seq > nan.seq for e in run.events)


def test_a_resume_without_the_rng_state_is_a_divergence_within_the_replayed_steps(run: DecoderRun) -> None:
    divergences = _of(run, E.EVENT_KIND_DIVERGENCE)
    assert divergences, "no DIVERGENCE"
    assert all(e.attempt >= run.skip_rng_attempt for e in divergences), "a faithful resume diverged"
    div = divergences[0]
    launch = next(e for e in _of(run, E.EVENT_KIND_LAUNCH) if e.attempt == div.attempt)
    resumed = launch.launch.resume_step
    before = max(int(r["step"]) + 1 for r in _rank0(run) if r["attempt"] < div.attempt)
    (p,) = div.loss.points
    assert resumed < p.step <= before  # within the replayed steps
    assert p.earlier_attempt < div.attempt and p.rel_diff > 1e-6
    shown = run.cluster.ctl(
        "compare-loss", run.cluster.spec.run, "--json", "--log", str(run.cluster.event_log)
    )
    assert shown.returncode == 0, shown.stderr
    attempts = {a["attempt"]: a for a in json.loads(shown.stdout)["attempts"]}
    assert attempts[div.attempt]["diverged"] and attempts[div.attempt]["resume_step"] == resumed
    assert attempts[div.attempt]["divergence"]["step"] == p.step


def test_losses_equal_an_uninterrupted_run(run: DecoderRun) -> None:
    """Rank 0's loss at every step of every attempt before the RNG-skipping one, replays included."""
    got: dict[int, list[float]] = defaultdict(list)
    for r in _rank0(run):
        if r["attempt"] < run.skip_rng_attempt:
            got[int(r["step"])].append(float(r["loss"]))
    lines = (run.reference / "loss-rank0.jsonl").read_text().splitlines()
    want = {int(r["step"]): float(r["loss"]) for r in map(json.loads, lines)}
    assert max(got) < max(want) + 1 == run.cluster.spec.steps, "the reference does not cover the run"
    replayed = 0
    for step, values in sorted(got.items()):
        replayed += len(values) > 1
        for value in values:
            assert value == pytest.approx(want[step], rel=1e-6, abs=1e-6), (
                f"step {step}: {value} vs {want[step]}"
            )
    assert replayed > 0, "no step was replayed after a resume: the faults rolled nothing back"
