"""Bad input on every RPC of a real agent: a clear status naming the problem, and the agent keeps serving."""

from __future__ import annotations

import math

import grpc
import pytest

from runwarden.v1 import agent_pb2, common_pb2

INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
RP = common_pb2.RankProgress


def _status(call, request):
    with pytest.raises(grpc.RpcError) as err:
        reply = call(request, timeout=10)
        if hasattr(reply, "__iter__") and not hasattr(reply, "ListFields"):
            list(reply)
    return err.value.code(), err.value.details()


def _torchrun(
    *,
    command=("train.py",),
    rdzv_endpoint="127.0.0.1:29400",
    is_host=False,
    no_python=False,
    nnodes=1,
    node_rank=0,
    argv=(),
):
    return agent_pb2.LaunchWorkersRequest(
        run="r",
        attempt=1,
        argv=list(argv),
        nnodes=nnodes,
        node_rank=node_rank,
        torchrun=agent_pb2.TorchrunLaunch(
            command=list(command), rdzv_endpoint=rdzv_endpoint, is_host=is_host, no_python=no_python
        ),
    )


CASES = [
    ("RunPreflight", agent_pb2.RunPreflightRequest(mode="fast"), INVALID, "mode"),
    ("RunPreflight", agent_pb2.RunPreflightRequest(mode="quick", only=["bad name!"]), INVALID, "only[0]"),
    ("RunPreflight", agent_pb2.RunPreflightRequest(mode="quick", budget_s=1e9), INVALID, "budget_s"),
    ("RunPreflight", agent_pb2.RunPreflightRequest(mode="quick", budget_s=math.nan), INVALID, "budget_s"),
    ("ReportProgress", agent_pb2.ReportProgressRequest(attempt=1, reports=[RP(step=1)]), INVALID, "run"),
    ("ReportProgress", agent_pb2.ReportProgressRequest(run="a/b", reports=[RP(step=1)]), INVALID, "run"),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(run="r", attempt=-1, reports=[RP()]),
        INVALID,
        "attempt",
    ),
    ("ReportProgress", agent_pb2.ReportProgressRequest(run="r"), INVALID, "reports"),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(run="r", attempt=1, reports=[RP(step=1, load_error="bad shard")]),
        INVALID,
        "load_error",  # a refusal must say which step it refused
    ),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(
            run="r", attempt=1, reports=[RP(step=1, invalid_step=-2, load_error="bad shard")]
        ),
        INVALID,
        "invalid_step",
    ),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(
            run="r", attempt=1, reports=[RP(step=1, invalid_step=1, load_error="e" * 1025)]
        ),
        INVALID,
        "load_error",
    ),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(run="r", attempt=1, reports=[RP(step=1, stop_reason="s" * 1025)]),
        INVALID,
        "stop_reason",
    ),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(
            run="r", attempt=1, reports=[RP(step=1, collectives_entered=-1, collective_entered_at=1.0)]
        ),
        INVALID,
        "collectives_entered",
    ),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(
            run="r",
            attempt=1,
            reports=[RP(step=1, collectives_entered=3, collective_entered_at=float("nan"))],
        ),
        INVALID,
        "collective_entered_at",
    ),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(run="r", attempt=1, reports=[RP(step=1, collective_entered_at=5.0)]),
        INVALID,
        "collective_entered_at",  # a time without the count it is the time of
    ),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(
            run="r",
            attempt=1,
            reports=[RP(step=1, collectives_entered=3, collective_entered_at=1.0, collective_age_s=99.0)],
        ),
        INVALID,
        "collective_age_s",  # the agent's to set
    ),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(run="r", attempt=1, reports=[RP(step=1, snapshot_steps=[0])]),
        INVALID,
        "snapshot_steps[0]",
    ),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(
            run="r", attempt=1, reports=[RP(step=9, snapshot_steps=[1, 2, 3, 4, 5])]
        ),
        INVALID,
        "snapshot_steps",
    ),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(run="r", reports=[RP(rank=-3)]),
        INVALID,
        "reports[0].rank",
    ),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(run="r", reports=[RP(step=-1)]),
        INVALID,
        "reports[0].step",
    ),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(run="r", reports=[RP(wait_s=math.inf)]),
        INVALID,
        "wait_s",
    ),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(run="r", reports=[RP(loaded_step=-2)]),
        INVALID,
        "reports[0].loaded_step",
    ),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(run="r", reports=[RP(reported_at=4e10)]),
        INVALID,
        "reported_at",
    ),
    (
        "ReportProgress",
        agent_pb2.ReportProgressRequest(run="r", reports=[RP()] * 5000),
        INVALID,
        "at most 4096",
    ),
    ("RequestStop", agent_pb2.RequestStopRequest(), INVALID, "run"),
    ("RequestStop", agent_pb2.RequestStopRequest(run="nope"), NOT_FOUND, "nope"),
    ("RequestStop", agent_pb2.RequestStopRequest(run="known", reason="x" * 5000), INVALID, "reason"),
    ("GetStopState", agent_pb2.GetStopStateRequest(run="nope"), NOT_FOUND, "nope"),
    ("GetStopState", agent_pb2.GetStopStateRequest(run="x" * 500), INVALID, "run"),
    ("CollectFlightRecorder", agent_pb2.CollectFlightRecorderRequest(run="nope"), NOT_FOUND, "nope"),
    (
        "CollectFlightRecorder",
        agent_pb2.CollectFlightRecorderRequest(run="known", timeout_s=-1),
        INVALID,
        "timeout_s",
    ),
    (
        "CollectFlightRecorder",
        agent_pb2.CollectFlightRecorderRequest(run="known", timeout_s=1e6),
        INVALID,
        "timeout_s",
    ),
    ("LaunchWorkers", agent_pb2.LaunchWorkersRequest(run="r", attempt=1), INVALID, "argv"),
    ("LaunchWorkers", agent_pb2.LaunchWorkersRequest(argv=["x"]), INVALID, "run"),
    ("LaunchWorkers", agent_pb2.LaunchWorkersRequest(run="r", argv=["x\0y"]), INVALID, "argv[0]"),
    ("LaunchWorkers", agent_pb2.LaunchWorkersRequest(run="r", argv=["x"], env={"1BAD": "v"}), INVALID, "env"),
    (
        "LaunchWorkers",
        agent_pb2.LaunchWorkersRequest(run="r", argv=["x"], nnodes=2, node_rank=2),
        INVALID,
        "node_rank",
    ),
    (
        "LaunchWorkers",
        agent_pb2.LaunchWorkersRequest(run="r", argv=["x"], resume_step=-5),
        INVALID,
        "resume_step",
    ),
    ("LaunchWorkers", agent_pb2.LaunchWorkersRequest(run="r", argv=["x"] * 5000), INVALID, "argv"),
    (
        "LaunchWorkers",
        agent_pb2.LaunchWorkersRequest(run="r", argv=["x"], launched_at=float("nan")),
        INVALID,
        "launched_at",
    ),
    (
        "LaunchWorkers",
        agent_pb2.LaunchWorkersRequest(run="r", argv=["x"], launched_at=-1.0),
        INVALID,
        "launched_at",
    ),
    (
        "LaunchWorkers",
        agent_pb2.LaunchWorkersRequest(run="r", argv=["/no/such/exe"]),
        grpc.StatusCode.PERMISSION_DENIED,
        "allowed_executables",
    ),
    # A structured launch: every new field is checked before anything is started.
    ("LaunchWorkers", _torchrun(argv=["x"]), INVALID, "argv: must be empty"),
    ("LaunchWorkers", _torchrun(command=[]), INVALID, "torchrun.command"),
    ("LaunchWorkers", _torchrun(command=["train.py", "a\0b"]), INVALID, "torchrun.command[1]"),
    ("LaunchWorkers", _torchrun(command=[""]), INVALID, "torchrun.command[0]"),
    ("LaunchWorkers", _torchrun(rdzv_endpoint=""), INVALID, "torchrun.rdzv_endpoint"),
    ("LaunchWorkers", _torchrun(rdzv_endpoint="127.0.0.1"), INVALID, "torchrun.rdzv_endpoint"),
    ("LaunchWorkers", _torchrun(rdzv_endpoint="127.0.0.1:0"), INVALID, "torchrun.rdzv_endpoint"),
    ("LaunchWorkers", _torchrun(rdzv_endpoint="h:99999"), INVALID, "torchrun.rdzv_endpoint"),
    ("LaunchWorkers", _torchrun(rdzv_endpoint="::1:29400"), INVALID, "brackets"),
    ("LaunchWorkers", _torchrun(rdzv_endpoint="a b:29400"), INVALID, "torchrun.rdzv_endpoint"),
    ("LaunchWorkers", _torchrun(nnodes=0), INVALID, "nnodes"),
    ("LaunchWorkers", _torchrun(nnodes=2, node_rank=2), INVALID, "node_rank"),
    (
        "LaunchWorkers",
        _torchrun(is_host=True, rdzv_endpoint="10.9.9.9:1234"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "stale node record",
    ),
    (
        "LaunchWorkers",
        _torchrun(no_python=True, command=["/bin/sh", "-c", "true"]),
        grpc.StatusCode.PERMISSION_DENIED,
        "torchrun.command",
    ),
    ("StopWorkers", agent_pb2.StopWorkersRequest(run="nope"), NOT_FOUND, "nope"),
    ("StopWorkers", agent_pb2.StopWorkersRequest(run="r", grace_s=-1), INVALID, "grace_s"),
    ("StopWorkers", agent_pb2.StopWorkersRequest(), INVALID, "run"),
    (
        "InjectFault",
        agent_pb2.InjectFaultRequest(kind=agent_pb2.FAULT_KIND_KILL_RANK),
        grpc.StatusCode.PERMISSION_DENIED,
        "chaos_enabled",
    ),
    ("Drain", agent_pb2.DrainRequest(reason="x" * 501), INVALID, "at most 500"),
    ("Drain", agent_pb2.DrainRequest(reason="maintenance\nrm -rf"), INVALID, "printable"),
    ("Drain", agent_pb2.DrainRequest(reason="\x1b[31mred", undo=True), INVALID, "printable"),
    (
        "MeasureAllReduce",
        agent_pb2.MeasureAllReduceRequest(group_id="g", rank=0, world_size=1, size_bytes=4, iterations=1),
        INVALID,
        "world_size",
    ),
]


