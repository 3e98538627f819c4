"""RunPreflight's bridge to the preflight library: stream each result as it finishes, then a summary.

The library call runs in a thread and hands results to `on_result`; this generator yields them to
the client as they come. The summary is computed here from the streamed results, stored as the
node's last preflight (it goes into the node record) and published as evidence when it failed.

In the per-attempt modes the agent runs the units its own way (`agent_specs`): the preflight config
gets the agent's expected values where it leaves them unset (nodeagent.daemon.preflight_defaults), the
stray-GPU-process check knows the running attempt, and `processes.leftover_ranks` finds the live
processes of ended attempts, which the agent kills once the results are out and before the summary
(nodeagent.daemon.leftovers), so a client holding the summary finds them gone. The burn-in runs the same
per-attempt units before its stages (preflight.checks.burn_in.pipeline): a node leaves quarantine
only having passed what its next launch will check.

A preflight that fails closed (GPUs expected here and unreachable: preflight.gpus) publishes its
evidence as fatal, so the agent reports the host UNHEALTHY and launches nothing on it until it is
repaired and restarted; any other failed check is a warning the controller judges.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc

from nodeagent.daemon import leftovers, preflight_defaults
from nodeagent.daemon.validate import ValidationError
from preflight.checks import expectations, inventory
from preflight.checks.base import CheckSpec
from preflight.config import MODES, PreflightConfig, load_config
from preflight.runner import ALL_SPECS
from runwarden.v1 import agent_pb2, common_pb2

log = logging.getLogger(__name__)
_DONE = object()
_BUS_ID = re.compile(r"\b[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]\b")
LEFTOVER_GRACE_S = 2.0  # SIGTERM -> SIGKILL for leftovers of ended attempts: they have had their chance


def _runner() -> Callable[..., Any] | None:
    for module in ("preflight.runner", "preflight"):
        try:
            fn = getattr(importlib.import_module(module), "run_preflight", None)
        except ImportError:
            continue
        if callable(fn):
            return fn
    return None


def _config(agent: Any) -> tuple[PreflightConfig, dict[str, str]]:
    """The preflight config with the agent's own expected values where it leaves them unset."""
    return preflight_defaults.fill(load_config(agent.config.preflight_config or None), agent.config)


def agent_specs(view: leftovers.AgentProcesses, sources: Mapping[str, str]) -> list[CheckSpec]:
    """The per-attempt units as the agent runs them: inventory judging GPU memory by `view` (the
    running attempt's, never a leftover's), the expected values with their sources, and the
    leftover check."""
    bound = {
        inventory.SPEC.name: inventory.spec_for(view),
        expectations.SPEC.name: expectations.spec_with(sources),
    }
    return [bound.get(s.name, s) for s in ALL_SPECS] + [leftovers.spec(view, LEFTOVER_GRACE_S)]


def summarize(
    mode: str, results: list[common_pb2.CheckResult], duration_s: float
) -> common_pb2.PreflightSummary:
    count = {s: sum(1 for r in results if r.status == s) for s in (1, 2, 3, 4, 5)}
    return common_pb2.PreflightSummary(
        mode=mode,
        passed=count[3] == 0 and count[5] == 0,  # a check that could not tell is no pass
        pass_count=count[1],
        warn_count=count[2],
        fail_count=count[3],
        skip_count=count[4],
        finished_at=time.time(),
        duration_s=duration_s,
        failed_checks=[r.name for r in results if r.status == common_pb2.CHECK_STATUS_FAIL],
        inconclusive_count=count[5],
        inconclusive_checks=[r.name for r in results if r.status == common_pb2.CHECK_STATUS_INCONCLUSIVE],
    )


def _as_proto(result: Any) -> common_pb2.CheckResult:
    return result if isinstance(result, common_pb2.CheckResult) else result.to_proto()


# A preflight another caller started (a spare's check, when the run's relaunch wants that spare) ends in
# seconds: the second waits for it rather than being refused (a refused node is left out of the
# attempt), up to half of its own deadline; a burn-in's hours are still refused.
BUSY_WAIT_MAX_S = 60.0


def _busy_wait_s(context: grpc.ServicerContext) -> float:
    left = context.time_remaining()
    return BUSY_WAIT_MAX_S if left is None else max(0.0, min(BUSY_WAIT_MAX_S, left / 2))


def stream(
    agent: Any, request: agent_pb2.RunPreflightRequest, context: grpc.ServicerContext
) -> Iterator[Any]:
    run = _runner()
    if run is None:
        context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "the preflight library (preflight.run_preflight) is not installed"
        )
    waited = _busy_wait_s(context)
    if not agent.preflight_running.acquire(timeout=waited):
        context.abort(
            grpc.StatusCode.ABORTED, f"a preflight is already running on this node (waited {waited:.0f} s)"
        )
    try:
        agent.state_changed()
        yield from _run(agent, run, request)
    finally:
        agent.preflight_running.release()
        agent.state_changed()


