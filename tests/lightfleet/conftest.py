"""Light fleets against the `etcd` fixture's real etcd: in this process (`hosted`), or as the CLI's
processes driving the real `controller run` (`light_deployment`). Nothing is left running."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lightfleet.fleet import Fleet
from lightfleet.process import Hosted, LightProcess
from lightfleet.settings import AgentSettings
from runwarden.eventlog import LogEntry, read_events
from runwarden.store import Store, StoreConfig
from runwarden.v1 import events_pb2
from testbed.etcd_server import EtcdServer, free_port
from testbed.fleet_cluster import controllerctl, start_controller, write_toml
from testbed.wait import wait_until

E = events_pb2


@pytest.fixture
def hosted(etcd: EtcdServer) -> Iterator[Callable[..., Hosted]]:
    """hosted(n, settings) -> a started LightProcess of n agents (n0..n{n-1}) in a thread of this process."""
    made: list[Hosted] = []

    def make(n: int, settings: AgentSettings | None = None) -> Hosted:
        config = StoreConfig(endpoints=(etcd.endpoint,), timeout_s=5.0)
        process = LightProcess(config, [(f"n{i}", 0) for i in range(n)], settings or AgentSettings())
        made.append(Hosted(process))
        return made[-1].start()

    yield make
    for h in made:
        h.stop()


class LightDeployment:
    """etcd (the fixture's), `python -m lightfleet`'s processes, and `controller run` on them."""

    RUN = "light"

    def __init__(
        self,
        etcd: EtcdServer,
        root: Path,
        *,
        nodes: int,
        active: int,
        flags: list[str],
        policy: dict[str, object],
    ) -> None:
        self.etcd = etcd
        self.root = root
        self.nodes, self.active = nodes, active
        self.fleet = Fleet.from_flags([f"--etcd={etcd.endpoint}", *flags], nodes=nodes, procs=2)
        self.run_dir = root / "controller"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.policy = policy
        self.controller: subprocess.Popen[bytes] | None = None
        self.api_address = f"127.0.0.1:{free_port()}"
        self.store = Store.connect(StoreConfig(endpoints=(etcd.endpoint,), timeout_s=5.0))

    @property
    def event_log(self) -> Path:
        return self.run_dir / "events.jsonl"

    def start(self) -> LightDeployment:
        self.fleet.start(60)
        config = self.run_dir / "controller.toml"
        write_toml(
            config,
            {
                "store": {"endpoints": [self.etcd.endpoint]},
                "controller": {
                    "run": self.RUN,
                    "nodes": self.active,
                    "command": ["train.py"],  # never run: a light agent runs no command
                    "run_dir": str(self.run_dir),
                    "api_address": self.api_address,
                    "identity": "controller-a",
                    "election_ttl_s": 3.0,
                    "metrics_address": "",
                    "procs_per_node": 8,
                },
                "policy": self.policy,
            },
        )
        self.controller = start_controller(config, self.run_dir / "controller.log")
        return self

    def stop(self) -> None:
        if self.controller is not None and self.controller.poll() is None:
            self.controller.send_signal(signal.SIGTERM)
            try:
                self.controller.wait(20)
            except subprocess.TimeoutExpired:
                self.controller.kill()
                self.controller.wait(5)
        self.fleet.stop()
        self.store.close()

    # -- reading it ------------------------------------------------------------------------------

    def events(self) -> list[LogEntry]:
        return read_events(self.event_log).entries

    def log_tail(self) -> str:
        path = self.run_dir / "controller.log"
        return path.read_text()[-4000:] if path.exists() else "(no controller log)"

    def wait_event(
        self,
        kind: int,
        after: int = 0,
        timeout_s: float = 40.0,
        pred: Callable[[LogEntry], bool] | None = None,
    ) -> LogEntry:
        def found() -> LogEntry | None:
            return next(
                (e for e in self.events() if e.seq > after and e.kind == kind and (pred is None or pred(e))),
                None,
            )

        return wait_until(
            found,
            timeout_s,
            f"a {E.EventKind.Name(kind)} event after seq {after}",
            interval_s=0.1,
            detail=lambda: (
                "\n".join(
                    f"{e.seq} {E.EventKind.Name(e.kind)}: {e.message[:200]}" for e in self.events()[-15:]
                )
                + "\n--- controller log ---\n"
                + self.log_tail()
            ),
        )

    def last(self, kind: int) -> LogEntry:
        return [e for e in self.events() if e.kind == kind][-1]

    def mark(self) -> int:
        events = self.events()
        return events[-1].seq if events else 0

    def steady(self, after: int = 0) -> LogEntry:
        """The first step of the newest launch after `after`: the attempt trains."""
        launch = self.wait_event(E.EVENT_KIND_LAUNCH, after)
        self.wait_event(E.EVENT_KIND_FIRST_STEP, launch.seq)
        return launch

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return controllerctl(self.api_address, *args)

    def inject(self, line: str) -> str:
        answer = self.fleet.inject(line)
        assert answer.startswith("ok "), answer
        return answer


@pytest.fixture
def light_deployment(etcd: EtcdServer, tmp_path: Path) -> Iterator[Callable[..., LightDeployment]]:
    made: list[LightDeployment] = []

    def make(
        *,
        nodes: int = 16,
        active: int = 12,
        flags: list[str] | None = None,
        policy: dict[str, object] | None = None,
    ) -> LightDeployment:
        d = LightDeployment(
            etcd,
            tmp_path / f"deployment{len(made)}",
            nodes=nodes,
            active=active,
            flags=flags or [],
            policy={
                "burn_in_passes": 1,
                "burn_in_soak_neighbours": 0,  # a light agent runs no all-reduce (UNIMPLEMENTED anyway)
                "backoff_base_s": 0.5,
                "backoff_max_s": 5.0,
                "stop_grace_s": 5.0,
                "dump_timeout_s": 3.0,
                "startup_timeout_s": 60.0,
                **(policy or {}),
            },
        )
        made.append(d)
        return d.start()

    yield make
    for d in made:
        started = time.monotonic()
        d.stop()
        assert time.monotonic() - started < 40
