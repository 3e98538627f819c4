"""Warm workers (`warm_workers = true`): two real agents on distinct loopback hosts launch the example
job on parked rank processes, torch imported before the launch, across 2 "nodes" with gloo.

What is proved with real processes: the ranks that take steps are the processes that were parked
before the launch; global ranks follow the controller's node ranks; a planned stop (stop flag, save,
commit, exit 0) and a rank's exit code (the node's exit) end the attempt, not the processes: the
same ranks park again and run the next attempt; a hard stop leaves nothing of the tree and a fresh
group is parked; the cold path runs when the switch is off
or the warm path cannot run the launch, and the answer says which path ran; a bad value of the
switch is a config error.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from nodeagent.daemon import proctree
from nodeagent.daemon.config import AgentConfig, from_sources
from nodeagent.daemon.launcher import LaunchSpec
from nodeagent.trainer import latest_committed
from nodeagent.warm import groups as warm_groups
from nodeagent.warm import protocol
from nodeagent.warm import rank as warm_rank
from runwarden.config import ConfigError
from runwarden.v1 import agent_pb2
from tests.nodeagent.helpers import PYTHON, ROOT, AgentProc, wait_for

HOSTS = ("127.0.0.21", "127.0.0.22")
TRAIN = str(ROOT / "examples" / "train.py")
# A job whose rank 1 exits 7 once both ranks met: the node's exit must carry that code.
CRASH = """
import sys
import torch.distributed as dist
from nodeagent import trainer
dist.init_process_group("gloo")
rank = dist.get_rank()
reporter = trainer.ProgressReporter.from_env(rank=rank, world_size=dist.get_world_size())
reporter.report(1)
reporter.flush()
dist.barrier()
if rank == 1:
    sys.exit(7)
dist.barrier()  # rank 0 fails here: its peer is gone
"""


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def parked_ranks(agent: AgentProc) -> tuple[int, ...]:
    """The parked rank pids of the agent's parked group, found in /proc (not asked of the agent)."""
    procs = proctree.all_procs()
    leaders = [
        p.pid
        for p in procs
        if p.ppid == agent.pid and _cmdline(p.pid)[1:3] == ["-m", "nodeagent.warm.leader"]
    ]
    return tuple(sorted(p.pid for p in procs if p.ppid in leaders and _comm(p.pid) == "rw-warm-rank"))


def _comm(pid: int) -> str:
    """A process's name: a rank forked from its leader has the leader's command line, not its own."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def agent_flags(host: str, *, warm_on: bool, local_ranks: int = 1) -> list[str]:
    """A loopback test agent's flags (the warm tests and bench/bench_warm.py)."""
    return [
        "--listen",
        f"{host}:0",
        "--allow-exec",
        PYTHON,
        "--torchrun",
        shlex.join([PYTHON, "-m", "torch.distributed.run"]),
        "--collective-ifname",
        "lo",
        "--local-ranks",
        str(local_ranks),
        "--warm-workers",
        "true" if warm_on else "false",
    ]


def _agent(tmp: Path, node: str, host: str, *, warm_on: bool, flags: tuple[str, ...] = ()) -> AgentProc:
    return AgentProc(tmp / node, node=node, flags=[*agent_flags(host, warm_on=warm_on), *flags])


def _launch(
    agents: list[AgentProc],
    port: int,
    attempt: int,
    command: list[str],
    *,
    resume_step: int = -1,
    env: dict[str, str] | None = None,
    nnodes: int = 0,
) -> list[agent_pb2.LaunchWorkersResponse]:
    replies = []
    for node_rank, agent in enumerate(agents):
        replies.append(
            agent.stub.LaunchWorkers(
                agent_pb2.LaunchWorkersRequest(
                    run="wr",
                    attempt=attempt,
                    env={"PYTHONPATH": str(ROOT), **(env or {})},
                    nnodes=nnodes or len(agents),
                    node_rank=node_rank,
                    resume_step=resume_step,
                    torchrun=agent_pb2.TorchrunLaunch(
                        command=command, rdzv_endpoint=f"{HOSTS[0]}:{port}", is_host=node_rank == 0
                    ),
                ),
                timeout=60,
            )
        )
    return replies


def _status(agent: AgentProc) -> agent_pb2.GetNodeStatusResponse:
    return agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=5)


