"""The live shell closes the loop: what it could not do goes back to the core within one loop tick.

Against a real etcd, the real `LiveController` and the real `Supervisor`. Each test makes one
failure happen at the narrowest boundary and names it:

* a refused attempt CAS: the agent double writes a higher attempt record into etcd while it answers
  the preflight, i.e. just before the launch;
* a failed event-log append: an `EventLog` whose append raises `EventLogError` once, on the launch entry;
* a core whose `handle` raises once: a test double wrapping the real Supervisor; and one that
  raises on every tick (a poison event: rebuilt twice with a pause, then the event is dropped);
* a preflight RPC answered UNAVAILABLE once by a gRPC server interceptor in front of a REAL node agent.
"""

from __future__ import annotations

import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.live.loop import POISON_AFTER, REBUILD_BACKOFF_S
from controller.live.paging import Pager
from controller.supervisor.events import Event, PreflightResult, Tick
from controller.supervisor.machine import RunState, Supervisor
from controller.supervisor.policy import RunPlan
from runwarden.eventlog import EventLog, EventLogError, LogEntry, read_events
from runwarden.net import free_port
from runwarden.store import Store
from runwarden.v1 import agent_pb2, common_pb2, events_pb2, store_pb2
from tests.live.shell import RUN, agent_double, is_launch, live_shell, policy, says
from tests.nodeagent.helpers import AgentProc

E = events_pb2
pytestmark = pytest.mark.timeout(120)


def test_a_refused_attempt_cas_is_answered_within_one_tick_and_relaunched_past_the_stored_attempt(
    store: Store, tmp_path: Path
) -> None:
    with agent_double(store) as agent:

        def another_leader_launched() -> None:  # just before our launch: a higher attempt appears in etcd
            agent.before_preflight = None
            rec = store_pb2.AttemptRecord(run=RUN, attempt=7, rendezvous_id=f"{RUN}-7", nodes=["elsewhere"])
            store.put(store.keys.attempt(RUN), rec.SerializeToString())

        agent.before_preflight = another_leader_launched
        with live_shell(store, tmp_path / "run") as (shell, log):
            launched_at, _ = log.wait(is_launch(1), 20)
            reacted_at, reaction = log.wait(says("attempt 1 was not launched"), 5)
            relaunched_at, relaunch = log.wait(is_launch(), 20, after=reacted_at)
            reaction_s = reacted_at - launched_at
            assert reaction_s < shell.cfg.tick_s, f"reaction took {reaction_s:.3f} s"
            assert "refused" in reaction.message and "attempt 7" in reaction.message
            assert relaunch.attempt == 8  # the relist raised the core's attempt past the stored record
            deadline = time.monotonic() + 10
            while not agent.launches and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [r.attempt for r in agent.launches] == [8]  # attempt 1 never reached an agent
            stored = store_pb2.AttemptRecord.FromString(store.get(store.keys.attempt(RUN)).value)
            assert stored.attempt == 8 and list(stored.nodes) == ["n1"]
            print(
                f"refused CAS -> core reaction {reaction_s * 1000:.1f} ms, relaunch after "
                f"{relaunched_at - reacted_at:.2f} s"
            )


