"""The node agents' part of a run's policy, read from the run's policy record in etcd.

`<root>/v1/runs/<run>/policy` (`PolicyRecord`) holds every supervisor policy value of a run and is
changed live (`controllerctl config set|apply`, SIGHUP). Three of its values are the agents', so an
operator can turn tracing up on a running job without a release or a restart:

    agent_fr_buffer_size        flight-recorder entries per rank (TORCH_FR_BUFFER_SIZE) for the next
                                attempt's ranks; 0: the agent's own `fr_buffer_size`
    agent_trace_level           "off" | "info" | "detail" (TORCH_DISTRIBUTED_DEBUG, and C++ stacks in
                                the flight recorder at "detail") for the next attempt; "": unchanged
    agent_progress_interval_s   the agent's etcd progress write interval, at once; 0: its own

The controller validates them as part of its `SupervisorConfig` with the checks below; an agent
checks them again when it reads the record (it is outside input to the agent), keeps the last good
values when a record is bad, and never stops serving over one. This module is shared by both sides
(imports flow toward runwarden/), so the rules live once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from runwarden.v1 import common_pb2, store_pb2

FR_BUFFER_SIZE = "agent_fr_buffer_size"
TRACE_LEVEL = "agent_trace_level"
PROGRESS_INTERVAL = "agent_progress_interval_s"
MAX_FR_BUFFER_SIZE = 1_000_000  # entries per rank; each is a few hundred bytes of host memory
PROGRESS_INTERVAL_RANGE_S = (0.05, 60.0)
# What each trace level sets in a rank's environment (read by torch at process-group creation).
TRACE_ENV: dict[str, dict[str, str]] = {
    "off": {"TORCH_DISTRIBUTED_DEBUG": "OFF", "TORCH_NCCL_TRACE_CPP_STACK": "0"},
    "info": {"TORCH_DISTRIBUTED_DEBUG": "INFO", "TORCH_NCCL_TRACE_CPP_STACK": "0"},
    "detail": {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCH_NCCL_TRACE_CPP_STACK": "1"},
}


def check_fr_buffer_size(value: Any, where: str = FR_BUFFER_SIZE) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_FR_BUFFER_SIZE:
        raise ValueError(
            f"{where}: must be an integer 0..{MAX_FR_BUFFER_SIZE} (0: the agent's own), got {value!r}"
        )
    return value


def check_trace_level(value: Any, where: str = TRACE_LEVEL) -> str:
    if not isinstance(value, str) or (value and value not in TRACE_ENV):
        raise ValueError(f"{where}: must be one of {sorted(TRACE_ENV)} or '' (unchanged), got {value!r}")
    return value


def check_progress_interval(value: Any, where: str = PROGRESS_INTERVAL) -> float:
    low, high = PROGRESS_INTERVAL_RANGE_S
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}: must be a number of seconds, got {value!r}")
    if value != 0 and not low <= value <= high:
        raise ValueError(f"{where}: must be 0 (the agent's own) or within {low:g}..{high:g} s, got {value!r}")
    return float(value)


def from_value(value: common_pb2.PolicyValue) -> Any:
    """The Python value of a `PolicyValue` (None for unset; ValueError when none is set)."""
    which = value.WhichOneof("value")
    if which is None:
        raise ValueError("a policy value with nothing set")
    if which == "unset":
        return None
    return getattr(value, which)


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentPolicy:
    """The agents' values of one run's policy; the zero values mean "the agent's own config"."""

    fr_buffer_size: int = 0
    trace_level: str = ""
    progress_interval_s: float = 0.0

    @classmethod
    def from_record(cls, record: store_pb2.PolicyRecord) -> AgentPolicy:
        """The agents' part of a policy record; a value the record lacks (an older controller) is the
        agent's own. ValueError, naming the key, for a value of the wrong type or range."""
        values = record.values

        def get(key: str, default: Any) -> Any:
            if key not in values:
                return default
            got = from_value(values[key])
            return default if got is None else got

        return cls(
            fr_buffer_size=check_fr_buffer_size(get(FR_BUFFER_SIZE, 0)),
            trace_level=check_trace_level(get(TRACE_LEVEL, "")),
            progress_interval_s=check_progress_interval(get(PROGRESS_INTERVAL, 0.0)),
        )

    @classmethod
    def parse(cls, data: bytes) -> AgentPolicy:
        """From the stored bytes of `<root>/v1/runs/<run>/policy`."""
        record = store_pb2.PolicyRecord()
        try:
            record.ParseFromString(data)
        except Exception as exc:  # protobuf's DecodeError, or anything a corrupt message raises
            raise ValueError(f"not a PolicyRecord: {exc}") from exc
        return cls.from_record(record)

    def trace_env(self) -> dict[str, str]:
        return dict(TRACE_ENV.get(self.trace_level, {}))

    def describe(self) -> str:
        return (
            f"fr_buffer_size {self.fr_buffer_size or 'own'}, trace level {self.trace_level or 'unchanged'}, "
            f"progress interval {f'{self.progress_interval_s:g} s' if self.progress_interval_s else 'own'}"
        )
