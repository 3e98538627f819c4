"""A sharded state's second copy: each rank's shard of the model and optimizer (FSDP, DTensor), as
its snapshot or its commit's in-memory copy holds it, is kept in its buddy's host memory too, so
that a lost host's shards survive it and its replacement loads them from memory, not storage.

Runs in the training script's process. Shards move point to point between ring neighbours (a rank
and its buddy, the same local rank on the next host: nodeagent.trainer.snapshot) on a two-rank gloo
group per pair: host memory to host memory over the hosts' network, never through a GPU, never on
the default group (whose collective count the collective hang rule compares). `replicate` runs on a
thread while training goes on. Every move is an offer (JSON: the tensors' shapes and dtypes and the
checksum each had when the owner's copy landed), an answer (the receiver's bounds: accept or
refuse), then the bytes, each tensor into a buffer the receiver sized: nothing from a peer is
unpickled and nothing unbounded allocated. `serve` moves a held shard back to a new process of its
owner at a restore, which checks every tensor against its checksum. One exchange runs at a time
(`wait_all` before the next, in the training thread's order, which is the same on every rank).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from nodeagent.trainer import memory_state
from nodeagent.trainer.checkpoint import is_xxh3

log = logging.getLogger(__name__)

FORMAT = "shard"
MAX_HEADER_BYTES = 64 * 1024 * 1024  # an offer's JSON (a shape, a dtype and a checksum per tensor)
PAIR_TIMEOUT_S = memory_state.COPY_WAIT_S  # a pair's transfer waits this long for its peer


Specs = tuple[tuple[tuple[int, ...], str], ...]  # each tensor's shape and dtype name, in slot order


@dataclass(frozen=True, slots=True)
class HeldShard:
    """Another rank's shard of one snapshot or commit, kept for it as its buddy."""

    owner: int
    specs: Specs  # each tensor's shape and dtype name, in slot order
    digests: tuple[str, ...]  # each tensor's checksum when the owner's copy landed
    flat: Any  # the tensors' bytes one after another (uint8)


@dataclass(slots=True)
class Replication:
    """One copy's exchange: this rank's shard to its buddy, the shard of the rank behind to this
    rank. `why` is "" once the shard of the rank behind is held here."""

    step: int
    kind: str = memory_state.SNAPSHOT
    world: Any = None  # the default group it ran on (a warm rank's next attempt has a new one)
    done: threading.Event = field(default_factory=threading.Event)
    why: str = ""


_lock = threading.Lock()
# (kind, run, attempt, step, owner) -> its shard; kind: memory_state.SNAPSHOT or COMMIT
_held: dict[tuple[str, str, int, int, int], HeldShard] = {}
_spare: list[Any] = []  # the flat buffer of a dropped shard (reused by the next of its size)
_groups: tuple[Any, dict[tuple[int, int], Any]] | None = None  # (the default group, pair -> its group)
_running: list[Replication] = []  # the exchanges started and not yet waited for


def held(
    run: str, attempt: int, step: int, owner: int, *, kind: str = memory_state.SNAPSHOT
) -> HeldShard | None:
    with _lock:
        return _held.get((kind, run, attempt, step, owner))


def wait_all(timeout_s: float = PAIR_TIMEOUT_S) -> bool:
    """Until every exchange this attempt started has ended (whether all did within `timeout_s`).
    Before the next exchange starts, before a copy whose buffers one may still be sending is
    replaced, and before a restore moves shards on the same pairs' groups. An exchange of an
    earlier attempt (on its default group, now gone) is not waited for."""
    import torch.distributed as dist

    world = dist.group.WORLD if dist.is_initialized() else None
    with _lock:
        mine = [job for job in _running if job.world is world]
        _running[:] = [job for job in _running if not job.done.is_set()]
    return all(job.done.wait(timeout_s) for job in mine)


def held_bytes() -> int:
    with _lock:
        return sum(x.flat.numel() for x in _held.values())


def forget() -> None:
    """Drop every held shard (a test's process made new)."""
    with _lock:
        _held.clear()
        _spare.clear()


def _pair(a: int, b: int) -> tuple[int, int]:
    return (a, b) if a < b else (b, a)


@dataclass(frozen=True, slots=True)
class RingPlace:
    """A rank's place on the ring: its buddy ahead (which keeps its shard), the rank behind (whose
    buddy it is), and the two-rank gloo group it shares with each."""

    rank: int
    ahead: int
    behind: int
    to_ahead: Any
    from_behind: Any