def test_bad_input_on_every_rpc_gets_a_clear_status(agent_factory):
    agent = agent_factory()
    agent.stub.ReportProgress(
        agent_pb2.ReportProgressRequest(run="known", attempt=1, reports=[RP(rank=0, step=1)])
    )
    covered = set()
    for method, request, code, words in CASES:
        got_code, details = _status(getattr(agent.stub, method), request)
        assert (got_code, words in details) == (code, True), f"{method}: {got_code} {details!r}"
        covered.add(method)
    assert agent.proc.poll() is None
    assert agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).node == "n1"
    services = agent_pb2.DESCRIPTOR.services_by_name["NodeAgent"].methods_by_name
    assert covered | {"GetNodeStatus"} == set(services)  # GetNodeStatus has no fields: see the raw-bytes test


def test_chaos_bad_input_when_enabled(agent_factory):
    agent = agent_factory(flags=["--chaos"])
    for request, code, words in [
        (agent_pb2.InjectFaultRequest(), INVALID, "kind"),
        (agent_pb2.InjectFaultRequest(kind=99), INVALID, "kind"),
        (agent_pb2.InjectFaultRequest(kind=agent_pb2.FAULT_KIND_XID), INVALID, "line"),
        (agent_pb2.InjectFaultRequest(kind=agent_pb2.FAULT_KIND_XID, line="hello"), INVALID, "not an Xid"),
        (agent_pb2.InjectFaultRequest(kind=agent_pb2.FAULT_KIND_SLOW_RANK, value=1e9), INVALID, "value"),
        (
            agent_pb2.InjectFaultRequest(kind=agent_pb2.FAULT_KIND_KILL_RANK, local_rank=3),
            NOT_FOUND,
            "local rank 3",
        ),
        (
            agent_pb2.InjectFaultRequest(kind=agent_pb2.FAULT_KIND_STOP_RANK, local_rank=-1),
            INVALID,
            "local_rank",
        ),
    ]:
        got, details = _status(agent.stub.InjectFault, request)
        assert (got, words in details) == (code, True), f"{request}: {got} {details!r}"
    assert agent.proc.poll() is None