def _run(agent: Any, run: Callable[..., Any], request: agent_pb2.RunPreflightRequest) -> Iterator[Any]:
    results: queue.Queue[Any] = queue.Queue()
    kwargs: dict[str, Any] = {"on_result": results.put}
    params = inspect.signature(run).parameters
    if request.only and "only" in params:
        kwargs["only"] = list(request.only)
    if request.budget_s and "budget_s" in params:
        kwargs["budget_s"] = request.budget_s
    view = leftovers.AgentProcesses(
        node=agent.config.node, socket=agent.config.unix_socket, workers=agent.launcher.workers
    )
    failure: list[BaseException] = []

    def work() -> None:
        try:
            config, sources = _config(agent)
            if request.mode in MODES and "specs" in params:  # the per-attempt modes
                kwargs["specs"] = agent_specs(view, sources)
            elif "quick_specs" in params:  # the burn-in: its stages and the agent's per-attempt units
                kwargs["quick_specs"] = agent_specs(view, sources)
            run(config, request.mode, **kwargs)
        except BaseException as exc:
            failure.append(exc)
        finally:
            results.put(_DONE)

    start = time.monotonic()
    view.clean_first(LEFTOVER_GRACE_S)  # runwarden's own debris first: the checks judge the node
    threading.Thread(target=work, name="preflight", daemon=True).start()
    seen: list[common_pb2.CheckResult] = []
    closed: list[Any] = []  # the results that failed closed: the GPUs cannot be reached
    while (item := results.get()) is not _DONE:
        proto = _as_proto(item)
        seen.append(proto)
        if getattr(item, "fail_closed", False):
            closed.append(item)
        yield agent_pb2.RunPreflightResponse(result=proto)
    if failure:
        if isinstance(failure[0], ValueError):  # a bad mode or check name, said by the library
            raise ValidationError(str(failure[0]))
        raise RuntimeError(f"preflight failed to run: {failure[0]}")
    if agent.unhealthy:
        # The checks may pass on the repaired host, but this agent still holds its fatal evidence and
        # launches nothing: a pass here would put a node into the pool that refuses every launch.
        latched = common_pb2.CheckResult(
            name="agent.fatal_evidence",
            status=common_pb2.CHECK_STATUS_FAIL,
            message=f"this agent holds fatal evidence ({agent.unhealthy_because}) and launches nothing",
            remedy="restart the node agent once the host is repaired (a repair is a reboot or an agent restart)",
        )
        seen.append(latched)
        yield agent_pb2.RunPreflightResponse(result=latched)
    cleaned = view.clean(LEFTOVER_GRACE_S)  # before the summary: a client that has it finds them gone
    summary = summarize(request.mode, seen, time.monotonic() - start)
    if closed:  # fatal evidence: the agent's listener marks the host unhealthy before the summary is out
        agent.evidence.publish(fail_closed_evidence(request.mode, closed))
    agent.last_preflight = summary
    agent.state_changed()  # the node record carries the new summary on the ticker's next pass
    if summary.fail_count and not closed:  # evidence; an inconclusive check is none about the node
        agent.evidence.publish(
            common_pb2.Evidence(
                kind=common_pb2.EVIDENCE_KIND_PREFLIGHT_FAIL,
                severity=common_pb2.SEVERITY_WARNING,
                detail="; ".join(
                    [f"preflight {request.mode} failed: {', '.join(summary.failed_checks)}"]
                    + [f"leftover {line}" for line in cleaned]
                )[:500],
                source="preflight",
            )
        )
    yield agent_pb2.RunPreflightResponse(summary=summary)


def fail_closed_evidence(mode: str, closed: list[Any]) -> common_pb2.Evidence:
    """One fatal record for the results that failed closed, naming each (and the first missing bus id)."""
    bus = next((w for r in closed for w in _bus_ids(r.message)), "")
    return common_pb2.Evidence(
        kind=common_pb2.EVIDENCE_KIND_PREFLIGHT_FAIL,
        severity=common_pb2.SEVERITY_FATAL,
        pci_bus_id=bus,
        detail=f"preflight {mode} failed closed: "
        + "; ".join(f"{r.name}: {r.message}" for r in closed)[:450],
        source="preflight",
    )


def _bus_ids(message: str) -> list[str]:
    """The PCI bus ids a message names (the inventory names a GPU missing from NVML by its id)."""
    return _BUS_ID.findall(message)