def _worker(agent: AgentProc, attempt: int) -> agent_pb2.WorkerStatus:
    (w,) = [w for w in _status(agent).workers if w.attempt == attempt]
    return w


def _ended(agent: AgentProc, attempt: int, timeout_s: float) -> agent_pb2.WorkerStatus:
    return wait_for(
        lambda: (w := _worker(agent, attempt)).HasField("exit") and w,
        timeout_s,
        f"attempt {attempt} to end on {agent.node}",
        interval_s=0.05,
    )


def _ranks_at(agent: AgentProc, pids: tuple[int, ...], step: int) -> list:
    ranks = [r for r in _status(agent).ranks if r.pid in pids and r.step >= step]
    return ranks if len(ranks) == len(pids) else []


def _train(tmp: Path, attempt: int) -> list[str]:
    return [
        TRAIN,
        "--steps",
        "100000",
        "--ckpt-dir",
        str(tmp / "ckpt"),
        "--ckpt-every",
        "2",
        "--out",
        str(tmp / f"out-{attempt}"),
        "--step-sleep",
        "0.05",
    ]


def _tree_gone(leader: int) -> bool:
    return not proctree.alive(proctree.tree_of(leader))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_nodes_launch_on_parked_ranks_kept_across_attempts_until_a_hard_stop(tmp_path):
    port = 29611
    agents = [
        _agent(tmp_path, "w0", HOSTS[0], warm_on=True, flags=("--rdzv-port", str(port))),
        _agent(tmp_path, "w1", HOSTS[1], warm_on=True),
    ]
    parked = fresh = third = fourth = []
    try:
        # Attempt 1: the parked ranks (found before the launch) take the steps; a planned stop.
        parked = [wait_for(lambda a=a: parked_ranks(a), 60, f"{a.node}'s parked rank") for a in agents]
        replies = _launch(agents, port, 1, _train(tmp_path, 1))
        for reply, pids in zip(replies, parked, strict=True):
            assert reply.launch_path == "warm", reply.launch_detail
            assert str(list(pids)) in reply.launch_detail
        for node_rank, (agent, pids) in enumerate(zip(agents, parked, strict=True)):
            (rank,) = wait_for(lambda a=agent, p=pids: _ranks_at(a, p, 3), 60, f"{agent.node} past step 3")
            assert rank.rank == node_rank and rank.world_size == 2  # global ranks follow node ranks
            env = dict(
                kv.split("=", 1) for kv in Path(f"/proc/{rank.pid}/environ").read_text().split("\0") if kv
            )
            assert "RANK" not in env  # the environment it started with: parked before the launch
            # the flight recorder answers through the agent, from the socket the launch's env named
            reply = agent.stub.CollectFlightRecorder(
                agent_pb2.CollectFlightRecorderRequest(run="wr", timeout_s=5), timeout=30
            )
            assert [(d.rank, d.ok, d.format) for d in reply.dumps] == [(node_rank, True, "json")]
        for agent in agents:
            agent.stub.RequestStop(agent_pb2.RequestStopRequest(run="wr", reason="test stop"), timeout=5)
        for agent in agents:
            w = _ended(agent, 1, 60)
            assert w.exit.exit_code == 0 and not w.exit.HasField("signal"), w.exit.detail
        committed = latest_committed(tmp_path / "ckpt")
        assert committed is not None and committed.step >= 3
        assert {json.loads(line)["attempt"] for line in (tmp_path / "out-1" / "loss-rank1.jsonl").open()} == {
            1
        }

        # Attempt 2: the same processes, parked again after their planned stop; a rank exits 7: the
        # node's exit, and both ranks park again (a script's exit ends the attempt, not the process).
        crash = tmp_path / "crash.py"
        crash.write_text(CRASH)
        # (a standby group may be parked beside them: park_standby, some seconds after a warm launch)
        fresh = [wait_for(lambda a=a: parked_ranks(a), 60, f"{a.node}'s parked rank again") for a in agents]
        assert all(set(p) <= set(f) for p, f in zip(parked, fresh, strict=True)), (parked, fresh)
        replies = _launch(agents, port, 2, [str(crash)])
        assert [r.launch_path for r in replies] == ["warm", "warm"], [r.launch_detail for r in replies]
        for reply, pids in zip(replies, parked, strict=True):
            assert f"parked ranks {list(pids)} (kept from attempt 1;" in reply.launch_detail, (
                reply.launch_detail
            )
        w1 = _ended(agents[1], 2, 60)
        assert w1.exit.exit_code == 7 and w1.parked, w1.exit.detail
        w0 = _ended(agents[0], 2, 60)
        assert w0.exit.exit_code != 0 and w0.parked, w0.exit.detail
        assert all(set(p) <= set(parked_ranks(a)) for a, p in zip(agents, parked, strict=True))

        # Attempt 3: resumes from the commit on the same processes; a hard stop (no park_within_s)
        # leaves nothing behind, and a fresh group is parked.
        third = parked
        replies = _launch(agents, port, 3, _train(tmp_path, 3), resume_step=committed.step)
        for reply, pids in zip(replies, parked, strict=True):
            assert f"parked ranks {list(pids)} (kept from attempt 2;" in reply.launch_detail, (
                reply.launch_detail
            )
        for agent, pids in zip(agents, third, strict=True):
            wait_for(lambda a=agent, p=pids: _ranks_at(a, p, committed.step + 2), 60, "steps past the resume")
        first = json.loads((tmp_path / "out-3" / "loss-rank0.jsonl").open().readline())
        assert first == {**first, "step": committed.step, "attempt": 3}
        leaders = [_worker(agent, 3).pid for agent in agents]
        reply = agents[0].stub.StopWorkers(
            agent_pb2.StopWorkersRequest(run="wr", attempt=3, grace_s=3), timeout=30
        )
        assert [w.pid for w in reply.stopped] == [leaders[0]]
        # node 1's rank may leave the attempt on its own first (its peer is gone) and park again;
        # else this hard stop kills its tree too
        agents[1].stub.StopWorkers(agent_pb2.StopWorkersRequest(run="wr", attempt=3, grace_s=3), timeout=30)
        for node, (agent, leader, pids) in enumerate(zip(agents, leaders, third, strict=True)):
            w = _ended(agent, 3, 10)
            assert w.pid == leader and (node == 1 or not w.parked), w
            if not w.parked:
                assert _tree_gone(leader) and all(proctree.read_proc(p) is None for p in pids)

        # Attempt 4: a launch the warm path cannot run (a start-up variable of its own) goes cold,
        # torchrun as always, and the parked group stays parked for the next one.
        fourth = [wait_for(lambda a=a: parked_ranks(a), 60, f"{a.node}'s fourth parked rank") for a in agents]
        replies = _launch(agents, port, 4, _train(tmp_path, 4), env={"PYTHONHASHSEED": "0"})
        for reply in replies:
            assert reply.launch_path == "cold" and "PYTHONHASHSEED" in reply.launch_detail, (
                reply.launch_detail
            )
            # the cold path starts torchrun through `sh -c 'trap "" USR1; exec ...'`: wait for the exec
            wait_for(
                lambda r=reply: _cmdline(r.pid)[1:3] == ["-m", "torch.distributed.run"], 10, "torchrun's exec"
            )
        assert not set(fourth[0]) & set(third[0])  # node 0's hard-stopped group is gone
        wait_for(lambda: (tmp_path / "out-4" / "loss-rank1.jsonl").exists(), 90, "cold ranks' first step")
        # still parked (a new standby may have joined them: a promoted standby is replaced at once)
        assert all(set(f) <= set(parked_ranks(a)) for a, f in zip(agents, fourth, strict=True))
        for agent in agents:
            agent.stub.StopWorkers(agent_pb2.StopWorkersRequest(run="wr", attempt=4, grace_s=3), timeout=30)
        last = [wait_for(lambda a=a: parked_ranks(a), 60, f"{a.node}'s last parked rank") for a in agents]
    finally:
        for agent in agents:
            agent.close()
    for pids in (parked, fresh, third, fourth, last):  # the agent's exit took its parked groups along
        assert all(proctree.read_proc(p) is None for p in sum(pids, ()))


