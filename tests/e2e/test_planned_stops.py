"""Issue 16: every planned stop is uniform. On one real cluster (etcd, agents, the controller, torchrun
with gloo on CPU), four kinds of planned stop each end the attempt with a commit and a relaunch
from it, and nothing is ever quarantined nor a restart of the budget used:

* `controllerctl stop RUN --relaunch` (a planned restart, the same nodes);
* `controllerctl drain NODE` (maintenance: a spare takes the node's rank; `--undo` brings it back);
* SIGTERM to a node's agent (`systemctl stop nodeagent`: the same hand-over, and the agent exits);
* SIGTERM to one rank (Kubernetes' notice, scancel): the ranks agree to stop, save, commit, exit 0,
  and the exit is a planned stop, not the end of training.

The steps share the cluster and run in order (each starts from the attempt the previous one left).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from examples.cluster import ClusterSpec, LocalCluster, leftover_processes
from runwarden.eventlog import LogEntry
from runwarden.v1 import events_pb2

E = events_pb2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
RELAUNCH_S = 90.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(warm_workers=False, active=2, spares=2, ckpt_every=5)
    c = LocalCluster(tmp_path_factory.mktemp("planned") / "cluster", spec)
    try:
        c.start()
        assert c.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 150) is not None, _tail(c)
        yield c
    finally:
        c.stop()
    assert not leftover_processes(c.root, wait_s=10), "the cluster left processes behind"


def _tail(c: LocalCluster) -> str:
    log = c.run_dir / "controller.log"
    return log.read_text(errors="replace")[-3000:] if log.exists() else "(no controller log)"


def _last_seq(c: LocalCluster) -> int:
    events = c.events()
    return events[-1].seq if events else 0


def _current_launch(c: LocalCluster) -> LogEntry:
    return next(e for e in reversed(c.events()) if e.kind == E.EVENT_KIND_LAUNCH)


def _relaunched(c: LocalCluster, mark: int, what: str) -> LogEntry:
    """The next attempt's launch after `mark`, and its first step past the resume point."""
    launch = c.wait_for_event(E.EVENT_KIND_LAUNCH, mark, RELAUNCH_S)
    assert launch is not None, f"{what}: no relaunch\n{_tail(c)}"
    first = c.wait_for_event(E.EVENT_KIND_FIRST_STEP, launch.seq, RELAUNCH_S)
    assert first is not None, f"{what}: the relaunched attempt took no step\n{_tail(c)}"
    return launch


def _assert_planned(c: LocalCluster, mark: int, launch: LogEntry, what: str) -> None:
    between = [e for e in c.events() if mark < e.seq < launch.seq]
    kinds = {e.kind for e in between}
    assert E.EVENT_KIND_STOP_REQUEST in kinds, f"{what}: not handled as a planned stop"
    assert E.EVENT_KIND_QUARANTINE not in kinds, f"{what}: something was quarantined"
    assert E.EVENT_KIND_DETECTION not in kinds, f"{what}: treated as a failure"
    commits = [e.step for e in between if e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT]
    assert commits, f"{what}: the stop did not commit a checkpoint"
    assert launch.launch.resume_step == max(commits), f"{what}: not relaunched from the stop's commit"
    assert not any(e.kind == E.EVENT_KIND_RUN_END for e in between), f"{what}: the run ended"


def _budget_left(c: LocalCluster) -> int:
    return int(c.status().get("restart_budget_left", -1))


def test_stop_with_relaunch_is_a_planned_restart_on_the_same_nodes(cluster: LocalCluster) -> None:
    c = cluster
    before = _current_launch(c)
    budget = _budget_left(c)
    mark = _last_seq(c)
    out = c.ctl("stop", c.spec.run, "--relaunch", "--reason", "new config")
    assert out.returncode == 0 and "restart requested" in out.stdout, out.stderr
    launch = _relaunched(c, mark, "stop --relaunch")
    _assert_planned(c, mark, launch, "stop --relaunch")
    assert list(launch.launch.nodes) == list(before.launch.nodes), "a planned restart keeps its nodes"
    assert _budget_left(c) == budget, "a planned restart uses no restart of the budget"


def test_drain_hands_the_node_rank_to_a_spare_and_undo_brings_it_back(cluster: LocalCluster) -> None:
    c = cluster
    victim = _current_launch(c).launch.nodes[1]
    mark = _last_seq(c)
    out = c.ctl("drain", victim, "--reason", "firmware update")
    assert out.returncode == 0 and "draining" in out.stdout, out.stderr
    launch = _relaunched(c, mark, "drain")
    _assert_planned(c, mark, launch, "drain")
    assert victim not in launch.launch.nodes
    spares = [e for e in c.events() if e.seq > mark and e.kind == E.EVENT_KIND_SPARE_TAKEN]
    assert spares and spares[0].spare.replaces == victim
    out = c.ctl("drain", victim, "--undo")
    assert out.returncode == 0 and "in service" in out.stdout, out.stderr
    back = c.wait_for_event(E.EVENT_KIND_RELEASE, mark, 30, pred=lambda e: victim in e.message)
    assert back is not None and "back in service" in back.message


def test_sigterm_to_an_agent_is_a_drain_and_the_agent_leaves_cleanly(cluster: LocalCluster) -> None:
    c = cluster
    victim = _current_launch(c).launch.nodes[0]
    agent = c.agents[victim]
    mark = _last_seq(c)
    agent.send_signal(signal.SIGTERM)
    launch = _relaunched(c, mark, "agent SIGTERM")
    _assert_planned(c, mark, launch, "agent SIGTERM")
    assert victim not in launch.launch.nodes
    assert agent.wait(timeout=60) == 0, "the agent exits 0 once its ranks are gone"
    left = c.wait_for_event(E.EVENT_KIND_NODE_LOST, mark, 30, pred=lambda e: e.node.node == victim)
    assert left is not None and "left after draining" in left.message
    c.start_agent(victim)  # what systemd would do when the host comes back


def _rank_pids(node: str, attempt: int, root: Path) -> list[int]:
    """The worker processes (they have LOCAL_RANK; torchrun itself does not) of `node`'s attempt in
    the cluster under `root` (another test's cluster may run a node of the same name meanwhile)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(
                kv.split("=", 1)
                for kv in (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                if "=" in kv
            )
        except OSError:
            continue
        if (
            env.get("RUNWARDEN_NODE") == node
            and env.get("RUNWARDEN_ATTEMPT") == str(attempt)
            and "LOCAL_RANK" in env
            and any(str(root) in value for value in env.values())
        ):
            found.append(int(entry.name))
    return found


def test_sigterm_to_one_rank_is_a_planned_stop_not_the_end_of_training(cluster: LocalCluster) -> None:
    c = cluster
    current = _current_launch(c)
    node = current.launch.nodes[1]
    deadline = time.monotonic() + 30
    while not (pids := _rank_pids(node, current.attempt, c.root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert pids, f"no rank of attempt {current.attempt} found on {node}"
    mark = _last_seq(c)
    os.kill(pids[0], signal.SIGTERM)
    launch = _relaunched(c, mark, "rank SIGTERM")
    _assert_planned(c, mark, launch, "rank SIGTERM")
    assert sorted(launch.launch.nodes) == sorted(current.launch.nodes), "nothing to replace"
    assert not any(e.kind == E.EVENT_KIND_QUARANTINE for e in c.events()), "nothing quarantined, ever"