def test_wrong_types_garbage_and_huge_messages(agent_factory):
    agent = agent_factory(env={"RUNWARDEN_AGENT_MAX_MESSAGE_BYTES": str(1 << 20)})
    raw = {
        m: agent.channel.unary_unary(f"/runwarden.v1.NodeAgent/{m}")
        for m in ("ReportProgress", "GetNodeStatus", "GetStopState")
    }
    # field 1 (run, a string) sent as a varint: protobuf keeps it as an unknown field, so run is missing.
    code, details = _status(raw["GetStopState"], b"\x08\x05")
    assert code == INVALID and "run" in details
    # field 3 (reports) holding bytes that are not a RankProgress: undecodable request.
    for method, payload in (
        ("ReportProgress", b"\x1a\x03\xff\xff\xff"),
        ("GetNodeStatus", b"\xff\xff\xff\xff"),
    ):
        code, _ = _status(raw[method], payload)
        assert code in (grpc.StatusCode.INTERNAL, INVALID), method
    # over the agent's message limit: refused by grpc before any handler runs.
    code, _ = _status(raw["ReportProgress"], b"\x0a\xff\xff\x7f" + b"a" * ((1 << 21) - 4))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert agent.proc.poll() is None
    assert agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=5).node == "n1"


def test_bad_progress_datagrams_are_dropped_and_good_ones_answered(agent_factory):
    import socket

    agent = agent_factory()
    path = agent.socket + ".progress"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("")
    sock.settimeout(0.3)
    bad = [
        b"\xff\xff\xff",
        agent_pb2.ReportProgressRequest(run="r").SerializeToString(),
        agent_pb2.ReportProgressRequest(run="r", reports=[RP(step=-1)]).SerializeToString(),
        b"x" * 60_000,
    ]
    for payload in bad:
        sock.sendto(payload, path)
        with pytest.raises(TimeoutError):
            sock.recv(4096)  # dropped: no answer
    good = agent_pb2.ReportProgressRequest(run="r", attempt=1, reports=[RP(rank=3, step=9)])
    sock.sendto(good.SerializeToString(), path)
    sock.settimeout(5)
    answer = agent_pb2.ReportProgressResponse.FromString(sock.recv(4096))
    assert not answer.stop_requested
    ranks = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).ranks
    assert [(r.rank, r.step) for r in ranks] == [(3, 9)]
    sock.close()
