"""The torch the ranks run with: its version, the supported range, and every private torch call the
rank side makes, each behind a version check.

runwarden's trainer side runs inside the user's training process with the user's torch. The range in
`SUPPORTED` is the one pyproject's `torch` extra declares and `scripts/test_compat.sh` tests at both
ends. Inside it a private call is made as that release names it; outside it, or where the name has
gone, the call takes its fallback when one exists and otherwise raises `TorchApiError`, which names
the torch version and the supported range.
"""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import MutableMapping, Sequence
from typing import Any

# The oldest and newest minor releases tested (scripts/test_compat.sh); pyproject: >=2.9.1,<2.15.
SUPPORTED = ((2, 9), (2, 14))


class TorchApiError(RuntimeError):
    """A torch call runwarden needs does not exist in the torch this process runs."""


def parse_version(text: str) -> tuple[int, int]:
    """``"2.9.1+cu128"`` -> ``(2, 9)``; a version torch would never print -> TorchApiError."""
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        raise TorchApiError(f"cannot read torch's version {text!r}")
    return int(match.group(1)), int(match.group(2))


def torch_version() -> str:
    import torch

    return str(torch.__version__)


def supported(version: tuple[int, int]) -> bool:
    return SUPPORTED[0] <= version <= SUPPORTED[1]


def _range() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED
    return f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}"


def missing(what: str) -> TorchApiError:
    """The error for a call this torch does not have: names the version and the supported range."""
    version = torch_version()
    return TorchApiError(
        f"torch {version} has no {what}; runwarden's trainer side supports torch {_range()}"
        + ("" if supported(parse_version(version)) else f" ({version} is outside it)")
    )


def c10d_private(name: str) -> Any:
    """``torch._C._distributed_c10d.<name>`` (the flight recorder's dumps and its worker server):
    private, present in every supported release; absent -> TorchApiError."""
    import torch._C._distributed_c10d as c10d

    found = getattr(c10d, name, None)
    if found is None:
        raise missing(f"torch._C._distributed_c10d.{name}")
    return found


def has_worker_handler(name: str) -> bool:
    """Whether torch's C++ worker server answers ``POST /handler/<name>`` (2.13: ``fr_trace_json``;
    2.9 has only ``dump_nccl_trace_json``, NCCL's ring alone)."""
    names = c10d_private("_get_handler_names")
    return name in names()


def abort_default_group() -> None:
    """Abort the default process group's communicators now, without waiting for the peers.

    ``ProcessGroup.abort()`` (public on the group object from torch 2.6) where the group has it;
    otherwise ``destroy_process_group()``, which also tears the group down but may wait on a
    communicator a dead peer holds."""
    import torch.distributed as dist

    group = dist.group.WORLD
    abort = getattr(group, "abort", None)
    if callable(abort):
        abort()
    else:
        dist.destroy_process_group()


def default_group_sequence() -> int | None:
    """How many collectives this process has entered on the default process group: the group's
    sequence number (``ProcessGroup._get_sequence_number_for_group``, private; every op on the group
    counts, a barrier too; 0 for a fresh group), ~0.3 us. None without an initialized default group,
    and for any error: the progress reporter polls it from a background thread, so it never raises.

    torch is not imported here: a process that has not imported torch.distributed has no group, and
    an import of torch from a background thread would take seconds of the training thread's GIL."""
    dist: Any = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:  # a torch without the call, a group torn down meanwhile, a half-imported module
        return None


def set_nested(root: Any, path: Sequence[str | int], value: Any) -> None:
    """Set ``value`` at ``path`` in a state dict of dicts and lists, making what is missing on the
    way: a dict where the next key is a str, a list (padded with None) where it is an int index; in
    a dict an int is a key (an optimizer's state is keyed by parameter index). What DCP's private
    ``_nested_dict.set_element`` does for a flattened state dict's mappings, written here so that a
    load does not depend on it."""
    if not path:
        raise ValueError("an empty path names no element")
    node = root
    for key, following in itertools.pairwise(path):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(node, MutableMapping):
            node = node.setdefault(key, empty)
            continue
        if not isinstance(node, list) or not isinstance(key, int):
            raise TypeError(f"key {key!r} into a {type(node).__name__}")
        node.extend([None] * (key + 1 - len(node)))
        if node[key] is None:
            node[key] = empty
        node = node[key]
    last = path[-1]
    if isinstance(node, list):
        if not isinstance(last, int):
            raise TypeError(f"key {last!r} into a list")
        node.extend([None] * (last + 1 - len(node)))
    elif not isinstance(node, MutableMapping):
        raise TypeError(f"key {last!r} into a {type(node).__name__}")
    node[last] = value
