"""The agent: one object holding the node's state, composed of the parts that do the work.

Threads: the gRPC server's pool; `ticker` (progress flush every interval, sd_notify watchdog,
node record refresh); liveness; evidence writer; monitors; one reaper per launched worker.
The watchdog is pinged from the ticker, so a wedged ticker makes systemd restart the agent.

Draining (`drain`: the Drain RPC, SIGUSR1, SIGTERM): the node record says NODE_STATE_DRAINING with
the reason and new launches are refused; the running attempt is the controller's to end with a
planned stop. `leave` is the SIGTERM path: drain, hand the attempt over, exit once the workers are
gone (see its docstring).
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

import runwarden
from nodeagent.daemon import leftovers, proctree, torchrun
from nodeagent.daemon import progress as progress_mod
from nodeagent.daemon.config import AgentConfig
from nodeagent.daemon.evidence import EvidencePublisher
from nodeagent.daemon.launcher import Launcher, LaunchError, LaunchSpec, Worker, resolve_allowed
from nodeagent.daemon.liveness import PeerLeases, Registration, Verdict, peers_cannot_renew
from nodeagent.daemon.metrics import AgentMetrics
from nodeagent.daemon.monitors import NvmlPoller, XidMonitor
from nodeagent.daemon.progress import ProgressTable
from nodeagent.warm import groups as warm
from runwarden import run_policy
from runwarden.evidence import is_fatal
from runwarden.launch import LIVENESS_PEERS
from runwarden.sdnotify import Notifier, watchdog_interval_s
from runwarden.store import START_WAIT_S
from runwarden.v1 import agent_pb2, common_pb2, store_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class StopState:
    reason: str
    requested_at: float


# How long the lease vouch waits for peers' answers (the fence waits that much at most for them; the
# channels are connected at launch, so an answering peer needs a round trip, not a TLS handshake).
PEER_ASK_TIMEOUT_S = 0.5


def _peer_credentials(config: AgentConfig) -> grpc.ChannelCredentials | None:
    """The agent's identity towards its peers: its own server certificate, trusted by the cluster CA."""
    if not config.tls_enabled:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None,
        private_key=Path(config.tls_key).read_bytes(),
        certificate_chain=Path(config.tls_cert).read_bytes(),
    )


class Refusal(enum.Enum):
    """Why LaunchWorkers was refused before anything started (the servicer's status code)."""

    NOT_NOW = "not now"  # no lease, draining, stale leader or attempt, a launch this node cannot build
    DENIED = "denied"  # an executable the agent's allow-list does not hold
    RUNNING = "running"  # the run's workers still run here


class LaunchRefused(Exception):
    def __init__(self, message: str, kind: Refusal = Refusal.NOT_NOW) -> None:
        super().__init__(message)
        self.kind = kind


