"""Hand-made flight-recorder dumps, through the real parser (for tests/flightrec and tests/supervisor)."""

from __future__ import annotations

from collections.abc import Sequence

from runwarden.flightrec import FrDump, dump_from_object

Op = tuple[str, int] | tuple[str, int, dict[str, object]]  # (group name, collective_seq_id[, overrides])


def make_dump(
    rank: int, ops: Sequence[Op], groups: dict[str, tuple[str, list[int]]], *, first_record: int = 0
) -> FrDump:
    """A dump as torch writes it (JSON shape), through the real parser."""
    entries = []
    for i, op in enumerate(ops):
        name, seq = op[0], op[1]
        extra = op[2] if len(op) == 3 else {}
        entries.append(
            {
                "record_id": first_record + i,
                "pg_id": 0,
                "process_group": [name, groups[name][0]],
                "collective_seq_id": seq,
                "p2p_seq_id": 0,
                "op_id": first_record + i,
                "is_p2p": False,
                "profiling_name": "gloo:all_reduce",
                "input_sizes": [[8]],
                "input_dtypes": ["Float"],
                "state": "scheduled",
                "retired": True,
                **extra,
            }
        )
    pg_config = {
        name: {"name": name, "desc": desc, "ranks": str(ranks)}
        for name, (desc, ranks) in groups.items()
        if rank in ranks
    }
    return dump_from_object(
        {"version": "2.10", "pg_config": pg_config, "entries": entries}, fmt="json", rank=rank
    )


def default_only(world: int, last: dict[int, int]) -> dict[int, FrDump]:
    groups = {"0": ("default_pg", list(range(world)))}
    return {r: make_dump(r, [("0", s) for s in range(1, n + 1)], groups) for r, n in last.items()}