def ring_place(rank: int, world: int, local: int) -> RingPlace:
    """This rank's place on the ring of `world` ranks, `local` a host. Each pair's group is made by its
    two ranks alone, every rank making its pairs in one global order (so no ranks wait on each other
    in a cycle); once per default group. Every rank of the ring calls it at the same point."""
    import torch.distributed as dist

    global _groups
    world_group = dist.group.WORLD
    if _groups is None or _groups[0] is not world_group:
        _groups = (world_group, {})
    made = _groups[1]
    ahead, behind = (rank + local) % world, (rank - local) % world
    missing = [p for p in sorted({_pair(rank, ahead), _pair(behind, rank)}) if p not in made]
    if missing:
        made.update(_low_priority_groups(missing))
    return RingPlace(rank, ahead, behind, made[_pair(rank, ahead)], made[_pair(behind, rank)])


def _low_priority_groups(pairs: list[tuple[int, int]]) -> dict[tuple[int, int], Any]:
    """Each pair's gloo group, made (in this order) on a thread at the lowest priority: gloo's
    transport and worker threads are made with the group and inherit its niceness, and they, not
    the caller, read and write a shard's bytes. Made on the training thread they would take their
    CPU from its step where the cores are all busy (on a CPU host: 6-7% of a step, BENCHMARKS.md)."""
    import torch.distributed as dist

    made: dict[tuple[int, int], Any] = {}
    failed: list[BaseException] = []

    def work() -> None:
        memory_state.yield_to_training()
        try:
            for pair in pairs:
                made[pair] = dist.new_group(
                    list(pair),
                    backend="gloo",
                    timeout=timedelta(seconds=PAIR_TIMEOUT_S),
                    use_local_synchronization=True,
                )
        except BaseException as exc:  # raised to the caller, as if it had made the groups itself
            failed.append(exc)

    maker = threading.Thread(target=work, name="runwarden-shard-groups", daemon=True)
    maker.start()
    maker.join()
    if failed:
        raise failed[0]
    return made


def _as_bytes(t: Any) -> Any:
    import torch

    return t.detach().reshape(-1).view(torch.uint8)


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _swap(
    body: bytes | None, *, to: int, to_group: Any, source: int | None, source_group: Any
) -> bytes | None:
    """Send `body` to `to` (None: send nothing) and receive one from `source` (None: none), each a
    length and then its bytes. The received body, if one was expected (b"" when the peer had none)."""
    import torch
    import torch.distributed as dist

    out_n = torch.tensor([len(body) if body is not None else 0], dtype=torch.int64)
    in_n = torch.zeros(1, dtype=torch.int64)
    works = []
    if body is not None:
        works.append(dist.isend(out_n, to, group=to_group))
    if source is not None:
        works.append(dist.irecv(in_n, source, group=source_group))
    _wait(works)
    n = int(in_n.item()) if source is not None else 0
    if not 0 <= n <= MAX_HEADER_BYTES:
        raise ValueError(f"rank {source} announced a {n}-byte offer")
    works, into = [], torch.empty(n, dtype=torch.uint8)
    if body:
        works.append(dist.isend(torch.frombuffer(bytearray(body), dtype=torch.uint8), to, group=to_group))
    if source is not None and n:
        works.append(dist.irecv(into, source, group=source_group))
    _wait(works)
    return into.numpy().tobytes() if source is not None else None


def _offer(step: int, owner: int, specs: Any, digests: Any, kind: str) -> bytes:
    return json.dumps(
        {"format": FORMAT, "kind": kind, "step": step, "owner": owner, "specs": specs, "xxh3": list(digests)}
    ).encode()


def _parse_offer(raw: bytes, step: int, owner: int, kind: str) -> tuple[Specs, tuple[str, ...]] | str:
    """An offer's (specs, checksums) if it is `owner`'s shard of the `kind` copy of `step` and well
    formed, else why not."""
    import torch

    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "the offer is not JSON"
    if not isinstance(doc, dict) or (
        doc.get("format"),
        doc.get("kind"),
        doc.get("step"),
        doc.get("owner"),
    ) != (FORMAT, kind, step, owner):
        return f"the offer is not rank {owner}'s shard of the {kind} of step {step}"
    specs, sums = doc.get("specs"), doc.get("xxh3")
    if not (isinstance(specs, list) and isinstance(sums, list) and len(specs) == len(sums)):
        return "the offer's specs and checksums do not match"
    out = []
    for spec, digest in zip(specs, sums, strict=True):
        if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], list)):
            return f"a malformed tensor spec {spec!r}"
        shape, name = spec
        if not (all(isinstance(d, int) and d >= 0 for d in shape) and isinstance(name, str)):
            return f"a malformed tensor spec {spec!r}"
        if not isinstance(getattr(torch, name, None), torch.dtype):
            return f"an unknown dtype {name!r}"
        if not is_xxh3(digest):
            return "a malformed checksum"
        out.append((tuple(shape), name))
    return tuple(out), tuple(sums)


def _nbytes(specs: Any) -> list[int]:
    import torch

    return [math.prod(shape) * getattr(torch, name).itemsize for shape, name in specs]