DUMP = (
    "import json, os, sys; "
    "json.dump({'argv': sys.argv[1:], 'path': os.environ.get('RUNWARDEN_LAUNCH_PATH')}, "
    "open(os.environ['DUMP_TO'], 'w'))"
)


@pytest.mark.parametrize(
    ("warm_on", "no_python", "why"),
    [
        (False, False, "warm_workers is off"),
        (True, True, "no_python"),
        (True, False, "the torchrun prefix is not"),
    ],
)
def test_the_cold_path_runs_when_warm_is_off_or_cannot_run_the_launch(tmp_path, warm_on, no_python, why):
    # torchrun stands in as a script that writes its argv: the cold path starts it, nothing is parked
    agent = AgentProc(
        tmp_path / "a",
        node="c0",
        flags=[
            "--listen",
            f"{HOSTS[0]}:0",
            "--allow-exec",
            PYTHON,
            "--torchrun",
            shlex.join([PYTHON, "-c", DUMP]),
            "--local-ranks",
            "1",
            "--rdzv-port",
            "29631",
            "--warm-workers",
            "true" if warm_on else "false",
        ],
    )
    try:
        out = tmp_path / "line.json"
        reply = agent.stub.LaunchWorkers(
            agent_pb2.LaunchWorkersRequest(
                run="r1",
                attempt=1,
                env={"DUMP_TO": str(out), "PYTHONPATH": str(ROOT)},
                nnodes=1,
                torchrun=agent_pb2.TorchrunLaunch(
                    command=[PYTHON, "t.py"] if no_python else ["t.py"],
                    rdzv_endpoint=f"{HOSTS[0]}:29631",
                    is_host=True,
                    no_python=no_python,
                ),
            ),
            timeout=10,
        )
        assert reply.launch_path == "cold" and reply.launch_detail.startswith(why), reply.launch_detail
        got = json.loads(wait_for(lambda: out.exists() and out.read_text(), 20, "the cold line"))
        assert got["argv"][-1] == "t.py" and got["path"] is None
        assert not parked_ranks(agent)
    finally:
        agent.close()