class AppendFailsOnceOnLaunch(EventLog):
    """The event log, except that appending the first LAUNCH entry raises EventLogError (a full disk, once)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.failed_at: float | None = None

    def append_all(self, entries: Sequence[LogEntry]) -> list[LogEntry]:
        if any(e.kind == E.EVENT_KIND_LAUNCH for e in entries) and self.failed_at is None:
            self.failed_at = time.monotonic()
            raise EventLogError("cannot append to event log: No space left on device (injected by the test)")
        return super().append_all(entries)


def test_a_failed_log_append_skips_the_launch_and_the_core_reacts_within_one_tick_nothing_lost(
    store: Store, tmp_path: Path
) -> None:
    logs: list[AppendFailsOnceOnLaunch] = []

    def open_log(path: Path) -> EventLog:
        logs.append(AppendFailsOnceOnLaunch(path))
        return logs[-1]

    with (
        agent_double(store) as agent,
        live_shell(store, tmp_path / "run", eventlog_factory=open_log) as (shell, log),
    ):
        reacted_at, reaction = log.wait(says("attempt 1 was not launched"), 20)
        assert logs[0].failed_at is not None
        reaction_s = reacted_at - logs[0].failed_at
        assert reaction_s < shell.cfg.tick_s, f"reaction took {reaction_s:.3f} s"
        assert "event log append failed" in reaction.message and "temporary" in reaction.message
        log.wait(is_launch(2), 20, after=reacted_at)
        deadline = time.monotonic() + 10
        while not agent.launches and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r.attempt for r in agent.launches] == [2]  # the unlogged launch never happened
        path = shell.cfg.event_log_path
    events = read_events(path).entries
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    launch1 = [i for i, e in enumerate(events) if e.kind == E.EVENT_KIND_LAUNCH and e.attempt == 1]
    not_launched = [i for i, e in enumerate(events) if "attempt 1 was not launched" in e.message]
    # the failed batch's entries were kept and written before the core's reaction
    assert len(launch1) == 1 and len(not_launched) == 1 and launch1[0] < not_launched[0]
    print(f"failed append -> core reaction {reaction_s * 1000:.1f} ms")


def test_a_launch_refused_by_one_agent_is_that_nodes_failure_not_a_fake_exit_code(
    store: Store, tmp_path: Path
) -> None:
    with agent_double(store) as agent, live_shell(store, tmp_path / "run") as (_shell, log):
        agent.launch_refusals = 1
        log.wait(is_launch(1), 20)
        _, failed = log.wait(says("Launch on n1 failed (permanent)"), 10)
        assert "PERMISSION_DENIED" in failed.message
        # handled like the node's workers exiting at once: stop, back off, relaunch
        log.wait(is_launch(2), 30)


def test_a_bad_value_in_etcd_is_dropped_alone_and_the_run_goes_on(store: Store, tmp_path: Path) -> None:
    with agent_double(store) as agent, live_shell(store, tmp_path / "run") as (_shell, log):
        store.put(store.keys.progress(RUN, "n1"), b"\xff\xff not a NodeProgress")  # bad input from outside
        log.wait(is_launch(1), 20)
        deadline = time.monotonic() + 10
        while not agent.launches and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r.attempt for r in agent.launches] == [1]


class SupervisorRaisingOnce(Supervisor):
    """Test double wrapping the real Supervisor: its first PreflightResult raises a bug-like error."""

    raised = 0

    def handle(self, event: Event, now: float) -> Any:
        if isinstance(event, PreflightResult) and SupervisorRaisingOnce.raised == 0:
            SupervisorRaisingOnce.raised += 1
            raise KeyError("a bug in the core (injected by the test double)")
        return super().handle(event, now)


def test_core_raising_once_test_double_is_replaced_by_a_fresh_core_from_a_store_snapshot(
    store: Store, tmp_path: Path
) -> None:
    SupervisorRaisingOnce.raised = 0
    made: list[Supervisor] = []

    def factory() -> Supervisor:
        made.append(SupervisorRaisingOnce(policy(), RunPlan(run=RUN, nodes=1)))
        return made[-1]

    with (
        agent_double(store) as agent,
        live_shell(store, tmp_path / "run", core_factory=factory) as (shell, log),
    ):
        log.wait(is_launch(1), 30)
        assert SupervisorRaisingOnce.raised == 1 and shell.rebuilds == 1
        assert shell.core is made[-1] and len(made) == 3  # the probe, the broken core, the fresh one
        assert log.find(says("reconciled from the store")) is not None
        assert agent.calls.count("RunPreflight") == 2  # the fresh core preflighted the node again
        deadline = time.monotonic() + 10  # the status is published after the batch that logged the launch
        while (shell.status is None or shell.status.attempt != 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shell.status is not None and shell.status.attempt == 1


class SupervisorBrokenByTicks(Supervisor):
    """Test double wrapping the real Supervisor: every Tick raises once its attempt runs (a poison
    event that comes back after every rebuild)."""

    broke_at: list[float] = []

    def handle(self, event: Event, now: float) -> Any:
        if isinstance(event, Tick) and self.state is RunState.RUNNING:
            SupervisorBrokenByTicks.broke_at.append(time.monotonic())
            raise KeyError("a bug in the core on every tick (injected by the test double)")
        return super().handle(event, now)


def test_a_poison_event_is_dropped_after_two_rebuilds_with_a_growing_pause(
    store: Store, tmp_path: Path
) -> None:
    SupervisorBrokenByTicks.broke_at = []
    pager = Pager()

    def factory() -> Supervisor:
        return SupervisorBrokenByTicks(policy(), RunPlan(run=RUN, nodes=1))

    with (
        agent_double(store),
        live_shell(store, tmp_path / "run", core_factory=factory, pager=pager) as (shell, log),
    ):
        log.wait(is_launch(1), 30)
        deadline = time.monotonic() + 30
        while not shell.dropped_poison and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shell.dropped_poison, "the event that broke two cores is dropped, not fed to a third"
        assert shell.rebuilds == POISON_AFTER
        broke = SupervisorBrokenByTicks.broke_at
        assert len(broke) == POISON_AFTER
        assert broke[1] - broke[0] >= REBUILD_BACKOFF_S, "the rebuild waited before the fresh core"
        assert any("dropped an event that broke its core" in reason for _, reason in pager.sent)


class UnavailableOnce(grpc.ServerInterceptor):
    """Answers the first RunPreflight with UNAVAILABLE (the agent behind it never sees that call)."""

    def __init__(self) -> None:
        self.preflights = 0
        self.refused_at = 0.0
        self.lock = threading.Lock()

    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        if details.method.endswith("/RunPreflight"):
            with self.lock:
                self.preflights += 1
                first = self.preflights == 1
            if first:
                self.refused_at = time.monotonic()

                def refuse(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "agent restarting (injected by the test)")
                    yield b""  # pragma: no cover - abort raises

                return grpc.unary_stream_rpc_method_handler(refuse)
        return continuation(details)


class Forward(grpc.GenericRpcHandler):
    """Forwards every NodeAgent call, as raw bytes, to the real agent."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        service = agent_pb2.DESCRIPTOR.services_by_name["NodeAgent"]
        self.streaming = {m.name for m in service.methods if m.server_streaming}

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        method = details.method
        if method.rsplit("/", 1)[-1] in self.streaming:

            def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
                yield from self.channel.unary_stream(method)(request, timeout=context.time_remaining())

            return grpc.unary_stream_rpc_method_handler(stream)

        def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
            return self.channel.unary_unary(method)(request, timeout=context.time_remaining())

        return grpc.unary_unary_rpc_method_handler(unary)


