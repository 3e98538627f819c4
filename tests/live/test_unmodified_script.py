"""Issue 19, an unmodified script still supervised: a plain DDP script (tests/nodeagent/plain_ddp.py,
no runwarden import) run with `[controller] script_mode = "unmodified"`, so every agent runs it
through nodeagent.trainer.bootstrap, on one real cluster (etcd, four agents with warm workers, the
controller, torchrun with gloo on CPU). The controller's existing rules, unchanged, see it:

* a rank slowed in its forward pass is flagged as the persistent straggler (rank and node);
* a SIGSTOPped rank is detected as a hang and blamed on its node (the flight recorder's rung);
* a SIGKILLed rank is a crash blamed on its node (first to exit).

The steps share the cluster and run in order. The config checks of the option come first (no cluster).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.backends.agents import AgentClients
from controller.backends.base import AttemptSpec, BackendError
from controller.backends.local import LocalBackend, LocalConfig, Rendezvous
from controller.live.config import RunSection
from examples.cluster import ClusterSpec, LocalCluster, leftover_processes
from runwarden.config import ConfigError
from runwarden.eventlog import LogEntry
from runwarden.v1 import agent_pb2, events_pb2

E = events_pb2
PLAIN_DDP = Path(__file__).resolve().parents[1] / "nodeagent" / "plain_ddp.py"
WAIT_S = 120.0


def test_the_script_mode_is_validated_and_reaches_every_nodes_launch(tmp_path: Path) -> None:
    section = RunSection(run="r", nodes=1, command=("train.py",), run_dir=tmp_path, script_mode="unmodified")
    assert section.script_mode == "unmodified"
    assert RunSection(run="r", nodes=1, command=("train.py",), run_dir=tmp_path).script_mode == "instrumented"
    with pytest.raises(ConfigError, match="script_mode"):
        RunSection(run="r", nodes=1, command=("train.py",), run_dir=tmp_path, script_mode="plain")
    with pytest.raises(ConfigError, match="a script or -m MODULE"):
        RunSection(run="r", nodes=1, command=("-u", "t.py"), run_dir=tmp_path, script_mode="unmodified")
    with pytest.raises(BackendError, match="script_mode"):
        LocalConfig(script_mode="plain")
    with pytest.raises(BackendError, match="no_python"):
        LocalConfig(script_mode="unmodified", no_python=True)
    with pytest.raises(BackendError, match="launch_timeout_s"):
        LocalConfig(launch_timeout_s=0)
    backend = LocalBackend(
        AgentClients(),
        {"a": Rendezvous(host="10.0.0.1", port=29400)}.get,
        LocalConfig(script_mode="unmodified"),
    )
    spec = AttemptSpec(run="r", attempt=1, nodes=("a", "b"), command=("train.py",))
    reqs = backend.requests(spec, endpoint="10.0.0.1:29400")
    assert [r.torchrun.script_mode for _, r in reqs] == [agent_pb2.SCRIPT_MODE_UNMODIFIED] * 2
    plain = LocalBackend(AgentClients(), {"a": Rendezvous(host="10.0.0.1", port=29400)}.get)
    assert plain.requests(spec, endpoint="10.0.0.1:29400")[0][1].torchrun.script_mode == (
        agent_pb2.SCRIPT_MODE_INSTRUMENTED
    )


class UnmodifiedCluster(LocalCluster):
    """LocalCluster running the plain DDP script through the bootstrap instead of examples/train.py."""

    def __init__(self, root: Path, spec: ClusterSpec) -> None:
        super().__init__(root, spec)
        self.faults = self.root / "faults"

    def controller_settings(self) -> dict[str, dict[str, object]]:
        self.faults.mkdir(parents=True, exist_ok=True)
        settings = super().controller_settings()
        settings["controller"]["command"] = [
            str(PLAIN_DDP),
            "--steps",
            "1000000",
            "--step-sleep",
            "0.05",
            "--slow-s",
            "0.15",
            "--fault-dir",
            str(self.faults),
        ]
        settings["controller"]["script_mode"] = "unmodified"
        return settings

    def _start_controller(self) -> None:
        # The first launch waits at most warm_wait_s (30 s) for a group still importing torch, past
        # the controller's 10 s launch deadline on two loaded cores: the groups park first.
        deadline = time.monotonic() + WAIT_S
        logs = [self.root / "nodes" / node / "agent.log" for node in self.nodes]
        while self.spec.warm_workers and not all(
            log.exists() and "rank(s) parked in" in log.read_text(errors="replace") for log in logs
        ):
            assert time.monotonic() < deadline, "the agents' warm groups did not park"
            time.sleep(0.2)
        super()._start_controller()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UnmodifiedCluster]:
    spec = ClusterSpec(
        run="plain",
        active=2,
        spares=2,
        warm_workers=True,
        policy={"hang_timeout_floor_s": 4.0, "straggler_window": 8},
    )
    c = UnmodifiedCluster(tmp_path_factory.mktemp("unmodified") / "cluster", spec)
    try:
        c.start()
        yield c
    finally:
        c.stop()
    assert not leftover_processes(c.root, wait_s=10), "the cluster left processes behind"


def _tail(c: LocalCluster) -> str:
    log = c.run_dir / "controller.log"
    text = log.read_text(errors="replace")[-3000:] if log.exists() else "(no controller log)"
    events = "\n".join(
        f"{e.seq} {E.EventKind.Name(e.kind)} a{e.attempt}: {e.message}" for e in c.events()[-25:]
    )
    return f"{events}\n--- controller.log ---\n{text}"


def _running(c: LocalCluster, attempt: int) -> LogEntry:
    """The launch of `attempt` once its ranks took a step (through the bootstrap)."""
    launch = c.wait_for_event(E.EVENT_KIND_LAUNCH, 0, WAIT_S, pred=lambda e: e.attempt == attempt)
    assert launch is not None, f"no launch of attempt {attempt}\n{_tail(c)}"
    first = c.wait_for_event(E.EVENT_KIND_FIRST_STEP, launch.seq, WAIT_S)
    assert first is not None, f"the unmodified script reported no step\n{_tail(c)}"
    return launch


def _attribution(c: LocalCluster, after_seq: int, detector: int) -> tuple[LogEntry, LogEntry]:
    detection = c.wait_for_event(
        E.EVENT_KIND_DETECTION, after_seq, WAIT_S, pred=lambda e: e.detection.detector == detector
    )
    assert detection is not None, f"not detected\n{_tail(c)}"
    blame = c.wait_for_event(E.EVENT_KIND_ATTRIBUTION, detection.seq, WAIT_S)
    assert blame is not None and blame.attribution.suspects, f"no suspect\n{_tail(c)}"
    return detection, blame


@pytest.mark.slow
def test_a_slowed_rank_is_the_straggler_and_a_stopped_rank_a_hang_blamed_on_its_node(
    cluster: UnmodifiedCluster,
) -> None:
    c = cluster
    launch = _running(c, 1)
    nodes = list(launch.launch.nodes)
    started = c.wait_for_event(E.EVENT_KIND_WORKERS_STARTED, launch.seq, WAIT_S)
    assert started is not None and {n.path for n in started.workers_started.nodes} == {"warm"}, (
        started.message if started else _tail(c)
    )

    # rank 1 (node rank 1, one rank per node) slow in its forward pass: flagged, not killed
    mark = c.events()[-1].seq
    (c.faults / "slow-rank1").touch()
    flagged = c.wait_for_event(
        E.EVENT_KIND_DETECTION, mark, WAIT_S, pred=lambda e: e.detection.detector == E.DETECTOR_STRAGGLER
    )
    (c.faults / "slow-rank1").unlink()
    assert flagged is not None, f"no straggler flagged\n{_tail(c)}"
    assert list(flagged.detection.ranks) == [1] and list(flagged.detection.nodes) == [nodes[1]], (
        flagged.message
    )

    # rank 0 SIGSTOPped (wherever it was: in a collective or between them)
    mark = c.events()[-1].seq
    out = c.ctl("chaos", nodes[0], "stop-rank")
    assert out.returncode == 0, out.stderr
    _, blame = _attribution(c, mark, E.DETECTOR_HANG)
    assert [s.node for s in blame.attribution.suspects] == [nodes[0]], blame.message
    assert blame.attribution.blame_method == E.BLAME_METHOD_FLIGHT_RECORDER, blame.message


@pytest.mark.slow
def test_a_killed_rank_is_a_crash_blamed_on_its_node(cluster: UnmodifiedCluster) -> None:
    c = cluster
    launch = _running(c, 2)  # the hang's relaunch, on the spares
    victim = launch.launch.nodes[1]
    mark = c.events()[-1].seq
    out = c.ctl("chaos", victim, "kill-rank")
    assert out.returncode == 0, out.stderr
    _, blame = _attribution(c, mark, E.DETECTOR_CRASH)
    assert blame.attribution.suspects[0].node == victim, blame.message
    assert blame.attribution.blame_method == E.BLAME_METHOD_FIRST_EXIT, blame.message
