"""The supervisor's policy knobs: one frozen config, validated once (raft's `Config.validate()`).

Load from TOML with `runwarden.config.load_section(SupervisorConfig, mapping, "controller.supervisor.policy")`.
All durations are seconds as floats.
"""

from __future__ import annotations

from dataclasses import dataclass

from runwarden import run_policy
from runwarden.v1 import store_pb2

DAY_S = 86400.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorConfig:
    # Restarts after failures (planned stops and preflight rejections do not count).
    restart_budget: int = 20
    restart_budget_window_s: float = DAY_S  # 0: the budget covers the whole run
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    backoff_reset_s: float = 300.0  # an attempt that ran this long resets the backoff exponent

    # Preflight before an attempt, and burn-in for quarantined nodes. Every node of an attempt has a
    # passing preflight, or trained healthily in the attempt before, within preflight_max_age_s and
    # no evidence about it since; the others are preflighted before the launch (0: every node, every
    # attempt). Idle spares are re-checked in the background every spare_check_interval_s while the
    # run trains (0: never), so a replacement is a pre-validated spare.
    preflight_mode: str = "quick"
    preflight_timeout_s: float = 120.0
    preflight_max_age_s: float = 600.0
    spare_check_interval_s: float = 300.0
    queue_wait_s: float = (
        30.0  # before the first attempt: let the allocated nodes join before asking for more
    )
    # Waiting for nodes this long (none came from the queue, no spare is left) pages and says so in
    # the event log, once per wait; 0: never.
    waiting_page_s: float = 600.0
    # The bandwidth gate: after the per-node preflight, an all-reduce across exactly the next
    # attempt's nodes (and its ring pairs, to find a slow link); a node whose best pair figure is
    # below bandwidth_gate_ratio x the floor (bandwidth_floor_gbps, or the median of the set when 0)
    # is quarantined and replaced before the attempt pays for it. bandwidth_gate_timeout_s is its
    # budget: past it the attempt launches without the gate (logged).
    bandwidth_gate: bool = False
    bandwidth_floor_gbps: float = 0.0
    bandwidth_gate_ratio: float = 0.5
    bandwidth_gate_timeout_s: float = 60.0
    # Burn-in of a quarantined node: preflight's burn-in pipeline ("burn_in": sustained matmul, memory
    # test, dcgmi diag -r 3, all-reduce soak, storage; most of an hour on GPUs by the node's
    # [burn_in] config), or a per-attempt mode ("full", "quick"). One pass of the pipeline is long:
    # burn_in_passes counts passes in a row. burn_in_timeout_s bounds one pass's RPC: above the
    # node's [run] burn_in_budget_s (3600 s by default).
    burn_in_mode: str = "burn_in"
    burn_in_passes: int = 1
    burn_in_timeout_s: float = 4000.0
    # After its node-local stages pass, a burned-in node soaks an all-reduce with this many idle
    # spares (best reputation first; 0: off): the link burn-in no node can do alone. It passes at
    # bandwidth_gate_ratio x the floor (bandwidth_floor_gbps, or the neighbours' own median), with
    # burn_in_soak_iterations timed all-reduces per group, within burn_in_soak_timeout_s (no answer
    # in time, or no idle neighbour: released on the node-local stages alone, and the log says so).
    burn_in_soak_neighbours: int = 2
    burn_in_soak_iterations: int = 50
    burn_in_soak_timeout_s: float = 300.0
    hold_after_failures: int = 2  # failures within hold_window_s that put a node on hold
    hold_window_s: float = 7 * DAY_S
    # A node clean this long (since first seen or its last failure; never with a straggler flag or a
    # preflight rejection) is a golden host: the first choice for replacements and node rank 0. 0: off.
    golden_after_s: float = 7 * DAY_S

    # Hang: max(floor, multiple x median step time, longest collective); hang_timeout_s overrides
    # the derived value (still >= longest_collective_s). Inside a checkpoint the timeout is at least
    # the save allowance: checkpoint_barrier_s until checkpoint_saves_to_learn saves were seen, then
    # checkpoint_save_multiple x the longest recent save, capped at checkpoint_barrier_s (a job
    # whose saves take 0.5 s should not wait 120 s for a rank stopped inside one).
    hang_timeout_s: float | None = None
    hang_timeout_floor_s: float = 10.0
    hang_step_multiple: float = 3.0
    longest_collective_s: float = 0.0
    checkpoint_barrier_s: float = 120.0
    checkpoint_save_multiple: float = 3.0
    checkpoint_saves_to_learn: int = 3
    # Collective rule (controller/supervisor/collectives.py): ranks that entered a default-group
    # collective collective_hang_s ago (0: off) while another rank has not are waiting on a hung rank,
    # at any step length; the bound grows to collective_lateness_multiple x the longest lateness the
    # run showed without a hang (a straggler). eval_timeout_s: the longest a declared evaluation
    # (ProgressReporter.evaluating) holds the step rule's timeout off (the collective rule waits it out).
    collective_hang_s: float = 5.0
    collective_lateness_multiple: float = 3.0
    eval_timeout_s: float = 1800.0
    # In-memory snapshots between commits (nodeagent.trainer.snapshot, controller/supervisor/snapshots.py):
    # the ranks snapshot every this many seconds of steps; a relaunch resumes from the newest one every
    # rank's state survives in. 0: none. 60 s: Young/Daly's sqrt(2 x MTBF x stall), 47 s for Llama 3's
    # 3.1 h job MTBF and the measured 0.1 s stall (BENCHMARKS.md), rounded up.
    snapshot_interval_s: float = 60.0
    startup_timeout_s: float = 300.0  # launch -> first progress of every node
    # a node still loading its checkpoint this long after another node of the attempt finished
    # loading is stalled (a hanging download or mount): blamed, not waited for until the startup
    # timeout. 0: off.
    load_stall_s: float = 120.0

    # Straggler: rank with compute >= compute_ratio x median and wait <= wait_ratio x median wait,
    # while the median wait is at least min_wait_s; persistent = flagged in >= persistence of the
    # last window evaluations (one evaluation per job step).
    straggler_window: int = 20
    straggler_persistence: float = 0.7
    straggler_compute_ratio: float = 1.05
    straggler_wait_ratio: float = 0.5
    straggler_min_wait_s: float = 0.001
    straggler_ewma_alpha: float = 0.3
    kill_stragglers_mid_run: bool = False

    # Crash loop and blame. The same failure (its label, at the same step: restart.Signature says how
    # close) crash_loop_count times in a row ends the run as a crash loop whoever was blamed
    # (restart.py); the nodes quarantined for it return without a strike.
    crash_loop_count: int = 3
    # Blast radius (Kubernetes' node-lifecycle controller stops evicting in an unhealthy zone): more
    # than max(blast_radius_nodes, blast_radius_fraction x the nodes known) automatic quarantines
    # within blast_radius_window_s stops automatic quarantine and pages; an operator decides beyond.
    blast_radius_nodes: int = 5
    blast_radius_fraction: float = 0.02
    blast_radius_window_s: float = 3600.0
    repeat_offender_count: int = 2  # first-to-exit without evidence at different steps -> quarantine
    fr_min_confidence: float = 0.5
    evidence_window_s: float = 600.0

    # Control-plane guard: mass_expiry_min_nodes lease expiries within the window, at any fleet size,
    # are not a hardware fault (hosts do not fail together within seconds; a switch, a partition or
    # etcd does); nor, in a fleet too small for that count, is mass_expiry_fraction of it (at least
    # two), as Kubernetes' node-lifecycle controller takes both an absolute and a fraction.
    mass_expiry_min_nodes: int = 3
    mass_expiry_fraction: float = 0.55
    mass_expiry_window_s: float = 2.0
    # A lone lost node's peers are stopped this long after its expiry, not at once: a mass expiry's
    # first leases come together (etcd's lessor revokes the expired ones every 500 ms, and a fleet's
    # keepalives spread over TTL/3), so one tick shows it in a fleet of a few hosts and more, and the
    # attempt keeps running instead of being stopped for the control plane's fault.
    lost_node_hold_s: float = 0.5
    control_plane_grace_s: float = 60.0

    # Failure handling.
    collect_dumps: bool = True
    dump_timeout_s: float = 20.0
    stop_grace_s: float = 30.0
    # Ranks that took their last step get this long to exit before it is a hang ("hang:exit").
    exit_timeout_s: float = 120.0
    stop_margin_s: float = 10.0

    # The training loss (controller/supervisor/loss.py); never blamed on a node. A non-finite loss is
    # always an anomaly; a loss above loss_spike_factor x the rank's running median (its last
    # loss_spike_window finite losses, once the rank is past loss_spike_warmup_steps and the window
    # is full) is a spike (0: off). on_loss_anomaly: "page", or "stop": stop the attempt and relaunch
    # from the newest commit before the anomaly's step. A resumed attempt's loss at a (step, rank) an
    # earlier attempt reported, relatively further than divergence_tolerance from it (0: off), is a
    # DIVERGENCE: on_divergence "page" or "stop" (relaunch from the latest commit). The core keeps the
    # losses of the last loss_history_steps steps for that comparison. The default, 5 % relative, is
    # quiet on a GPU job's non-deterministic kernels (a replay ~0.1-1 % apart) and catches a resume
    # that moves the loss more (lost optimizer state, a restarted schedule); a job run with
    # deterministic algorithms sets ~1e-6 to catch the subtle ones too (RNG state, data position).
    loss_spike_factor: float = 0.0
    loss_spike_window: int = 50
    loss_spike_warmup_steps: int = 100
    on_loss_anomaly: str = "page"
    divergence_tolerance: float = 0.05
    on_divergence: str = "page"
    loss_history_steps: int = 1024

    # The agents' part (runwarden/run_policy.py): they read it from the run's policy record, so a
    # change reaches them without a restart. Flight-recorder entries per rank and the trace level
    # ("off" | "info" | "detail") apply to the next attempt's ranks, the progress write interval at
    # once; 0 / "": each agent's own config.
    agent_fr_buffer_size: int = 0
    agent_trace_level: str = ""
    agent_progress_interval_s: float = 0.0

    def __post_init__(self) -> None:
        run_policy.check_fr_buffer_size(self.agent_fr_buffer_size, "SupervisorConfig.agent_fr_buffer_size")
        run_policy.check_trace_level(self.agent_trace_level, "SupervisorConfig.agent_trace_level")
        run_policy.check_progress_interval(
            self.agent_progress_interval_s, "SupervisorConfig.agent_progress_interval_s"
        )
        ints = {
            "loss_spike_window": 1,
            "loss_spike_warmup_steps": 0,
            "loss_history_steps": 1,
            "restart_budget": 0,
            "burn_in_passes": 1,
            "burn_in_soak_neighbours": 0,
            "burn_in_soak_iterations": 1,
            "hold_after_failures": 1,
            "straggler_window": 1,
            "crash_loop_count": 2,
            "blast_radius_nodes": 1,
            "repeat_offender_count": 1,
            "mass_expiry_min_nodes": 2,
            "checkpoint_saves_to_learn": 1,
        }
        for name, low in ints.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"SupervisorConfig.{name}: must be an integer >= {low}, got {value!r}")
        for name in (
            "restart_budget_window_s",
            "backoff_base_s",
            "backoff_max_s",
            "backoff_reset_s",
            "preflight_timeout_s",
            "preflight_max_age_s",
            "spare_check_interval_s",
            "burn_in_timeout_s",
            "burn_in_soak_timeout_s",
            "bandwidth_floor_gbps",
            "bandwidth_gate_timeout_s",
            "queue_wait_s",
            "waiting_page_s",
            "hold_window_s",
            "golden_after_s",
            "hang_timeout_floor_s",
            "longest_collective_s",
            "checkpoint_barrier_s",
            "collective_hang_s",
            "eval_timeout_s",
            "snapshot_interval_s",
            "startup_timeout_s",
            "load_stall_s",
            "straggler_min_wait_s",
            "evidence_window_s",
            "blast_radius_window_s",
            "mass_expiry_window_s",
            "lost_node_hold_s",
            "control_plane_grace_s",
            "dump_timeout_s",
            "stop_grace_s",
            "exit_timeout_s",
            "stop_margin_s",
            "divergence_tolerance",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0 or value != value or value == float("inf"):
                raise ValueError(f"SupervisorConfig.{name}: must be a finite number >= 0, got {value!r}")
        if self.backoff_max_s < self.backoff_base_s:
            raise ValueError("SupervisorConfig: backoff_max_s must be >= backoff_base_s")
        if self.hang_timeout_s is not None and self.hang_timeout_s <= 0:
            raise ValueError(f"SupervisorConfig.hang_timeout_s: must be > 0, got {self.hang_timeout_s}")
        for name in (
            "straggler_persistence",
            "straggler_wait_ratio",
            "straggler_ewma_alpha",
            "mass_expiry_fraction",
            "fr_min_confidence",
            "bandwidth_gate_ratio",
        ):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"SupervisorConfig.{name}: must be in (0, 1], got {value!r}")
        if (
            not isinstance(self.blast_radius_fraction, int | float)
            or not 0 <= self.blast_radius_fraction <= 1
        ):
            raise ValueError(
                f"SupervisorConfig.blast_radius_fraction: must be in [0, 1], got {self.blast_radius_fraction!r}"
            )
        if self.straggler_compute_ratio < 1:
            raise ValueError("SupervisorConfig.straggler_compute_ratio: must be >= 1")
        if self.hang_step_multiple <= 0:
            raise ValueError("SupervisorConfig.hang_step_multiple: must be > 0")
        if not isinstance(self.collective_lateness_multiple, int | float) or not (
            1 <= self.collective_lateness_multiple < float("inf")
        ):
            raise ValueError(
                "SupervisorConfig.collective_lateness_multiple: must be a finite number >= 1, "
                f"got {self.collective_lateness_multiple!r}"
            )
        if not isinstance(
            self.checkpoint_save_multiple, int | float
        ) or not 1 <= self.checkpoint_save_multiple < float("inf"):
            raise ValueError(
                f"SupervisorConfig.checkpoint_save_multiple: must be a finite number >= 1, "
                f"got {self.checkpoint_save_multiple!r}"
            )
        if not isinstance(self.loss_spike_factor, int | float) or not (
            self.loss_spike_factor == 0 or 1 < self.loss_spike_factor < float("inf")
        ):
            raise ValueError(
                f"SupervisorConfig.loss_spike_factor: must be 0 (off) or a finite number > 1, "
                f"got {self.loss_spike_factor!r}"
            )
        for name in ("on_loss_anomaly", "on_divergence"):
            if getattr(self, name) not in ("page", "stop"):
                raise ValueError(
                    f"SupervisorConfig.{name}: must be 'page' or 'stop', got {getattr(self, name)!r}"
                )
        if self.preflight_mode not in ("quick", "full"):
            raise ValueError(
                f"SupervisorConfig.preflight_mode: must be 'quick' or 'full', got {self.preflight_mode!r}"
            )
        if self.burn_in_mode not in ("burn_in", "full", "quick"):
            raise ValueError(
                f"SupervisorConfig.burn_in_mode: must be 'burn_in', 'full' or 'quick', got {self.burn_in_mode!r}"
            )


def burn_in_passes_text(passes: int) -> str:
    """ "1 burn-in pass" / "3 burn-in passes", for the event log."""
    return f"{passes} burn-in pass" + ("" if passes == 1 else "es")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPlan:
    """What the core supervises: the run's name and how many active nodes each attempt needs."""

    run: str
    nodes: int

    def __post_init__(self) -> None:
        if not self.run or any(c.isspace() or c == "/" for c in self.run):
            raise ValueError(f"RunPlan.run: bad run name {self.run!r}")
        if self.nodes < 1:
            raise ValueError(f"RunPlan.nodes: must be >= 1, got {self.nodes}")

    @classmethod
    def from_proto(cls, spec: store_pb2.RunSpec) -> RunPlan:
        return cls(run=spec.run, nodes=spec.nodes)