class Agent:
    def __init__(self, config: AgentConfig, *, store: Any = None, nvml: Any = None) -> None:
        self.config = config
        self.store = store
        self.metrics = AgentMetrics()
        self.progress = ProgressTable()
        self.launcher = Launcher(allowed_executables=config.allowed_executables, on_exit=self._on_worker_exit)
        self._flush_lock = threading.Lock()  # one flush at a time: an older snapshot never lands last
        self.evidence = EvidencePublisher(
            store=store, node=config.node, metrics=self.metrics, recent=config.evidence_recent
        )
        self.evidence.add_listener(self._on_evidence)
        self.xid = XidMonitor(node=config.node, publish=self.evidence.publish)
        self.nvml = (
            NvmlPoller(node=config.node, nvml=nvml, publish=self.evidence.publish)
            if nvml is not None
            else None
        )
        self.registration: Registration | None = None
        if store is not None:
            self.registration = Registration(
                store=store,
                node=config.node,
                ttl_s=config.lease_ttl_s,
                make_record=self.node_record,
                metrics=self.metrics,
                on_fenced=self._self_fence,
                vouch=self._peers_cannot_renew,
            )
            self.metrics.track_heartbeat(self.registration.last_heartbeat_at)
        self.notifier = Notifier()
        self.lock = threading.Lock()
        self.stops: dict[str, StopState] = {}
        self.slow_s: dict[int, float] = {}
        self.fences: dict[str, int] = {}
        self.peer_leases = PeerLeases(_peer_credentials(config), timeout_s=PEER_ASK_TIMEOUT_S)
        self._peers: tuple[str, ...] = ()
        self.attempts: dict[str, int] = {}
        self.last_preflight: common_pb2.PreflightSummary | None = None
        self.preflight_running = threading.Lock()
        self.unhealthy = False  # fatal evidence seen: no launch until this agent is restarted (repaired)
        self.unhealthy_because = ""
        self.gpu_count = 0
        self.advertise = config.advertise
        self.rdzv_port = config.rdzv_port  # 0 until start() picks one
        self._closed = threading.Event()
        self._followed: set[str] = set()  # runs whose stop and policy keys are watched
        self._watches: list[Any] = []
        self.run_policies: dict[str, run_policy.AgentPolicy] = {}  # the agents' part, per run
        self.launched_at: dict[str, float] = {}  # run -> the controller's clock at its current launch
        self.attempt_started_ns: dict[str, int] = {}  # run -> wall clock of its current attempt's launch
        self._ticker: threading.Thread | None = None
        self._state_changed = threading.Event()
        self.drain_reason = ""  # "" = not draining
        self.leaving = False  # SIGTERM: draining until the workers are gone, then exiting
        self.warm: warm.ParkedGroups | None = None  # with warm_workers: the parked rank processes
        self._launch_lock = threading.Lock()  # one launch at a time (a warm one may wait for its group)

    # --- state ---------------------------------------------------------------------------------

    @property
    def peers(self) -> tuple[str, ...]:
        """The other agents of the last structured launch (at most 8 are asked before a fence)."""
        return self._peers

    @peers.setter
    def peers(self, peers: tuple[str, ...]) -> None:
        self._peers = peers
        # connected now, not when the lease runs out: the ask then costs a round trip, not a handshake
        self.peer_leases.connect(peers[:8])

    def node_state(self) -> common_pb2.NodeState.ValueType:
        if self.unhealthy:
            return common_pb2.NODE_STATE_UNHEALTHY
        if self.drain_reason:
            return common_pb2.NODE_STATE_DRAINING
        if self.preflight_running.locked():
            return common_pb2.NODE_STATE_PREFLIGHT
        if any(w.running for w in self.launcher.workers()):
            return common_pb2.NODE_STATE_RUNNING
        return common_pb2.NODE_STATE_READY

    def node_record(self) -> store_pb2.NodeRecord:
        record = store_pb2.NodeRecord(
            node=self.config.node,
            host=socket.gethostname(),
            address=self.advertise,
            gpu_count=self.gpu_count,
            agent_version=runwarden.__version__,
            state=self.node_state(),
            local_ranks=self.local_ranks,
            rdzv_port=self.rdzv_port,
            torch_host=torchrun.torch_host(self.config.advertised_host),
            drain_reason=self.drain_reason,
        )
        if self.last_preflight is not None:
            record.last_preflight.CopyFrom(self.last_preflight)
        return record

    @property
    def local_ranks(self) -> int:
        """Ranks per attempt on this node: configured, else one per GPU NVML sees, else 1."""
        return self.config.local_ranks or self.gpu_count or 1

    def torchrun_facts(self) -> torchrun.NodeFacts:
        return torchrun.NodeFacts(
            torchrun=self.config.torchrun,
            local_ranks=self.local_ranks,
            torch_host=torchrun.torch_host(self.config.advertised_host),
            rdzv_port=self.rdzv_port,
            collective_ifname=self.config.collective_ifname,
        )

    def state_changed(self) -> None:
        """Ask the ticker to re-put the node record (soon, not in the caller's thread)."""
        self._state_changed.set()

    def _on_evidence(self, evidence: common_pb2.Evidence) -> None:
        if is_fatal(evidence) and not self.unhealthy:
            self.unhealthy = True
            self.unhealthy_because = evidence.detail[:300] or common_pb2.EvidenceKind.Name(evidence.kind)
            self.state_changed()

    # --- draining --------------------------------------------------------------------------------

    def drain(self, reason: str) -> None:
        """Take the node out of service: the record says DRAINING with `reason` (re-put at once),
        launches are refused. The running attempt keeps running until the controller (or `leave`)
        stops it. A later drain replaces the reason."""
        reason = reason or "drain requested (no reason given)"
        with self.lock:
            changed = reason != self.drain_reason
            self.drain_reason = reason
        if changed:
            log.warning("node %s is draining: %s", self.config.node, reason)
            self.state_changed()

    def undrain(self) -> None:
        """Back in service (an operator's undo); refused by the caller while the agent is leaving."""
        with self.lock:
            was, self.drain_reason = self.drain_reason, ""
        if was:
            log.warning("node %s is back in service (was draining: %s)", self.config.node, was)
            self.state_changed()

    def leave(self, reason: str, *, wait: Callable[[float], bool]) -> None:
        """SIGTERM to the agent (`systemctl stop`, Kubernetes, scancel): drain with `reason`, then
        wait for the controller to end the running attempt with a planned stop (its RequestStop or
        the run's stop key: the ranks finish the step, save, commit and exit 0). A run with no stop
        request after `drain_handoff_s` (no controller, say) gets one from the agent itself, so its
        ranks still save and exit 0. Workers still running after `drain_timeout_s` are stopped hard
        (TERM, KILL after stop_grace_s). Returns once no worker runs and every exit is in etcd.

        `wait(t)` waits up to t seconds and returns True to stop hard at once (a second SIGTERM, a
        SIGINT). The planned path never signals torchrun itself: torchrun exits 1 after a SIGTERM
        even when every rank exited 0 (see nodeagent.daemon.launcher)."""
        cfg = self.config
        self.leaving = True
        self.drain(reason)
        self.notifier.stopping()
        self.notifier.extend_timeout(cfg.drain_timeout_s + cfg.stop_grace_s + 30)
        start = time.monotonic()
        handoff_at, deadline = start + cfg.drain_handoff_s, start + cfg.drain_timeout_s
        asked: set[str] = set()
        hurry = False
        while True:
            running = sorted({w.run for w in self.launcher.workers() if w.running})
            if not running:
                break
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= handoff_at:
                for run in running:
                    if run not in self.stops and run not in asked:
                        asked.add(run)
                        log.warning(
                            "run %s: no stop request within %g s of draining; asking its ranks to stop",
                            run,
                            cfg.drain_handoff_s,
                        )
                        self.set_stop(
                            run,
                            f"{reason}: no stop request from the controller within {cfg.drain_handoff_s:g} s",
                        )
            if wait(min(0.1, max(0.0, (handoff_at if now < handoff_at else deadline) - now))):
                hurry = True
                break
        if any(w.running for w in self.launcher.workers()):
            log.error(
                "stopping the workers hard (%s): TERM, KILL after %.1f s",
                "asked to hurry"
                if hurry
                else f"still running {cfg.drain_timeout_s:g} s after the drain began",
                cfg.stop_grace_s,
            )
            self.launcher.stop_all(cfg.stop_grace_s)
        self.wait_exits_recorded()

    def wait_exits_recorded(self, timeout_s: float = 10.0) -> None:
        """Until the exit of every ended worker went through its callback (the progress put)."""
        deadline = time.monotonic() + timeout_s
        for w in self.launcher.workers():
            if not w.running:
                w.reaped.wait(max(0.0, deadline - time.monotonic()))

    def set_stop(self, run: str, reason: str) -> None:
        """The stop file (with the reason) first, then the flag the ranks' reports are answered
        with: a rank that sees the flag finds the reason in the file."""
        path = self.config.stop_file(run)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(".stop.tmp")
        tmp.write_text(reason + "\n")
        os.replace(tmp, path)
        with self.lock:
            self.stops[run] = StopState(reason=reason, requested_at=time.time())

    def clear_stop(self, run: str) -> None:
        with self.lock:
            self.stops.pop(run, None)
        self.config.stop_file(run).unlink(missing_ok=True)

    def follow_run(self, run: str) -> None:
        """Once a run is known here, watch two of its etcd keys: the stop key (a planned stop the
        controller wrote reaches the local ranks even if no RequestStop call comes) and the policy
        record (the agents' part of the run's policy, runwarden/run_policy.py, changed live)."""
        if self.store is None or run in self._followed:
            return
        with self.lock:
            if run in self._followed:
                return
            self._followed.add(run)
        keys = self.store.keys
        for name, key, apply in (
            ("stop", keys.stop(run), self._apply_stop_key),
            ("policy", keys.policy(run), self._apply_policy_key),
        ):
            threading.Thread(
                target=self._watch_key, args=(run, key, apply), name=f"{name}-watch-{run}", daemon=True
            ).start()

    def _watch_key(self, run: str, key: str, apply: Callable[[str, bytes | None], None]) -> None:
        """List `key`, apply it, then watch it from that revision (retried until the store answers)."""
        delay = 0.2
        while not self._closed.is_set():
            try:
                kvs, revision = self.store.get_prefix(key)
                apply(run, kvs[0].value if kvs else None)

                def on_event(event: Any) -> None:
                    kvs = getattr(event, "kvs", None)
                    if kvs is not None:  # relisted after a compaction: the key as it is now
                        apply(run, kvs[0].value if kvs else None)
                    else:
                        apply(run, event.value if event.type.value == "PUT" else None)

                watch = self.store.watch_prefix(key, revision + 1, on_event)
                with self.lock:
                    self._watches.append(watch)
                return
            except Exception as exc:
                log.warning("cannot watch %s of run %s yet (retrying): %s", key, run, exc)
                self._closed.wait(delay)
                delay = min(delay * 2, 5.0)

    def _apply_policy_key(self, run: str, value: bytes | None) -> None:
        """The agents' part of the run's policy; a bad record keeps the last good one (and says so)."""
        if value is None:
            policy = run_policy.AgentPolicy()
        else:
            try:
                policy = run_policy.AgentPolicy.parse(value)
            except ValueError as exc:
                log.warning(
                    "run %s: policy record refused, keeping %s: %s", run, self.policy_of(run).describe(), exc
                )
                return
        with self.lock:
            if self.run_policies.get(run, run_policy.AgentPolicy()) == policy:
                self.run_policies[run] = policy
                return
            self.run_policies[run] = policy
        log.info("run %s: the agents' policy is now: %s", run, policy.describe())
        self._state_changed.set()  # the ticker picks up a new progress interval at once

    def read_policy(self, run: str) -> run_policy.AgentPolicy:
        """Read the run's policy record now (a launch uses the newest, even before its watch has
        listed it); an unreachable store keeps what the watch last saw."""
        if self.store is not None:
            try:
                kvs, _ = self.store.get_prefix(self.store.keys.policy(run))
            except Exception as exc:
                log.warning("run %s: cannot read the policy record (keeping the last one): %s", run, exc)
            else:
                self._apply_policy_key(run, kvs[0].value if kvs else None)
        return self.policy_of(run)

    def policy_of(self, run: str) -> run_policy.AgentPolicy:
        with self.lock:
            return self.run_policies.get(run, run_policy.AgentPolicy())

    def fr_buffer_size(self, run: str) -> int:
        """Flight-recorder entries per rank for the next launch of `run`."""
        return self.policy_of(run).fr_buffer_size or self.config.fr_buffer_size

    def progress_interval_s(self) -> float:
        """The progress write interval: the policy of the run whose workers run here (a node serves
        one run at a time), else of the last run followed, else this agent's config."""
        running = [w.run for w in self.launcher.workers() if w.running]
        with self.lock:
            runs = running or list(self.run_policies)
            for run in reversed(runs):
                interval = self.run_policies.get(run, run_policy.AgentPolicy()).progress_interval_s
                if interval:
                    return interval
        return self.config.progress_interval_s

    def _apply_stop_key(self, run: str, value: bytes | None) -> None:
        if value is None:
            if run in self.stops:
                log.info("run %s: stop key deleted, stop request withdrawn", run)
                self.clear_stop(run)
            return
        try:
            request = store_pb2.StopRequest.FromString(value)
            reason = request.reason or "stop requested"
            if request.relaunch and 0 < request.requested_at < self.launched_at.get(run, 0.0):
                # The relaunching stop this launch follows (both stamps the controller's clock); a
                # stop that ends the run is applied however old: the controller never relaunches past it.
                log.info("run %s: a relaunching stop from before this launch (%s): not applied", run, reason)
                return
        except Exception:
            reason = "stop requested (unreadable stop record)"
        if run not in self.stops:
            log.info("run %s: stop requested in etcd: %s", run, reason)
            self.set_stop(run, reason)

    def report_progress(self, request: agent_pb2.ReportProgressRequest) -> agent_pb2.ReportProgressResponse:
        """A validated batch of rank reports (gRPC or datagram); the answer carries the stop flag."""
        self.progress.record(request.run, request.attempt, request.reports)
        if self.progress.take_urgent_reports() and self.store is not None:
            # a rank finished loading, or took its first step after: written now (once each per rank
            # per attempt), off the caller's thread
            threading.Thread(target=self.flush_progress, name="flush-urgent", daemon=True).start()
        self.follow_run(request.run)
        slow = max((self.slow_s.get(r.local_rank, 0.0) for r in request.reports), default=0.0)
        return agent_pb2.ReportProgressResponse(stop_requested=request.run in self.stops, slow_s=slow)

    def knows_run(self, run: str) -> bool:
        return run in self.progress.runs() or bool(self.launcher.workers(run)) or run in self.stops

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        if (
            self.nvml is not None
            and self.config.nvml_interval_s > 0
            and self.nvml.start(self.config.nvml_interval_s)
        ):
            try:
                self.gpu_count = self.nvml._nvml.device_count()
            except Exception as exc:
                log.warning("NVML device count failed: %s", exc)
        if not self.rdzv_port:
            self.rdzv_port = torchrun.pick_rdzv_port()
        ifname = self.config.collective_ifname
        if ifname and not os.path.exists(f"/sys/class/net/{ifname}"):
            log.warning("collective_ifname %s: no such network interface here; collectives will fail", ifname)
        if self.config.warm_workers:
            self._start_parked_groups()
            # registered once a group is parked, so no launch comes before one can take it (bounded:
            # the agent serves within its unit's start timeout whatever the imports cost)
            if self.warm is not None and not self.warm.wait_parked(min(self.config.warm_wait_s, 20.0)):
                log.warning("warm workers: no group parked within warm_wait_s; registering anyway")
        self.xid.start(self.config.kernel_log, self.config.dmesg_interval_s)
        self.evidence.start()
        if self.registration is not None:
            self._judge_orphans()
            self.registration.start(wait_s=START_WAIT_S)
        self._ticker = threading.Thread(target=self._tick_loop, name="ticker", daemon=True)
        self._ticker.start()

    def ready(self) -> None:
        self.notifier.ready(f"serving as {self.config.node}")

    def stop(self, *, stop_workers: bool = True) -> None:
        self.notifier.stopping()
        self._closed.set()
        self._state_changed.set()  # wakes the ticker
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        if self.warm is not None:
            self.warm.close()
        if stop_workers:
            self.launcher.stop_all(self.config.stop_grace_s)
            self.wait_exits_recorded()
            self._stop_orphans("the agent stops its workers")  # KillMode=process: systemd will not
        with self.lock:
            watches = list(self._watches)
        for watch in watches:
            watch.cancel()
        self.xid.stop()
        if self.nvml is not None:
            self.nvml.stop()
        self.flush_progress()
        self.evidence.stop()
        if self.registration is not None:
            self.registration.stop(revoke=True)
        self.peer_leases.close()

    def _peers_cannot_renew(self, unconfirmed_s: float) -> Verdict:
        """Liveness thread, before fencing: `liveness.peers_cannot_renew` over what the running attempt's
        peers answer about their own leases; nothing to keep when no worker runs here."""
        if not any(w.running for w in self.launcher.workers()):
            return Verdict(keep=False, why="no worker runs here")
        return peers_cannot_renew(
            self.peer_leases.ages(self.peers[:LIVENESS_PEERS]),
            unconfirmed_s=unconfirmed_s,
            ttl_s=self.config.lease_ttl_s,
        )

    # --- an earlier incarnation's ranks -----------------------------------------------------------
    # The unit's KillMode=process lets ranks outlive a crashed or watchdog-killed agent: they keep
    # training and report to the restarted agent's socket. No launcher here knows them, so the places
    # that must end them look for them: a fence, a new launch, and a start after the lease expired.

    def _orphans(self) -> dict[int, Any]:
        """Processes an earlier incarnation of this agent started (their environment names this node and
        socket, for an attempt not running here) outside this process's tree, by pid."""
        procs = proctree.all_procs()
        mine = proctree.descendants({os.getpid()}, procs)
        found = leftovers.find(self.config.node, self.config.unix_socket, self.launcher.workers(), procs)
        return {pid: f for pid, f in found.items() if pid not in mine}

    def _stop_orphans(self, why: str) -> None:
        """TERM, then KILL after the stop grace, every orphan of an earlier incarnation (blocking)."""
        found = self._orphans()
        if not found:
            return
        log.warning("%s: stopping %d process(es) an earlier agent started", why, len(found))
        for line in leftovers.kill(found, self.config.stop_grace_s):
            log.warning("orphan of an earlier agent: %s", line)

    def _judge_orphans(self) -> None:
        """At start: an earlier incarnation's ranks keep running while its node key is still in etcd
        (its lease outlived the restart: the controller still counts them in); once it is gone the
        controller has counted the node lost and may be replacing it, so they stop."""
        found = self._orphans()
        if not found:
            return
        assert self.store is not None
        if self.store.get(self.store.keys.node(self.config.node)) is not None:
            log.warning(
                "%d process(es) of an earlier agent run on (pids %s); its lease is alive: they keep running",
                len(found),
                ", ".join(map(str, sorted(found)[:8])),
            )
            return
        threading.Thread(
            target=self._stop_orphans,
            args=("the earlier agent's lease expired before this one started",),
            name="orphans",
            daemon=True,
        ).start()

    def _self_fence(self, reason: str) -> None:
        """Liveness thread: the lease could not be renewed before its TTL ran out. The controller
        counts this node lost and may already be replacing it, so its workers stop: TERM, then KILL
        after the stop grace. Called once per lost lease; returns at once (the stop runs in a thread)."""
        running = sorted({f"{w.run} attempt {w.attempt}" for w in self.launcher.workers() if w.running})
        threading.Thread(
            target=self._stop_orphans, args=("self-fencing",), name="fence-orphans", daemon=True
        ).start()
        if not running:
            log.warning("self-fencing: %s; no workers run here", reason)
            return
        self.metrics.self_fences.inc()
        log.error(
            "self-fencing: %s; stopping the workers of %s (TERM, KILL after %.1f s)",
            reason,
            ", ".join(running),
            self.config.stop_grace_s,
        )
        threading.Thread(
            target=self.launcher.stop_all, args=(self.config.stop_grace_s,), name="self-fence", daemon=True
        ).start()

    def _on_worker_exit(self, worker: Any) -> None:
        """Reaper thread: the exit goes into the run's NodeProgress and to etcd now, not at the next
        interval; the controller's watch on progress is how it learns that workers ended. A parked
        group goes back first: a launch the exit record brings finds it, not an empty slot."""
        if self.warm is not None:
            self.warm.attempt_ended(worker, keep=not self.unhealthy)
        if self.progress.record_exit(worker.run, worker.attempt, worker.exit.to_proto()):
            self.flush_progress()
            self._state_changed.set()

    # --- launching -------------------------------------------------------------------------------

    def _start_parked_groups(self) -> None:
        interpreter = warm.warm_interpreter(self.config.torchrun)
        if not interpreter:
            log.warning(
                "warm_workers: the torchrun prefix %s is not `<python> -m torch.distributed.run`; "
                "every launch goes cold",
                list(self.config.torchrun),
            )
            return
        self.warm = warm.ParkedGroups(
            interpreter=interpreter,
            launcher=self.launcher,
            allowed_executables=self.config.allowed_executables,
            local_ranks=lambda: self.local_ranks,
            env=lambda: dict(os.environ),
            preload=self.config.warm_preload,
            copy_budget_bytes=self.config.memory_copy_budget_bytes,
        )
        self.warm.refill()

    def launch_workers(
        self, request: agent_pb2.LaunchWorkersRequest, wait_s: float | None = None
    ) -> tuple[Worker, warm.LaunchPath, list[Worker]]:
        """LaunchWorkers (a validated request): fenced first, then launched (`launch`); returns the
        worker, its path and the older attempt's workers it stopped first (`stop_older`).

        Refused (LaunchRefused) without a lease or while draining, for a torchrun launch this node
        cannot build, for a stale leader (`leader_fence` older than the run's), an attempt older
        than one already launched, or a run whose workers still run here (unless they are of an
        older attempt and the request says `stop_older`: then they are stopped first, as
        StopWorkers stops them); otherwise the run's fence and attempt are recorded, its stop
        request cleared, and the launch goes on (LaunchError when the launch itself is refused)."""
        run = request.run
        if self.registration is not None and not self.registration.lease_held:
            raise LaunchRefused(
                f"node {self.config.node} holds no lease (etcd unreachable or self-fenced): nothing is launched"
            )
        if self.drain_reason:
            raise LaunchRefused(f"node {self.config.node} is draining: {self.drain_reason}")
        rendezvous_id = request.rendezvous_id or f"{run}-{request.attempt}"
        argv, env = tuple(request.argv), dict(request.env)
        if request.HasField("torchrun"):
            try:
                line, collective = torchrun.build(self.torchrun_facts(), request, rendezvous_id)
            except torchrun.TorchrunRefused as exc:
                raise LaunchRefused(str(exc)) from None
            if request.torchrun.no_python:
                try:  # the command's own executable is started too: the same rule as argv[0]
                    resolve_allowed(
                        request.torchrun.command[0],
                        self.config.allowed_executables,
                        env.get("PATH", os.environ.get("PATH", os.defpath)),
                    )
                except LaunchError as exc:
                    raise LaunchRefused(f"torchrun.command: {exc}", Refusal.DENIED) from None
            if (
                request.torchrun.script_mode == agent_pb2.SCRIPT_MODE_UNMODIFIED
                and self.fr_buffer_size(run) == 0
            ):
                raise LaunchRefused(
                    "torchrun.script_mode: an unmodified script's progress comes from the flight "
                    "recorder, which this agent's fr_buffer_size = 0 turns off"
                )
            argv, env = tuple(line), {**env, **collective}
            self.peers = tuple(request.torchrun.peers)
        if request.HasField("stop_older"):
            started = time.monotonic()
            stopped = self._stop_older(request)
            if wait_s is not None:  # the caller's deadline counts the stop too
                wait_s = max(0.0, wait_s - (time.monotonic() - started))
        else:
            stopped = []
        with self.lock:
            self._check_fence(request)
            if any(w.running for w in self.launcher.workers(run)):
                raise LaunchRefused(f"run {run!r} already has running workers here", Refusal.RUNNING)
            self.fences[run] = request.leader_fence
            self.attempts[run] = request.attempt
            self.launched_at[run] = request.launched_at
        self.clear_stop(run)
        # An injected slowdown (chaos) belongs to the ranks it was injected into, not to the node:
        # a new attempt starts at full speed.
        self.slow_s.clear()
        self.follow_run(run)
        policy = self.read_policy(run)  # the agents' part of the run's policy (runwarden/run_policy.py)
        env = {**env, **policy.trace_env()}
        spec = LaunchSpec(
            run=run,
            attempt=request.attempt,
            node=self.config.node,
            rendezvous_id=rendezvous_id,
            argv=argv,
            env=env,
            cwd=request.cwd,
            node_rank=request.node_rank,
            nnodes=request.nnodes or 1,
            resume_step=request.resume_step,
            stop_file=self.config.stop_file(run),
            fr_socket_dir=self.config.fr_socket_dir(run, request.attempt),
            agent_socket=self.config.unix_socket,
            fr_buffer_size=policy.fr_buffer_size or self.config.fr_buffer_size,
        )
        ask = (
            warm.WarmAsk(
                command=torchrun.rank_command(request.torchrun),
                rdzv_endpoint=request.torchrun.rdzv_endpoint,
                is_host=request.torchrun.is_host,
                no_python=request.torchrun.no_python,
                node_rank=request.node_rank,
                nnodes=request.nnodes,
                cold=request.torchrun.cold,
            )
            if request.HasField("torchrun")
            else None
        )
        worker, path = self.launch(spec, ask, wait_s)
        return worker, path, stopped

    def _check_fence(self, request: agent_pb2.LaunchWorkersRequest) -> None:
        """(under self.lock) A stale leader's launch, or an attempt older than one launched: refused."""
        run = request.run
        if request.leader_fence < self.fences.get(run, 0):
            raise LaunchRefused(
                f"leader_fence {request.leader_fence} is older than {self.fences[run]}: stale leader"
            )
        if request.attempt < self.attempts.get(run, 0):
            raise LaunchRefused(
                f"attempt {request.attempt} is older than attempt {self.attempts[run]} already launched"
            )

    def _stop_older(self, request: agent_pb2.LaunchWorkersRequest) -> list[Worker]:
        """LaunchWorkers.stop_older: the run's running workers of older attempts, stopped as
        StopWorkers(attempt, grace_s, park_within_s) stops them, once the launch is known not to be
        stale; workers of this attempt (a retried launch that landed) or a newer one are left be."""
        run = request.run
        with self.lock:
            self._check_fence(request)  # a stale launch stops nothing
        older = sorted(
            {w.attempt for w in self.launcher.workers(run) if w.running and w.attempt < request.attempt}
        )
        grace = request.stop_older.grace_s or self.config.stop_grace_s
        stopped: list[Worker] = []
        for attempt in older:
            stopped += self.stop_workers(run, attempt, grace, request.stop_older.park_within_s)
        if stopped:
            log.info(
                "run %s attempt %d: stopped attempt(s) %s first (%d worker(s))",
                run,
                request.attempt,
                ", ".join(map(str, older)),
                len(stopped),
            )
        return stopped

    def launch(
        self, spec: LaunchSpec, ask: warm.WarmAsk | None, wait_s: float | None = None
    ) -> tuple[Worker, warm.LaunchPath]:
        """Start the attempt's workers: handed to the parked group when the warm path can run it
        (nodeagent.warm.groups), else torchrun as always. LaunchError when refused.

        One launch at a time, and the attempt is checked again once this one's turn (and its
        parked group) came: a launch that waited is never started after a newer attempt's. A parked
        group still starting is waited for at most `wait_s` (the caller's deadline) or warm_wait_s;
        then the launch is refused (temporarily), not sent cold: a cold node never meets warm ones.
        An unhealthy host (fatal evidence, or a preflight that failed closed) launches nothing."""
        if self.unhealthy:  # runwarden.evidence.is_fatal: no work until the host is repaired
            raise LaunchError(
                f"node {self.config.node} is unhealthy (fatal evidence, see GetNodeStatus): nothing is launched"
            )
        with self._launch_lock:
            self._stop_orphans(f"run {spec.run} attempt {spec.attempt} launches")
            # A kept (warm) rank's flight recorder still holds its earlier attempts' collectives: its
            # dumps are cut at this launch (CollectFlightRecorder), else they blame a fresh rank.
            self.attempt_started_ns[spec.run] = time.time_ns()
            wait = (
                self.config.warm_wait_s if wait_s is None else max(0.0, min(wait_s, self.config.warm_wait_s))
            )
            result = warm.try_launch(
                self.warm,
                spec,
                ask,
                enabled=self.config.warm_workers,
                wait_s=wait,
                still_latest=self._still_latest,
            )
            if isinstance(result, warm.Launched):
                return result.worker, warm.LaunchPath(kind="warm", detail=result.detail)
            why = result.reason
            if result.temporary:
                raise LaunchError(f"warm workers: {why}; try again", temporary=True)
            self._still_latest(spec)
            if self.config.warm_workers:
                log.info("run %s attempt %d: cold launch (torchrun): %s", spec.run, spec.attempt, why)
            return self.launcher.launch(spec), warm.LaunchPath(kind="cold", detail=why)

    def _still_latest(self, spec: LaunchSpec) -> None:
        with self.lock:
            latest = self.attempts.get(spec.run, 0)
        if spec.attempt < latest:
            raise LaunchError(f"attempt {spec.attempt} was superseded by attempt {latest} while it waited")

    def stop_workers(
        self, run: str, attempt: int, grace_s: float, park_within_s: float = 0.0
    ) -> list[Worker]:
        """StopWorkers: with park_within_s > 0, a warm worker's ranks leave the attempt and park again
        in the same processes (ParkedGroups.park); what has not parked within the bound, or a
        cold worker, is stopped as always (TERM, KILL after grace_s); on a node with fatal evidence,
        or for a worker with a stopped process, an unplanned stop (park_within_s > 0) KILLs at once."""
        parking: list[Worker] = []
        if park_within_s > 0 and self.warm is not None and not self.unhealthy:
            parking = self.warm.park(run, attempt, park_within_s)
        if park_within_s > 0 and (self.unhealthy or self._holds_a_stopped_process(run, attempt)):
            # An unplanned stop on a node with fatal evidence (an Xid, say), or of a worker with a
            # stopped process (SIGSTOP: it cannot act on a TERM until it is continued): KILLed at
            # once. What they could save is committed already (a save from a failed GPU is not worth
            # having), and the relaunch waits for this exit: a TERM's grace would be downtime.
            grace_s = 0.0
        stopped = self.launcher.stop(run, attempt, grace_s)
        ended = [w for w in parking if w not in stopped] + stopped
        # The answer is the controller's word that these workers ended, and a relaunch may follow
        # at once: answered once each exit went through its callback (the parked group back, the
        # exit in the progress record), so that launch finds the group, not an empty slot.
        deadline = time.monotonic() + 10.0
        for w in ended:
            if not w.running:
                w.reaped.wait(max(0.0, deadline - time.monotonic()))
        return ended

    def _holds_a_stopped_process(self, run: str, attempt: int) -> bool:
        return any(
            p.state in ("T", "t")
            for w in self.launcher.workers(run)
            if w.running and (attempt == 0 or w.attempt == attempt)
            for p in proctree.alive(w.track())
        )

    def flush_progress(self) -> int:
        if self.store is None:
            return 0
        try:
            with self._flush_lock:
                written = progress_mod.flush(self.progress, self.store, self.config.node)
        except Exception as exc:
            log.warning("progress write failed (retried next interval): %s", exc)
            return 0
        if written:
            self.metrics.progress_writes.inc(written)
        return written

    def _tick_loop(self) -> None:
        interval = self.progress_interval_s()
        self.metrics.progress_interval.set(interval)
        watchdog = watchdog_interval_s()
        next_flush = time.monotonic() + interval
        was_running = False
        while True:
            period = min(interval, watchdog) if watchdog else interval
            # state_changed wakes the ticker at once: a drain is in the node record within one put
            self._state_changed.wait(max(0.0, min(period, next_flush - time.monotonic())))
            if self._closed.is_set():
                return
            now = time.monotonic()
            if (changed := self.progress_interval_s()) != interval:  # the run's policy changed it
                log.info("progress write interval %.3g s -> %.3g s", interval, changed)
                interval, next_flush = changed, min(next_flush, now + changed)
                self.metrics.progress_interval.set(interval)
            if now >= next_flush:
                self.flush_progress()
                next_flush = max(next_flush + interval, now)
            running = any(w.running for w in self.launcher.workers())
            if running != was_running:
                was_running = running
                self._state_changed.set()
            if self.registration is not None:
                self.registration.last_heartbeat_at()  # samples the keeper's refresh count
            if self._state_changed.is_set():
                self._state_changed.clear()
                if self.registration is not None:
                    self.registration.update()
            if watchdog:
                self.notifier.watchdog()
