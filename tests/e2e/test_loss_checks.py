"""The loss rules on the real example job (etcd, agents, controller, torchrun gloo workers on CPU).

One cluster, one run of examples/train.py with dropout (the loop uses the RNG) and two test-only
switches: attempt 1 reports a NaN loss for step 8 (`--test-nan-at-step`), and every resume skips
restoring the RNG states (`--test-skip-rng-restore`). The NaN is a LOSS_ANOMALY within one report
interval (the rank's send, 1 s, plus the agent's etcd write, 0.5 s); a rank killed a few steps
past a commit makes attempt 2 replay those steps with other dropout masks: a DIVERGENCE within the
replayed steps, shown by `controllerctl compare-loss`.
"""

from __future__ import annotations

import json
import time

import pytest

from examples.cluster import LocalCluster
from runwarden.v1 import events_pb2

E = events_pb2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
REPORT_INTERVAL_S = 1.0 + 0.5  # the trainer's flush_interval_s + the test agents' progress_interval_s


def _log(cluster: LocalCluster) -> str:
    return (cluster.run_dir / "controller.log").read_text()[-3000:]


def _rank0_lines(cluster: LocalCluster) -> list[dict[str, float]]:
    return [json.loads(x) for x in (cluster.loss_dir / "loss-rank0.jsonl").read_text().splitlines()]


def test_an_injected_nan_and_a_resume_without_the_rng_state_are_caught(make_cluster) -> None:
    cluster: LocalCluster = make_cluster(
        active=2,
        spares=0,
        ckpt_every=100,  # commits far apart (~6 s): the rank is killed well past one, before the next
        train_args=("--dropout", "0.2", "--test-skip-rng-restore", "--test-nan-at-step", "8"),
    )
    nan = cluster.wait_for_event(E.EVENT_KIND_LOSS_ANOMALY, 0, 150)
    assert nan is not None, _log(cluster)
    assert nan.attempt == 1 and nan.step == 8 and nan.loss.rule == "non_finite" and nan.loss.action == "page"
    stepped = next(r for r in _rank0_lines(cluster) if r["attempt"] == 1 and r["step"] == 7)  # 0-based
    assert nan.ts - stepped["ts"] <= REPORT_INTERVAL_S + 1.0, nan.ts - stepped["ts"]
    assert cluster.wait_for_event(E.EVENT_KIND_PAGE, nan.seq - 1, 10) is not None

    commit = cluster.wait_for_event(E.EVENT_KIND_CHECKPOINT_COMMIT, nan.seq, 90, pred=lambda e: e.step >= 100)
    assert commit is not None, _log(cluster)
    deadline = time.monotonic() + 30
    while True:  # the controller has every node's losses a few steps past the commit: they are replayed
        status = cluster.status()
        seen = int(str(status.get("current_step", -1)))
        if seen >= commit.step + 5 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert commit.step + 5 <= seen < commit.step + 60, (seen, commit.step)  # the ranks are ~1.5 s ahead
    nodes = [e for e in cluster.events() if e.kind == E.EVENT_KIND_LAUNCH][-1].launch.nodes
    out = cluster.ctl("chaos", nodes[1], "kill-rank")
    assert out.returncode == 0, out.stderr
    div = cluster.wait_for_event(E.EVENT_KIND_DIVERGENCE, commit.seq, 150)
    assert div is not None, _log(cluster)
    launch2 = next(e for e in cluster.events() if e.kind == E.EVENT_KIND_LAUNCH and e.attempt == div.attempt)
    resumed = launch2.launch.resume_step
    last_of_attempt_1 = max(int(r["step"]) + 1 for r in _rank0_lines(cluster) if r["attempt"] == 1)
    (p,) = div.loss.points
    assert resumed >= commit.step and resumed < p.step <= last_of_attempt_1  # within the replayed steps
    assert p.earlier_attempt == 1 and p.rel_diff > 1e-6 and div.attempt >= 2

    time.sleep(REPORT_INTERVAL_S + 1.0)
    shown = cluster.ctl("compare-loss", cluster.spec.run, "--json", "--log", str(cluster.event_log))
    assert shown.returncode == 0, shown.stderr
    attempts = {a["attempt"]: a for a in json.loads(shown.stdout)["attempts"]}
    assert attempts[div.attempt]["diverged"] and attempts[div.attempt]["resume_step"] == resumed
    assert attempts[div.attempt]["divergence"]["step"] == p.step
