"""Runs real gloo jobs that hang, and collects their flight-recorder dumps the agent's way.

A scenario starts `world` rank processes (fr_worker.py), waits until the culprit reached its hang point
and every other rank's collective timed out, collects the JSON dumps over the worker-server sockets
with `collect_dumps` (the agent's code), asks each rank for an in-process pickle dump (the format
torch's analyzer reads), then SIGKILLs the job. A `sigstop` scenario SIGSTOPs the culprit at its hang
point: it can give no dump by any route.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from nodeagent.daemon.flight_recorder import CollectedDump, collect_dumps, discover_sockets
from runwarden.flightrec import TORCH_DEFAULT_PREFIX

WORKER = Path(__file__).with_name("fr_worker.py")
PICKLE_PREFIX = "nccl_trace_rank_"


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    name: str
    world: int
    culprit: int
    hang_group: str = "default"
    groups: dict[str, list[int]] = field(default_factory=dict)
    steps: int = 3
    hang_step: int = 2
    buffer_size: int = 2000
    sigstop: bool = False
    spin: bool = False  # the culprit busy-loops in Python instead of sleeping
    op_timeout_s: float = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ScenarioRun:
    scenario: Scenario
    work: Path
    json_dir: Path  # collected JSON dumps, named <TORCH_DEFAULT_PREFIX><rank>
    pickle_dir: Path  # in-process pickle dumps, named <PICKLE_PREFIX><rank>
    collected: list[CollectedDump]
    timeouts: dict[int, str]  # rank -> its collective's error (the ranks that reported a timeout)
    seconds: float
    collect_s: float  # how long collect_dumps took for the whole job


class SpuriousTimeout(RuntimeError):
    """A rank timed out before the culprit reached its hang point: the machine was too loaded."""


def _wait_for(
    paths: Iterable[Path],
    procs: list[subprocess.Popen[bytes]],
    deadline: float,
    what: str,
    too_early: Path | None = None,
) -> None:
    pending = list(paths)
    while pending:
        pending = [p for p in pending if not p.exists()]
        if too_early is not None and pending and any(too_early.glob("timeout*")):
            raise SpuriousTimeout(f"{what}: a rank timed out first")
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: rank pid {p.pid} exited with {p.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: still waiting for {[p.name for p in pending]}")
        time.sleep(0.05)


def _stderr_tail(work: Path, world: int) -> str:
    return "\n".join(
        f"--- rank {r}:\n" + (work / f"stderr{r}").read_text(errors="replace")[-1500:] for r in range(world)
    )


def run_scenario(scenario: Scenario, base: Path, *, budget_s: float = 180.0) -> ScenarioRun:
    started = time.monotonic()
    work = base / scenario.name
    for sub in ("sockets", "pickle", "json"):
        (work / sub).mkdir(parents=True)
    spec = work / "spec.json"
    spec.write_text(json.dumps({**_as_dict(scenario), "work": str(work)}))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for rank in range(scenario.world):
            with open(work / f"stderr{rank}", "wb") as err:
                cmd = [sys.executable, str(WORKER), str(spec), str(rank)]
                procs.append(subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + budget_s
        victims = [r for r in range(scenario.world) if r != scenario.culprit]
        _wait_for([work / f"hung{scenario.culprit}"], procs, deadline, "culprit's hang point", too_early=work)
        if scenario.sigstop:
            os.kill(procs[scenario.culprit].pid, signal.SIGSTOP)
        _wait_for([work / f"timeout{r}" for r in victims], procs, deadline, "victims' timeouts")
        collect_started = time.monotonic()
        collected = collect_dumps(discover_sockets(work / "sockets"), timeout_s=2.0)
        collect_s = time.monotonic() - collect_started
        (work / "dump_now").write_text("")
        answering = victims if scenario.sigstop else range(scenario.world)
        _wait_for([work / f"pickled{r}" for r in answering], procs, deadline, "pickle dumps")
    except SpuriousTimeout:
        raise
    except (RuntimeError, TimeoutError) as exc:
        raise RuntimeError(f"scenario {scenario.name}: {exc}\n{_stderr_tail(work, scenario.world)}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL works on a stopped process too
            p.wait()
    for dump in collected:
        if dump.ok:
            (work / "json" / f"{TORCH_DEFAULT_PREFIX}{dump.rank}").write_bytes(dump.data)
    timeouts = {r: (work / f"timeout{r}").read_text() for r in victims}
    return ScenarioRun(
        scenario=scenario,
        work=work,
        json_dir=work / "json",
        pickle_dir=work / "pickle",
        collected=collected,
        timeouts=timeouts,
        seconds=time.monotonic() - started,
        collect_s=collect_s,
    )


def run_with_retry(scenario: Scenario, base: Path, *, tries: int = 3) -> ScenarioRun:
    for attempt in range(tries):
        try:
            return run_scenario(scenario, base / f"try{attempt}")
        except SpuriousTimeout:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def run_scenarios(scenarios: list[Scenario], base: Path, *, parallel: int = 2) -> dict[str, ScenarioRun]:
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        runs = list(pool.map(lambda s: run_with_retry(s, base), scenarios))
    return {run.scenario.name: run for run in runs}


def _as_dict(s: Scenario) -> dict[str, object]:
    return {name: getattr(s, name) for name in Scenario.__dataclass_fields__}
