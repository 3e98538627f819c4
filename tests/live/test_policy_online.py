"""Online configuration against a real etcd: the real `controllerctl config` (its `main`, in-process)
talks to the Controller API of a real in-process `LiveController`; an agent double takes the launch
and the test writes the ranks' progress. A change takes effect on the next decision, a bad one changes
nothing, a new leader starts with the stored policy, and concurrent changes never lose one."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from controller.api import policy as policy_store
from controller.api.access import AccessPolicy
from controller.api.server import build_server
from controller.api.store_view import StoreBackedView
from controller.ctl.main import main as controllerctl
from controller.live.loop import LiveController
from controller.live.translate import Translator
from controller.live.view import LiveView
from controller.supervisor.events import PolicyChanged
from controller.supervisor.machine import Supervisor
from controller.supervisor.policy import RunPlan, SupervisorConfig
from runwarden.keys import KeySchema
from runwarden.store import EventType, Store, WatchEvent
from runwarden.v1 import common_pb2, store_pb2
from runwarden.v1 import events_pb2 as E
from testbed.wait import wait_until
from tests.live.shell import RUN, agent_double, is_launch, live_shell, policy


@contextmanager
def api(shell: LiveController) -> Iterator[str]:
    server, port = build_server(LiveView(shell), "127.0.0.1:0", policy=AccessPolicy())
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def ctl(address: str, *argv: str) -> int:
    return controllerctl(["--controller", address, "--timeout", "15", *argv])


def put_progress(store: Store, attempt: int, step: int) -> None:
    now = time.time()
    prog = store_pb2.NodeProgress(
        node="n1",
        run=RUN,
        attempt=attempt,
        ranks=[common_pb2.RankProgress(rank=0, step=step, step_time_s=0.05, reported_at=now)],
        written_at=now,
    )
    store.put(store.keys.progress(RUN, "n1"), prog.SerializeToString())


def stored(store: Store) -> policy_store.StoredPolicy:
    got = policy_store.read(store, RUN)
    assert got is not None
    return got


def test_config_set_takes_effect_on_the_next_hang_refuses_bad_values_and_survives_a_leader_change(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    factory = lambda: Supervisor(policy(hang_timeout_floor_s=30.0), RunPlan(run=RUN, nodes=1))  # noqa: E731
    with agent_double(store), live_shell(store, tmp_path / "a", core_factory=factory) as (shell, log):
        log.wait(is_launch(1), 20)
        assert stored(store).config.hang_timeout_floor_s == 30.0  # the first leader seeded its file's
        for step in range(1, 4):
            put_progress(store, 1, step)
            wait_until(
                lambda: shell.status is not None and shell.status.current_step >= step,  # noqa: B023 - used at once
                10,
                f"step {step} seen",
            )
        with api(shell) as address:
            capsys.readouterr()
            # refused, naming the key; nothing changed in etcd or in the core
            before = stored(store).revision
            assert ctl(address, "config", "set", "hang_timeout_floor_s", "-1") == 2
            assert "hang_timeout_floor_s: must be a finite number >= 0" in capsys.readouterr().err
            assert ctl(address, "config", "set", "hang_floor_s", "1") == 2
            assert "unknown key(s) hang_floor_s" in capsys.readouterr().err
            assert ctl(address, "config", "set", "crash_loop_count", "two") == 2
            assert "crash_loop_count: expected an integer, got 'two'" in capsys.readouterr().err
            assert stored(store).revision == before
            assert shell.core is not None and shell.core.cfg.hang_timeout_floor_s == 30.0

            changed_at = time.monotonic()
            assert ctl(address, "config", "set", "hang_timeout_floor_s", "1", "--reason", "drill") == 0
            out = capsys.readouterr().out
            assert "hang_timeout_floor_s: 30 -> 1" in out and "the leader decides with it now" in out
            _, entry = log.wait(lambda e: e.kind == E.EVENT_KIND_POLICY_CHANGED, 5)
            assert [(c.key, c.old.number, c.new.number) for c in entry.policy.changes] == [
                ("hang_timeout_floor_s", 30.0, 1.0)
            ]
            assert entry.policy.reason == "drill" and "hang_timeout_floor_s 30 -> 1" in entry.message
            # the stalled step is a hang under the new 1 s floor, not after the old 30 s
            t, hang = log.wait(lambda e: e.kind == E.EVENT_KIND_DETECTION, 10)
            assert hang.detection.detector == E.DETECTOR_HANG and "timeout 1s" in hang.message
            assert t - changed_at < 5.0

            assert ctl(address, "config", "show", "--json") == 0
            assert '"hang_timeout_floor_s": {\n      "number": 1.0' in capsys.readouterr().out

    # A second controller leads after the first stopped: its file says 30 s, the stored policy 1 s.
    with agent_double(store), live_shell(store, tmp_path / "b", core_factory=factory) as (shell, log):
        _, entry = log.wait(lambda e: e.kind == E.EVENT_KIND_POLICY_CHANGED, 20)
        assert "hang_timeout_floor_s 30 -> 1" in entry.message
        assert shell.core is not None and shell.core.cfg.hang_timeout_floor_s == 1.0


def test_concurrent_changes_of_different_keys_all_land(store: Store, tmp_path: Path) -> None:
    assert policy_store.seed(store, RUN, policy(), changed_by="test", now=time.time())
    store.put(store.keys.spec(RUN), store_pb2.RunSpec(run=RUN, nodes=1).SerializeToString())
    view = StoreBackedView(store, tmp_path / "events.jsonl")
    keys = ["restart_budget", "crash_loop_count", "burn_in_passes", "hold_after_failures",
            "straggler_window", "repeat_offender_count", "mass_expiry_min_nodes", "checkpoint_saves_to_learn"]  # fmt: skip
    start = threading.Barrier(len(keys))

    def change(key: str) -> None:
        start.wait()
        view.set_policy(RUN, {key: common_pb2.PolicyValue(text="9")}, replace=False, actor="t", reason=key)

    threads = [threading.Thread(target=change, args=(k,)) for k in keys]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    cfg = stored(store).config
    assert {k: getattr(cfg, k) for k in keys} == dict.fromkeys(keys, 9)


def test_apply_replaces_the_whole_policy_and_unset_clears_an_optional_key(
    store: Store, tmp_path: Path
) -> None:
    assert policy_store.seed(store, RUN, policy(hang_timeout_s=50.0), changed_by="test", now=time.time())
    store.put(store.keys.spec(RUN), store_pb2.RunSpec(run=RUN, nodes=1).SerializeToString())
    view = StoreBackedView(store, tmp_path / "events.jsonl")
    resp = view.set_policy(
        "", {"hang_timeout_s": common_pb2.PolicyValue(text="none")}, replace=False, actor="t", reason=""
    )
    assert [c.key for c in resp.changes] == ["hang_timeout_s"] and resp.changes[0].new.unset
    assert stored(store).config.hang_timeout_s is None
    resp = view.set_policy(
        "", {"restart_budget": common_pb2.PolicyValue(integer=4)}, replace=True, actor="t", reason=""
    )
    cfg = stored(store).config
    assert cfg == SupervisorConfig(restart_budget=4)  # every other key its default: the file was the policy


def test_the_translator_turns_the_policy_key_into_an_event_and_refuses_a_bad_record() -> None:
    keys = KeySchema()
    tr = Translator(keys, RUN)
    good = policy_store.record_of(policy(restart_budget=3), RUN, changed_by="alice", reason="x", now=1.0)
    (ev,), _ = tr.watch_event(
        WatchEvent(type=EventType.PUT, key=keys.policy(RUN), value=good, mod_revision=2, create_revision=2)
    )
    assert isinstance(ev, PolicyChanged) and ev.config.restart_budget == 3 and ev.changed_by == "alice"
    rec = store_pb2.PolicyRecord(run=RUN)
    rec.values["restart_budget"].integer = -1  # written by hand, around the API
    with pytest.raises(ValueError, match="restart_budget: must be an integer >= 0"):
        tr.watch_event(
            WatchEvent(
                type=EventType.PUT,
                key=keys.policy(RUN),
                value=rec.SerializeToString(),
                mod_revision=3,
                create_revision=2,
            )
        )
    gone, _ = tr.watch_event(
        WatchEvent(type=EventType.DELETE, key=keys.policy(RUN), value=b"", mod_revision=4, create_revision=2)
    )
    assert gone == []  # a deleted policy: the core keeps deciding with the one in force
