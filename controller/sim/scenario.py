"""The scenario file: a fleet, its failure processes, its restart costs and the policies to compare.
`load_scenario` reads one TOML file into frozen dataclasses (`Scenario`); unknown keys are errors,
durations are seconds unless the key says otherwise. Every key is documented in the README's "The
fleet simulator"; the sections are `[run]`, `[costs]`, `[detection]`, `[[cause]]`, `[planned]`,
`[fixed_step]` and one `[policy.NAME]` (with `[policy.NAME.supervisor]`, the real
`SupervisorConfig`) per policy. Called by `controllerctl simulate` and the simulator's tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from controller.supervisor.policy import SupervisorConfig
from runwarden.config import ConfigError, load_section, read_toml

DAY_S = 86400.0
HOUR_S = 3600.0
SYMPTOMS = ("crash", "hang", "node_lost", "straggler", "control_plane")
EVIDENCE = ("", "xid", "ecc", "row_remap", "gpu_lost", "network")


def _nonneg(where: str, **values: float) -> None:
    for name, v in values.items():
        if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
            raise ConfigError(f"{where}.{name}: must be a finite number >= 0, got {v!r}")


def _positive(where: str, **values: float) -> None:
    for name, v in values.items():
        if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
            raise ConfigError(f"{where}.{name}: must be a finite number > 0, got {v!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSection:
    """[run]: the job being supervised."""

    name: str = "sim"
    nodes: int = 0
    gpus_per_node: int = 8
    duration_days: float = 0.0
    step_time_s: float = 6.0
    start_ts: float = 1_767_225_600.0  # 2026-01-01T00:00:00Z: event timestamps start here

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() or c == "/" for c in self.name):
            raise ConfigError(f"run.name: bad run name {self.name!r}")
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(
                f"run: nodes and gpus_per_node must be >= 1, got {self.nodes}, {self.gpus_per_node}"
            )
        _positive("run", duration_days=self.duration_days, step_time_s=self.step_time_s)
        _nonneg("run", start_ts=self.start_ts)

    @property
    def duration_s(self) -> float:
        return self.duration_days * DAY_S


@dataclass(frozen=True, slots=True, kw_only=True)
class Costs:
    """[costs]: every restart cost, seconds. A policy may override any of them."""

    allocate_spare_s: float = 30.0  # a warm spare handed to the run
    allocate_queue_s: float = 1800.0  # a replacement from the scheduler queue (no spare left)
    preflight_s: float = 90.0  # quick preflight of the attempt's nodes (in parallel)
    stop_s: float = 30.0  # stopping the surviving workers (SIGTERM, grace, SIGKILL)
    launch_s: float = 90.0  # process start + rendezvous of every rank
    load_s: float = 120.0  # checkpoint load from storage
    first_step_s: float = 60.0  # warm-up/compile until the first step past the resume point
    repair_hours: float = 72.0  # a broken node's repair (a cause may override)
    burn_in_s: float = 3600.0  # full preflight runs after repair before a node is a spare again

    def __post_init__(self) -> None:
        _nonneg("costs", **{f.name: getattr(self, f.name) for f in fields(self)})


@dataclass(frozen=True, slots=True, kw_only=True)
class Detection:
    """[detection]: latency from a fault to the signal reaching the supervisor, seconds."""

    crash_s: float = 5.0  # process exit -> agent -> etcd -> controller
    evidence_s: float = 10.0  # fault -> kernel log / NVML -> agent publishes evidence
    lease_check_s: float = 0.5  # etcd checks lease expiry this often (uniform 0..this added)
    dumps_s: float = 15.0  # flight-recorder dump collection + analysis
    flight_recorder_accuracy: float = 0.95  # a hang's dumps name the culprit node this often
    refail_s: float = 120.0  # a broken node put back into a run fails within this after first step

    def __post_init__(self) -> None:
        _nonneg(
            "detection",
            crash_s=self.crash_s,
            evidence_s=self.evidence_s,
            lease_check_s=self.lease_check_s,
            dumps_s=self.dumps_s,
            refail_s=self.refail_s,
        )
        if not 0 <= self.flight_recorder_accuracy <= 1:
            raise ConfigError("detection.flight_recorder_accuracy: must be in [0, 1]")


@dataclass(frozen=True, slots=True, kw_only=True)
class Cause:
    """[[cause]]: one root cause's failure process.

    Rate: `count` interruptions observed over `over_days` on `over_nodes` nodes (defaults: the
    run's duration and node count), or `node_mtbf_hours` per node. Either way the fleet rate
    scales with the run's node count.
    """

    name: str
    count: float | None = None
    over_days: float | None = None
    over_nodes: int | None = None
    node_mtbf_hours: float | None = None
    # crash: a process exits | hang: ranks stop | node_lost: the host dies | straggler: the node is slow
    # (the job runs on; the core may flag it) | control_plane: the controller loses etcd for seconds
    symptom: str = "crash"
    evidence: str = ""  # what the node's agent publishes ("" none): xid, ecc, row_remap, gpu_lost, network
    hardware: bool = True  # the node stays broken until repaired (else: relaunch in place is fine)
    preflight_catch: float = 0.9  # a broken node fails quick preflight this often
    repair_hours: float | None = None
    # A software or data bug at a fixed step (a bad shard at step S): it recurs at the step where it
    # first hit on every attempt that reaches it, each time on another node (the rank that reads the
    # shard changes with the attempt: a loader deadlock is a hang the flight recorder blames on the
    # rank that never arrived; a raising rank is a crash), until the job is fixed `fix_hours` after
    # its first hit. Needs hardware = false and symptom crash or hang.
    fixed_step: bool = False
    fix_hours: float = 2.0

    def __post_init__(self) -> None:
        where = f"cause {self.name!r}"
        if not self.name or any(c.isspace() for c in self.name):
            raise ConfigError(f"cause.name: bad name {self.name!r}")
        if (self.count is None) == (self.node_mtbf_hours is None):
            raise ConfigError(f"{where}: give exactly one of count (with over_days) or node_mtbf_hours")
        if self.count is not None:
            _nonneg(where, count=self.count)
        if self.node_mtbf_hours is not None:
            _positive(where, node_mtbf_hours=self.node_mtbf_hours)
        if self.over_days is not None:
            _positive(where, over_days=self.over_days)
        if self.over_nodes is not None and self.over_nodes < 1:
            raise ConfigError(f"{where}.over_nodes: must be >= 1")
        if self.symptom not in SYMPTOMS:
            raise ConfigError(f"{where}.symptom: must be one of {', '.join(SYMPTOMS)}, got {self.symptom!r}")
        if self.evidence not in EVIDENCE:
            raise ConfigError(f"{where}.evidence: must be one of {', '.join(repr(e) for e in EVIDENCE)}")
        if not 0 <= self.preflight_catch <= 1:
            raise ConfigError(f"{where}.preflight_catch: must be in [0, 1]")
        if self.repair_hours is not None:
            _nonneg(where, repair_hours=self.repair_hours)
        _nonneg(where, fix_hours=self.fix_hours)
        if self.fixed_step and (self.hardware or self.symptom not in ("crash", "hang")):
            raise ConfigError(f"{where}: fixed_step needs hardware = false and symptom crash or hang")

    def rate_per_node_s(self, run: RunSection) -> float:
        """Failures per node-second."""
        if self.node_mtbf_hours is not None:
            return 1.0 / (self.node_mtbf_hours * HOUR_S)
        assert self.count is not None
        days = self.over_days if self.over_days is not None else run.duration_days
        nodes = self.over_nodes if self.over_nodes is not None else run.nodes
        return self.count / (days * DAY_S * nodes)

    def fleet_rate_s(self, run: RunSection) -> float:
        """Failures per second of wall time across the run's nodes."""
        return self.rate_per_node_s(run) * run.nodes


@dataclass(frozen=True, slots=True, kw_only=True)
class Planned:
    """[planned]: planned stops (save, exit 0, relaunch without quarantine)."""

    count: float = 0.0
    over_days: float | None = None

    def __post_init__(self) -> None:
        _nonneg("planned", count=self.count)
        if self.over_days is not None:
            _positive("planned", over_days=self.over_days)

    def rate_s(self, run: RunSection) -> float:
        days = self.over_days if self.over_days is not None else run.duration_days
        return self.count / (days * DAY_S)


@dataclass(frozen=True, slots=True, kw_only=True)
class FixedStep:
    """[fixed_step]: a share of the failures made software/data bugs at a fixed step.

    `share` of the scenario's unplanned failure rate moves from its causes (each scaled by
    1 - share) to fixed-step causes named `fixed_step_<symptom>`, split by the `hang` and `crash`
    weights; each is fixed `fix_hours` after its first hit."""

    share: float = 0.0
    hang: float = 1.0
    crash: float = 1.0
    fix_hours: float = 2.0

    def __post_init__(self) -> None:
        _nonneg("fixed_step", hang=self.hang, crash=self.crash, fix_hours=self.fix_hours)
        if not 0 <= self.share < 1:
            raise ConfigError(f"fixed_step.share: must be in [0, 1), got {self.share!r}")
        if self.share > 0 and self.hang + self.crash <= 0:
            raise ConfigError("fixed_step: hang + crash weights must be > 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """[policy.NAME]: how the fleet is run. `supervisor` is the core's own config."""

    name: str
    description: str = ""
    spares: int | None = None  # warm spare nodes; default from spare_fraction
    spare_fraction: float = 0.0  # spares = ceil(fraction x run nodes) when `spares` is not given
    lease_ttl_s: float = 5.0  # node loss reaches the supervisor TTL (+ expiry check) after the death
    use_evidence: bool = True  # agents publish Xid/ECC/NIC evidence and the supervisor acts on it
    preflight: bool = True  # preflight before every attempt (catches broken nodes, costs preflight_s)
    flight_recorder: bool = True  # hang dumps name the culprit (else: no suspect for a hang)
    checkpoint_interval_s: float = 600.0  # training time between checkpoint saves
    checkpoint_stall_s: float = 10.0  # training blocked per save (synchronous: the whole save)
    costs: dict[str, float] = field(default_factory=dict)  # overrides of [costs]
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)

    def __post_init__(self) -> None:
        where = f"policy.{self.name}"
        if self.spares is not None and self.spares < 0:
            raise ConfigError(f"{where}.spares: must be >= 0")
        if not 0 <= self.spare_fraction <= 1:
            raise ConfigError(f"{where}.spare_fraction: must be in [0, 1]")
        _positive(where, lease_ttl_s=self.lease_ttl_s, checkpoint_interval_s=self.checkpoint_interval_s)
        _nonneg(where, checkpoint_stall_s=self.checkpoint_stall_s)
        known = {f.name for f in fields(Costs)}
        bad = sorted(set(self.costs) - known)
        if bad:
            raise ConfigError(
                f"{where}.costs: unknown key(s) {', '.join(bad)}; known: {', '.join(sorted(known))}"
            )

    def spare_count(self, run: RunSection) -> int:
        if self.spares is not None:
            return self.spares
        return math.ceil(self.spare_fraction * run.nodes)

    def effective_costs(self, base: Costs) -> Costs:
        return replace(base, **self.costs) if self.costs else base


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    run: RunSection
    costs: Costs
    detection: Detection
    causes: tuple[Cause, ...]
    planned: Planned
    policies: dict[str, Policy]
    source: str = ""

    def policy(self, name: str) -> Policy:
        try:
            return self.policies[name]
        except KeyError:
            raise ConfigError(
                f"{self.source or 'scenario'}: no policy {name!r}; have: {', '.join(self.policies)}"
            ) from None

    def interruption_rate_s(self) -> float:
        """Unplanned interruptions per second of wall time (all causes)."""
        return sum(c.fleet_rate_s(self.run) for c in self.causes)

    def mtbf_s(self) -> float:
        rate = self.interruption_rate_s()
        return 1.0 / rate if rate > 0 else math.inf


def with_fixed_step_share(scenario: Scenario, fs: FixedStep) -> Scenario:
    """`scenario` with `fs.share` of its unplanned failure rate made fixed-step software bugs.

    The total rate is unchanged: every cause keeps 1 - share of its rate (a count scaled down, or a
    node MTBF scaled up) and the share goes to one fixed-step cause per symptom with a weight."""
    if fs.share <= 0:
        return scenario
    total = scenario.interruption_rate_s()
    keep = 1.0 - fs.share
    scaled = []
    for c in scenario.causes:
        if c.count is not None:
            scaled.append(replace(c, count=c.count * keep))
        else:
            assert c.node_mtbf_hours is not None
            scaled.append(replace(c, node_mtbf_hours=c.node_mtbf_hours / keep))
    weights = {"hang": fs.hang, "crash": fs.crash}
    wsum = sum(weights.values())
    names = {c.name for c in scenario.causes}
    for symptom, w in weights.items():
        if w <= 0:
            continue
        name = f"fixed_step_{symptom}"
        if name in names:
            raise ConfigError(f"{scenario.source}: cause {name!r} exists; [fixed_step] would add it again")
        rate_s = total * fs.share * w / wsum  # fleet failures per second
        scaled.append(
            Cause(
                name=name,
                count=rate_s * scenario.run.duration_s,
                symptom=symptom,
                hardware=False,
                fixed_step=True,
                fix_hours=fs.fix_hours,
            )
        )
    return replace(scenario, causes=tuple(scaled))


_TOP_KEYS = {"run", "costs", "detection", "cause", "planned", "policy", "fixed_step"}


def _policy(name: str, table: Any, where: str) -> Policy:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table")
    table = dict(table)
    sup = table.pop("supervisor", {})
    supervisor = load_section(SupervisorConfig, sup, f"{where}.supervisor")
    costs = table.pop("costs", {})
    if not isinstance(costs, dict):
        raise ConfigError(f"{where}.costs: expected a table")
    costs = {str(k): float(v) for k, v in costs.items()}
    pol = load_section(Policy, {**table, "name": name}, where)
    return replace(pol, supervisor=supervisor, costs=costs)


def scenario_from_mapping(data: dict[str, Any], source: str = "scenario") -> Scenario:
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ConfigError(
            f"{source}: unknown section(s) {', '.join(unknown)}; known: {', '.join(sorted(_TOP_KEYS))}"
        )
    if "run" not in data:
        raise ConfigError(f"{source}: missing [run]")
    run = load_section(RunSection, data["run"], f"{source} [run]")
    costs = load_section(Costs, data.get("costs", {}), f"{source} [costs]")
    detection = load_section(Detection, data.get("detection", {}), f"{source} [detection]")
    raw_causes = data.get("cause", [])
    if not isinstance(raw_causes, list) or not raw_causes:
        raise ConfigError(f"{source}: at least one [[cause]] is required")
    causes = tuple(load_section(Cause, c, f"{source} [[cause]] #{i + 1}") for i, c in enumerate(raw_causes))
    names = [c.name for c in causes]
    if len(set(names)) != len(names):
        raise ConfigError(f"{source}: cause names must be unique, got {names}")
    planned = load_section(Planned, data.get("planned", {}), f"{source} [planned]")
    raw_policies = data.get("policy", {})
    if not isinstance(raw_policies, dict) or not raw_policies:
        raise ConfigError(f"{source}: at least one [policy.NAME] is required")
    policies = {str(n): _policy(str(n), t, f"{source} [policy.{n}]") for n, t in raw_policies.items()}
    scenario = Scenario(
        run=run,
        costs=costs,
        detection=detection,
        causes=causes,
        planned=planned,
        policies=policies,
        source=source,
    )
    fixed = load_section(FixedStep, data.get("fixed_step", {}), f"{source} [fixed_step]")
    return with_fixed_step_share(scenario, fixed)


def load_scenario(path: str | Path) -> Scenario:
    return scenario_from_mapping(read_toml(path), source=str(path))