def test_a_preflight_unavailable_once_on_a_real_agent_is_retried_and_the_node_is_not_quarantined(
    etcd: Any, store: Store, tmp_path: Path
) -> None:
    agent_port, proxy_port = free_port(), free_port()
    interceptor = UnavailableOnce()
    forward = Forward(f"127.0.0.1:{agent_port}")
    proxy = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=[interceptor])
    proxy.add_generic_rpc_handlers((forward,))
    proxy.add_insecure_port(f"127.0.0.1:{proxy_port}")
    proxy.start()
    cfg = tmp_path / "preflight.toml"
    cfg.write_text(
        '[compute]\nmodes = ["full"]\n[collective]\nmodes = ["full"]\n'
        f'[storage]\ncheckpoint_path = "{tmp_path}"\nfree_space_floor_gb = 0.01\n'
    )
    agent = AgentProc(
        tmp_path / "agent",
        node="n1",
        etcd=etcd.endpoint,
        etcd_root=store.keys.root,
        flags=[
            "--listen",
            f"127.0.0.1:{agent_port}",
            "--advertise",
            f"127.0.0.1:{proxy_port}",
            "--allow-exec",
            sys.executable,
            "--preflight-config",
            str(cfg),
            # stands in for torchrun: starts nothing heavy
            "--torchrun",
            shlex.join([sys.executable, "-c", "import time; time.sleep(60)"]),
        ],
    )
    try:
        with live_shell(store, tmp_path / "run", command=("unused",)) as (shell, log):
            passed_at, result = log.wait(lambda e: e.kind == E.EVENT_KIND_PREFLIGHT_RESULT, 60)
            launched_at, launch = log.wait(is_launch(1), 20)
            assert interceptor.preflights == 2  # refused once, retried, answered by the real agent
            assert result.preflight.summary.passed and "passed" in result.message
            assert list(launch.launch.nodes) == ["n1"]
            assert log.find(lambda e: e.kind == E.EVENT_KIND_QUARANTINE) is None
            assert shell.pool_state("n1") == common_pb2.POOL_STATE_ASSIGNED
            print(
                f"preflight UNAVAILABLE -> retried, passed {passed_at - interceptor.refused_at:.2f} s later, "
                f"launched {launched_at - passed_at:.3f} s after that"
            )
            pool = store.get(store.keys.pool("n1"))
            assert (
                pool is None
                or store_pb2.PoolEntry.FromString(pool.value).state != common_pb2.POOL_STATE_QUARANTINED
            )
    finally:
        agent.close()
        proxy.stop(grace=None)
        forward.channel.close()