def _parts(flat: Any, sizes: list[int]) -> list[Any]:
    """The non-empty tensors' slices of a held shard's bytes, in slot order (an empty one sends nothing)."""
    out, at = [], 0
    for n in sizes:
        if n:
            out.append(flat[at : at + n])
        at += n
    return out


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def replicate(
    own: memory_state.MemoryCopy | None,
    step: int,
    *,
    run: str,
    attempt: int,
    ring: RingPlace,
    kind: str = memory_state.SNAPSHOT,
) -> Replication:
    """On a thread at the lowest priority: once this rank's `kind` copy of `step` has landed and
    been hashed, offer it to the buddy ahead and take the shard of the rank behind (`own` None: this
    rank kept no copy, it offers nothing but still takes). Every rank of the ring calls it for the
    same copy, after `wait_all`."""
    import torch.distributed as dist

    job = Replication(step, kind, dist.group.WORLD)

    def work() -> None:
        memory_state.yield_to_training()
        try:
            job.why = _exchange(own, step, run=run, attempt=attempt, ring=ring, kind=kind)
        except Exception as exc:  # a peer gone (its host lost) or a transfer cut: not held
            job.why = f"{type(exc).__name__}: {exc}"
        if job.why:
            log.warning(
                "rank %d: rank %d's shard of the %s of step %d not held: %s",
                ring.rank,
                ring.behind,
                kind,
                step,
                job.why,
            )
        job.done.set()

    with _lock:
        _running.append(job)
    threading.Thread(target=work, name="runwarden-shard-replica", daemon=True).start()
    return job


def _exchange(
    own: memory_state.MemoryCopy | None, step: int, *, run: str, attempt: int, ring: RingPlace, kind: str
) -> str:
    import torch
    import torch.distributed as dist

    rank, ahead, behind, to_ahead, from_behind = (
        ring.rank,
        ring.ahead,
        ring.behind,
        ring.to_ahead,
        ring.from_behind,
    )
    landed = (
        own is not None
        and own.copied.wait(PAIR_TIMEOUT_S)
        and own.hashed.wait(PAIR_TIMEOUT_S)
        and not own.failed
        and len(own.digests) == len(own.buffers)
    )
    offer = b""
    if own is not None and landed:
        specs = [[list(b.shape), _dtype_name(b.dtype)] for b in own.buffers]
        offer = _offer(step, rank, specs, own.digests, kind)
    theirs = _swap(offer, to=ahead, to_group=to_ahead, source=behind, source_group=from_behind) or b""
    parsed = (
        _parse_offer(theirs, step, behind, kind) if theirs else f"rank {behind} kept no copy of step {step}"
    )
    why = parsed if isinstance(parsed, str) else ""
    sizes = _nbytes(parsed[0]) if not isinstance(parsed, str) else []
    _drop_stale(kind, run, attempt, step)
    if not why and sum(sizes) + memory_state.kept_bytes() + held_bytes() > memory_state.budget():
        # the rank's copies and the shards it holds share its copy budget
        why = f"its {sum(sizes)} bytes are over what is left of the copy budget of {memory_state.budget()} bytes"
    answer = torch.tensor([0 if why else 1], dtype=torch.int64)
    accepted = torch.zeros(1, dtype=torch.int64)
    _wait([dist.isend(answer, behind, group=from_behind), dist.irecv(accepted, ahead, group=to_ahead)])
    flat = None if why else _flat(sum(sizes))
    works = []
    if offer and int(accepted.item()) == 1 and own is not None:
        works += [dist.isend(_as_bytes(b), ahead, group=to_ahead) for b in own.buffers if b.numel()]
    if flat is not None:
        works += [dist.irecv(part, behind, group=from_behind) for part in _parts(flat, sizes)]
    _wait(works)
    if flat is None or isinstance(parsed, str):
        return why
    _keep(kind, run, attempt, step, HeldShard(owner=behind, specs=parsed[0], digests=parsed[1], flat=flat))
    return ""


def _flat(nbytes: int) -> Any:
    import torch

    with _lock:
        for i, spare in enumerate(_spare):
            if spare.numel() == nbytes:
                return _spare.pop(i)
    return torch.empty(nbytes, dtype=torch.uint8)


def _keep(kind: str, run: str, attempt: int, step: int, shard: HeldShard) -> None:
    """Hold `shard`; a held shard lives as long as this process's own copy of the same kind and
    step (memory_state drops the oldest)."""
    with _lock:
        _held[(kind, run, attempt, step, shard.owner)] = shard
    _drop_stale(kind, run, attempt, step)