def test_a_bad_warm_workers_value_is_a_clear_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"warm_workers: expected true or false, got 'maybe'"):
        from_sources(file=None, environ={"RUNWARDEN_AGENT_WARM_WORKERS": "maybe"})
    with pytest.raises(ConfigError, match=r"warm_wait_s: must be within 0..600"):
        from_sources(file=None, environ={"RUNWARDEN_AGENT_WARM_WAIT_S": "-1"})
    with pytest.raises(ConfigError, match=r"warm_workers: expected true or false"):
        AgentConfig(warm_workers="yes")
    toml = tmp_path / "agent.toml"
    toml.write_text('warm_workers = "sometimes"\n')
    proc = subprocess.run(
        [PYTHON, "-m", "nodeagent.daemon.cli", "--config", str(toml)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "warm_workers: expected true or false" in proc.stderr, proc.stderr
    assert from_sources(file=None, environ={}).warm_workers is True  # on unless turned off


def _handoff(**over: object) -> dict:
    message = {
        "v": protocol.PROTOCOL,
        "attempt": 1,
        "argv": ["train.py", "--steps", "3"],
        "cwd": "",
        "env": {"A": "1"},
        "rendezvous": {
            "rdzv_id": "r-1",
            "node_rank": 1,
            "nnodes": 2,
            "local_world_size": 2,
            "local_rank": 1,
            "master_addr": "10.0.0.1",
            "master_port": 29500,
            "timeout_s": 60,
        },
    }
    message.update(over)
    return message


def test_a_hand_off_is_validated_and_gets_torchruns_environment():
    h = protocol.parse_handoff(json.dumps(_handoff()).encode())
    env = warm_rank.rank_env(h, rank=3, world_size=4)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["GROUP_RANK"]) == ("3", "1", "4", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["TORCHELASTIC_RUN_ID"]) == (
        "10.0.0.1",
        "29500",
        "r-1",
    )
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["A"] == "1"
    assert (
        protocol.parse_handoff(json.dumps(_handoff(argv=["-m", "pkg.mod", "x"])).encode()).module == "pkg.mod"
    )
    rdzv = _handoff()["rendezvous"]
    bad = [
        b"\x80not json",
        b"[]",
        json.dumps(_handoff(v=protocol.PROTOCOL + 1)).encode(),
        json.dumps(_handoff(v=1)).encode(),  # protocol 1: one hand-off per group, EOF-framed
        json.dumps(_handoff(argv=[])).encode(),
        json.dumps(_handoff(argv=["-c", "print(1)"])).encode(),
        json.dumps(_handoff(argv=["-m", "not a module"])).encode(),
        json.dumps(_handoff(env={"1BAD": "x"})).encode(),
        json.dumps(_handoff(env={"A": 1})).encode(),
        json.dumps(_handoff(rendezvous={**rdzv, "node_rank": 2})).encode(),
        json.dumps(_handoff(rendezvous={**rdzv, "local_rank": 2})).encode(),
        json.dumps(_handoff(rendezvous={**rdzv, "master_port": 0})).encode(),
        json.dumps(_handoff(rendezvous={**rdzv, "master_addr": "a b"})).encode(),
        json.dumps(_handoff(rendezvous={**rdzv, "rdzv_id": "x/../y"})).encode(),
        json.dumps(_handoff(rendezvous={**rdzv, "timeout_s": True})).encode(),
        json.dumps(_handoff(attempt=-1)).encode(),
        json.dumps(_handoff(attempt="1")).encode(),
    ]
    for data in bad:
        with pytest.raises(protocol.HandOffError):
            protocol.parse_handoff(data)


def test_what_sends_a_launch_cold():
    ask = warm_groups.WarmAsk(
        command=("t.py",), rdzv_endpoint="h:1", is_host=True, no_python=False, node_rank=0, nnodes=2
    )
    py = "/usr/bin/python3"
    assert warm_groups.plan(ask, enabled=True, interpreter=py) == ""
    assert warm_groups.plan(ask, enabled=False, interpreter=py) == "warm_workers is off"
    assert warm_groups.plan(None, enabled=True, interpreter=py).startswith("not a structured")
    assert warm_groups.plan(ask, enabled=True, interpreter="").startswith("the torchrun prefix")
    moved = warm_groups.WarmAsk(**{**_fields(ask), "is_host": False})
    assert warm_groups.plan(moved, enabled=True, interpreter=py) == "the store host is not node rank 0"
    option = warm_groups.WarmAsk(**{**_fields(ask), "command": ("-X", "dev", "t.py")})
    assert "interpreter option" in warm_groups.plan(option, enabled=True, interpreter=py)
    assert warm_groups.warm_interpreter((py, "-m", "torch.distributed.run")) == py
    assert warm_groups.warm_interpreter(("torchrun",)) == ""
    parked = warm_groups.parked_env({"PATH": "/bin", "RUNWARDEN_AGENT_X": "1", "LD_PRELOAD": "a.so"}, 2)
    assert parked == {"PATH": "/bin", "LD_PRELOAD": "a.so", "OMP_NUM_THREADS": "1"}
    assert warm_groups.startup_mismatch({**parked, "OMP_NUM_THREADS": "4", "PYTHONPATH": "/x"}, parked) == ""
    assert warm_groups.startup_mismatch({**parked, "LD_PRELOAD": "b.so"}, parked) == "LD_PRELOAD"
    assert warm_groups.startup_mismatch({**parked, "PYTHONHASHSEED": "0"}, parked) == "PYTHONHASHSEED"


def _fields(ask: warm_groups.WarmAsk) -> dict:
    return {name: getattr(ask, name) for name in ask.__slots__}


def test_the_warm_environment_is_the_cold_paths(tmp_path):
    spec = LaunchSpec(
        run="r",
        attempt=3,
        rendezvous_id="r-3",
        argv=("x",),
        env={"GLOO_SOCKET_IFNAME": "lo"},
        node_rank=1,
        nnodes=2,
        resume_step=40,
        stop_file=tmp_path / "stop",
        fr_socket_dir=tmp_path / "fr",
        agent_socket="/run/a.sock",
    )
    env = warm_groups.launch_env(spec, {"PATH": "/bin", "NOTIFY_SOCKET": "/x"}, 2)
    assert env["RUNWARDEN_RDZV_ID"] == "r-3" and env["RUNWARDEN_RESUME_STEP"] == "40"
    assert (
        env["RUNWARDEN_STOP_FILE"] == str(tmp_path / "stop")
        and env["RUNWARDEN_NODEAGENT_SOCKET"] == "/run/a.sock"
    )
    assert env["RUNWARDEN_FR_SOCKET_DIR"] == str(tmp_path / "fr") and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["OMP_NUM_THREADS"] == "1" and "NOTIFY_SOCKET" not in env
