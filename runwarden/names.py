"""The one rule for run, node and election names: ``check_name``.

A name becomes one etcd key segment (``<root>/v1/nodes/<name>``), a file name under the run
directory, and text in logs and the event log. So a name is a non-empty string of at most
``MAX_NAME_LENGTH`` printable characters with no '/' and no whitespace, and is not "." or "..".
Unicode is fine ("nœud-ü"). Scheduler-specific rules (a Kubernetes object name, say) are stricter
and belong to the backend that needs them.

Names already accepted are remembered (up to ``_CACHE_LIMIT`` of them): the supervisor's events
check their node names on construction, and a fleet simulation builds millions of events.
"""

from __future__ import annotations

import re

MAX_NAME_LENGTH = 128

_CACHE_LIMIT = 1 << 17
_good_names: set[str] = set()
_FORBIDDEN = re.compile(r"[/\s]")


def check_name(what: str, value: object) -> str:
    """Return ``value`` if it is a valid name, else raise ValueError: one line naming ``what``."""
    if type(value) is str and value in _good_names:
        return value
    reason = _why_bad(value)
    if reason is not None:
        shown = repr(value) if not isinstance(value, str) or len(value) <= 40 else f"{value[:32]!r}..."
        raise ValueError(f"{what}: bad name {shown}: {reason}")
    assert isinstance(value, str)
    if type(value) is str and len(_good_names) < _CACHE_LIMIT:
        _good_names.add(value)
    return value


def _why_bad(value: object) -> str | None:
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not value:
        return "must not be empty"
    if len(value) > MAX_NAME_LENGTH:
        return f"is {len(value)} characters long; the limit is {MAX_NAME_LENGTH}"
    forbidden = _FORBIDDEN.search(value)
    if forbidden is not None or not value.isprintable():
        # '/' or whitespace, else the first control, format or other unprintable character
        char = forbidden.group() if forbidden is not None else next(c for c in value if not c.isprintable())
        return f"contains {char!r}; '/', whitespace and control characters are not allowed"
    if value in (".", ".."):
        return f"must not be {value!r}"
    return None