def _drop_stale(kind: str, run: str, attempt: int, step: int) -> None:
    """Drop the shards held for copies of `kind` this process no longer holds its own of (keeping
    one buffer for the next shard of its size)."""
    own = memory_state.copy_keys(kind) | {(run, attempt, step)}
    with _lock:
        for key in [k for k in _held if k[0] == kind and k[1:4] not in own]:
            _spare[:] = [_held.pop(key).flat]


def serve(
    donors: tuple[int, ...],
    *,
    run: str,
    attempt: int,
    step: int,
    rank: int,
    local: int,
    layout: list[tuple[tuple[int, ...], Any]] | None,
    kind: str = memory_state.SNAPSHOT,
) -> tuple[list[Any] | None, str]:
    """At a restore of the `kind` copy of `step`: send the shard this rank holds for the rank behind it if
    `donors` names this rank that rank's donor, and take this rank's own from its buddy ahead if
    `donors` names the buddy (`layout`: this rank's tensors, which the shard must match). Every rank
    of the ring calls it with the same `donors`. (the tensors received, each checked against its
    checksum, or None if this rank took none; why the shard was refused, "" if it was not)."""
    import torch
    import torch.distributed as dist

    world = len(donors)
    if all(d == r for r, d in enumerate(donors)):
        return None, ""
    ring = ring_place(rank, world, local)  # every rank: its neighbours may need the groups
    ahead, behind, to_ahead, from_behind = ring.ahead, ring.behind, ring.to_ahead, ring.from_behind
    gives = donors[behind] == rank and behind != rank
    takes = donors[rank] == ahead and ahead != rank
    shard = held(run, attempt, step, behind, kind=kind) if gives else None
    offer = (
        _offer(step, behind, [[list(s), n] for s, n in shard.specs], shard.digests, kind) if shard else b""
    )
    got = _swap(
        offer if gives else None,
        to=behind,
        to_group=from_behind,
        source=ahead if takes else None,
        source_group=to_ahead,
    )
    why = ""
    specs: Specs = ()
    sums: tuple[str, ...] = ()
    if takes:
        parsed = _parse_offer(got, step, rank, kind) if got else f"rank {ahead} holds no shard of rank {rank}"
        if isinstance(parsed, str):
            why = parsed
        elif layout is None or list(parsed[0]) != [(s, _dtype_name(d)) for s, d in layout]:
            why = f"the shard rank {ahead} holds is not laid out as this rank's state"
        else:
            specs, sums = parsed
    answer, accepted = torch.tensor([0 if why else 1], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    works = []
    if takes:
        works.append(dist.isend(answer, ahead, group=to_ahead))
    if gives:
        works.append(dist.irecv(accepted, behind, group=from_behind))
    _wait(works)
    received = [torch.empty(s, dtype=getattr(torch, n)) for s, n in specs]
    works = []
    if gives and shard is not None and int(accepted.item()) == 1:
        works += [dist.isend(p, behind, group=from_behind) for p in _parts(shard.flat, _nbytes(shard.specs))]
    for t in received:
        if t.numel():
            works.append(dist.irecv(_as_bytes(t), ahead, group=to_ahead))
    _wait(works)
    if not takes:
        return None, ""
    if why:
        return None, why
    for i, (t, digest) in enumerate(zip(received, sums, strict=True)):
        if memory_state.digest(t) != digest:
            return None, f"tensor {i} of the shard rank {ahead} sent does not match its checksum"
    return received, ""


@dataclass(frozen=True, slots=True)
class HeldShards:
    """This rank's view of the shards the buddies hold of its `kind` copies (memory_state.BuddyShards
    for a commit's; a snapshot's restore uses `fetch` too). `fresh_state`: this rank's model and
    optimizer state now, the layout a received shard must match and the structure it goes into."""

    rank: int
    run: str
    fresh_state: Callable[[], Any]
    kind: str = memory_state.COMMIT

    def wait(self) -> None:
        wait_all()

    def holds(self, owner: int, attempt: int, step: int) -> bool:
        return owner != self.rank and held(self.run, attempt, step, owner, kind=self.kind) is not None

    def fetch(self, donors: tuple[int, ...], attempt: int, step: int, local: int) -> tuple[Any, str]:
        """Every rank: move the shards `donors` names. (this rank's state with its shard received,
        or None if it took none; why it refused its shard, or "")."""
        fresh = self.fresh_state() if donors[self.rank] != self.rank else None
        try:
            shard, refused = serve(
                donors,
                run=self.run,
                attempt=attempt,
                step=step,
                rank=self.rank,
                local=local,
                layout=memory_state.local_layout(fresh) if fresh is not None else None,
                kind=self.kind,
            )
        except (RuntimeError, ValueError) as exc:  # a peer's transfer cut or malformed: every rank hears
            return None, f"{type(exc).__name__}: {exc}"
        if fresh is None or shard is None:
            return None, refused
        return memory_state.with_locals(fresh, shard), refused