def test_a_nodes_known_history_is_written_to_etcd_and_the_next_controller_keeps_it(
    store: Store, tmp_path: Path
) -> None:
    """Golden hosts need a history longer than one controller: the first registration's time is the
    node's Reputation.known_since in etcd, and a new leader's core loads it instead of restarting it."""

    def known_since() -> float:
        kv = store.get(store.keys.reputation("n1"))
        return store_pb2.Reputation.FromString(kv.value).known_since if kv is not None else 0.0

    cores: list[Supervisor] = []

    def factory() -> Supervisor:
        cores.append(Supervisor(policy(), RunPlan(run=RUN, nodes=1)))
        return cores[-1]

    before = time.time()
    with agent_double(store), live_shell(store, tmp_path / "a", core_factory=factory) as (_shell, log):
        log.wait(is_launch(1), 20)
        first = known_since()
    assert before - 1 <= first <= time.time()
    time.sleep(0.05)  # the clock moves on: a known_since taken again would differ (not a wait)
    with agent_double(store), live_shell(store, tmp_path / "b", core_factory=factory) as (_shell, log):
        deadline = time.monotonic() + 20
        while not (len(cores) == 2 and cores[-1].pool.get("n1").alive) and time.monotonic() < deadline:
            time.sleep(0.05)  # the second leader lists etcd and sees n1 registered
        assert cores[-1].pool.get("n1").known_since == first
    assert known_since() == first


def test_the_path_each_node_started_on_is_in_the_event_log(store: Store, tmp_path: Path) -> None:
    with agent_double(store), live_shell(store, tmp_path / "run") as (_shell, log):
        log.wait(is_launch(1), 20)
        _, started = log.wait(lambda e: e.kind == E.EVENT_KIND_WORKERS_STARTED, 10)
        assert started.attempt == 1
        assert started.message == "attempt 1 started: cold on n1 (the double starts no workers)"
        (node,) = started.workers_started.nodes
        assert (node.node, node.path) == ("n1", "cold")


def test_an_adopted_attempt_whose_launch_never_reached_a_node_is_relaunched_with_no_one_blamed(
    store: Store, tmp_path: Path
) -> None:
    # The double starts no workers, so to a leader that takes over, attempt 1 looks exactly like a
    # launch its predecessor logged and recorded but never delivered: no worker of it on n1.
    with agent_double(store) as agent:
        with live_shell(store, tmp_path / "run") as (_first, log):
            log.wait(is_launch(1), 20)
        with live_shell(store, tmp_path / "run") as (_second, log):
            _, adopted = log.wait(says("adopted, not relaunched"), 20)
            assert adopted.attempt == 1
            noticed_at, noticed = log.wait(says("attempt 1 never started on n1"), 20)
            assert noticed.kind == E.EVENT_KIND_CONTROL_PLANE, noticed
            _, restart = log.wait(lambda e: e.kind == E.EVENT_KIND_RESTART, 20, after=noticed_at)
            assert "no restart consumed" in restart.message, restart.message
            log.wait(is_launch(2), 20, after=noticed_at)
            # nothing of the job's or the node's: no detection, no blame, no strike
            later = [e for t, e in log.entries if t >= noticed_at]
            kinds = {e.kind for e in later}
            assert not kinds & {E.EVENT_KIND_DETECTION, E.EVENT_KIND_ATTRIBUTION, E.EVENT_KIND_QUARANTINE}, (
                later
            )
        assert [r.attempt for r in agent.launches] == [1, 2]
    rep = store.get(store.keys.reputation("n1"))
    assert rep is None or not store_pb2.Reputation.FromString(rep.value).failure_times
