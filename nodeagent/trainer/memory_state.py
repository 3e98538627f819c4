"""The rank's in-memory copy of its last checkpoint: the fast path of a warm restart.

A warm rank process outlives its attempts (nodeagent.warm.rank), and this module, imported once, with
it. `keep` is called by `nodeagent.trainer.save_checkpoint` once every rank has written its file
(after the save's barrier, before rank 0 writes the commit marker): a copy of exactly what went to
storage, so the next optimizer step cannot change it. `take` is called by `load_checkpoint`: the
copy serves the load only if it is the state of that commit, i.e.

* its step is the commit's step, and the commit marker says the attempt that took the copy
  committed it (a superseded attempt's copy, or a step committed by another attempt after a
  rollback, never is);
* the same run, the same global rank and world size (each rank's file is its own).

A DCP commit is served by `restore_committed_dcp` (from this rank's copies, a peer's, or storage,
which stays the truth on disk; `loaded_from` says which); where the copies live and what they may
cost is `keep`'s contract.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from nodeagent.trainer import dcp_format
from nodeagent.trainer.checkpoint import is_xxh3

log = logging.getLogger(__name__)

MEMORY = "memory"
COMMIT = "commit"  # a MemoryCopy of what a save wrote to storage
SNAPSHOT = "snapshot"  # a MemoryCopy taken between commits (nodeagent.trainer.snapshot): memory only
PEER = "peer"  # a peer rank of the same attempt sent it (the replacement host has no copy)
STORAGE = "storage"


def _done_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryCopy:
    """One rank's copy, in host memory, of what one save of one step wrote."""

    run: str
    attempt: int
    step: int
    rank: int
    world_size: int
    payload: Any  # what the save wrote to this rank's file, its tensors copied into host buffers
    nbytes: int = 0  # the bytes of its host buffers (what counts against the budget)
    buffers: tuple[Any, ...] = ()  # those buffers, in slot order (reused by a later copy)
    copied: threading.Event = field(default_factory=_done_event)  # set once the copy has landed
    failed: list[str] = field(default_factory=list)  # the copy thread's error, if the copy failed
    # the checksum of each buffer once it landed (set when `hashed` is): what a load checks it against
    digests: list[str] = field(default_factory=list)
    hashed: threading.Event = field(default_factory=_done_event)
    kind: str = COMMIT
    whole: bool = True  # no DTensor in it: every rank of the attempt holds the same model and optimizer


# The newest two commits: an asynchronous save's commit comes after the next steps, and a save waits
# for the previous one to commit before it starts, so the latest commit is always one of the two kept.
KEEP = 2
# The newest three snapshots: the controller chooses one from the ranks' reports, which lag the ranks
# by up to a report interval and an agent write (~1.5 s), and the ranks train on until the stop
# reaches them; at a snapshot a second or more apart, the one it chose is still held.
SNAPSHOT_KEEP = 3
# Host bytes one rank process may hold in copies (both together): AgentConfig.memory_copy_budget_bytes
# reaches a parked rank as `--copy-budget-bytes` (nodeagent.warm.rank). 0 keeps none.
DEFAULT_BUDGET_BYTES = 16 * 1024**3
COPY_WAIT_S = 300.0  # a load waits this long for a copy still landing (a GPU's D2H copy: seconds)
WARM = "warm"  # RUNWARDEN_LAUNCH_PATH of a rank the warm path started (nodeagent.warm.rank.rank_env)
_lock = threading.Lock()
_copies: list[MemoryCopy] = []  # oldest first
_loaded: tuple[int, str] | None = None  # (step, source) of the last load in this process
_budget = DEFAULT_BUDGET_BYTES
_not_kept: dict[int, str] = {}  # step -> why no copy of it was kept (the load says so), the last few
_fell_back: dict[int, str] = {}  # step -> why its load passed over a source (the load mark says so)
_side_streams: dict[Any, Any] = {}  # CUDA device -> the stream the copies run on


def set_budget(nbytes: int) -> None:
    """This process's copy budget in bytes (a parked rank sets it from the agent's config)."""
    global _budget
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"copy budget: a number of bytes >= 0, got {nbytes!r}")
    _budget = nbytes


def budget() -> int:
    return _budget


def _identity(env: Mapping[str, str]) -> tuple[str, int]:
    attempt = env.get("RUNWARDEN_ATTEMPT", "")
    return env.get("RUNWARDEN_RUN", ""), int(attempt) if attempt.isdigit() else -1


def local_world_size(env: Mapping[str, str] | None = None) -> int:
    """The ranks of one host (the launcher's LOCAL_WORLD_SIZE; 1 if unset): a rank's buddy is that
    many ranks on, the same local rank on the next host."""
    local = (os.environ if env is None else env).get("LOCAL_WORLD_SIZE", "").strip()
    return int(local) if local.isdigit() and int(local) > 0 else 1


def _refuse(step: int, why: str, *, warn: bool) -> str:
    with _lock:
        _not_kept[step] = why
        for old in sorted(_not_kept)[:-8]:
            del _not_kept[old]
    (log.warning if warn else log.info)("no in-memory copy of step %d: %s", step, why)
    return why


def why_not_kept(step: int) -> str:
    """Why this process kept no copy of `step` ("" if it did, or was never asked to)."""
    with _lock:
        return _not_kept.get(step, "")


def keep(
    step: int,
    payload: Any,
    *,
    rank: int,
    world_size: int,
    env: Mapping[str, str] | None = None,
    budget_bytes: int | None = None,
    kind: str = COMMIT,
    in_background: bool = False,
) -> str:
    """Copy `payload` into host memory as this rank's state at checkpoint `step`: "" if kept, else
    why not (also logged, and said by the load of that step). `kind`: COMMIT (what a save wrote)
    or SNAPSHOT (between commits); each kind keeps its newest (KEEP, SNAPSHOT_KEEP). `in_background`: a CPU copy
    runs on a thread too (its `copied` event says when it landed: the caller must not change the
    state before then; nodeagent.trainer.snapshot waits for it before the optimizer's next step).

    The copies live in host memory, never on the GPU, and cost at most five model + optimizer states
    per rank (two commits, three snapshots; for sharded state, up to as many shards held for the
    buddy behind too: nodeagent.trainer.shard_replica), never more than the copy budget (`set_budget`, the agent's memory_copy_budget_bytes,
    DEFAULT_BUDGET_BYTES). A copy is only ever sent to a peer inside the process group of the attempt
    that loads it, whose rendezvous is fenced by attempt (nodeagent.warm.rank), in chunks
    (STAGE_BYTES) under NCCL, and only if it is the state of the commit being loaded: a stale rank
    cannot hand its state out.

    Only a rank the warm path started keeps one (`RUNWARDEN_LAUNCH_PATH=warm`): a cold rank's
    process ends with its attempt, and its copy with it. A copy over the budget is not kept; older
    copies go first to make room. Every tensor lands in a plain host tensor (pinned when the state
    is on a GPU and CUDA is available), whatever device it claims; a DTensor keeps its local shard and its placement. CUDA
    tensors are copied on a side stream: the caller never waits for it (the training stream does,
    before its next kernel, so the next step cannot change a tensor mid-copy), and a load waits for
    it to land. On CPU it is a plain copy into buffers reused from the copy it replaces."""
    env = os.environ if env is None else env
    run, attempt = _identity(env)
    if attempt < 0:
        return "not under a supervisor"  # no commit can name the copy's attempt
    if env.get("RUNWARDEN_LAUNCH_PATH", "") != WARM:
        return _refuse(step, "a cold launch: the process ends with its attempt", warn=False)
    limit = _budget if budget_bytes is None else budget_bytes
    skeleton, sources = _split(payload)
    try:
        locals_ = [_local(t) for t in sources]
    except ValueError as exc:
        return _refuse(step, str(exc), warn=True)
    nbytes = sum(t.numel() * t.element_size() for t in locals_)
    if nbytes > limit:
        return _refuse(
            step,
            f"its {nbytes} bytes are over the copy budget of {limit} bytes "
            "(memory_copy_budget_bytes): a warm restart loads it from storage",
            warn=True,
        )
    layout = [(tuple(t.shape), t.dtype) for t in locals_]
    with _lock:
        kept = _trim([x for x in _copies if x.kind != kind or x.step != step], kind, _keep(kind) - 1)
        squeezed = []
        while kept and sum(x.nbytes for x in kept) + nbytes > limit:
            oldest = min(kept, key=lambda x: (x.step, x.kind != kind))  # the oldest first
            squeezed.append(oldest)
            kept.remove(oldest)
        dropped = [x for x in _copies if x not in kept]
        _copies[:] = kept  # dropped now: their buffers may be reused below
    for old in squeezed:
        log.info(
            "step %d: the %s copy of step %d dropped to fit the copy budget (%d bytes)",
            step,
            old.kind,
            old.step,
            limit,
        )
    buffers = _reuse(dropped, layout) or _allocate(locals_)
    host = _copy(locals_, buffers, step, in_background=in_background)
    digests: list[str] = []
    hashed = threading.Event()
    threading.Thread(
        target=_hash_when_landed,
        args=(buffers, host[0], digests, hashed),
        name="runwarden-copy-hash",
        daemon=True,
    ).start()
    held = MemoryCopy(
        run=run,
        attempt=attempt,
        step=step,
        rank=rank,
        world_size=world_size,
        payload=_join(
            _plain_leaves(skeleton), [_rewrap(s, h) for s, h in zip(sources, buffers, strict=True)]
        ),
        nbytes=nbytes,
        buffers=tuple(buffers),
        copied=host[0],
        failed=host[1],
        digests=digests,
        hashed=hashed,
        kind=kind,
        whole=not any(_is_dtensor(t) for t in sources),
    )
    with _lock:
        _copies[:] = _trim(
            [*(x for x in _copies if x.kind != kind or x.step != step), held], kind, _keep(kind)
        )
        _not_kept.pop(step, None)
    return ""


def _keep(kind: str) -> int:
    return SNAPSHOT_KEEP if kind == SNAPSHOT else KEEP


def _trim(copies: list[MemoryCopy], kind: str, n: int) -> list[MemoryCopy]:
    """`copies` (oldest first) less those of `kind` older than its newest `n`."""
    mine = [x for x in copies if x.kind == kind]
    drop = {id(x) for x in mine[: max(0, len(mine) - n)]}
    return [x for x in copies if id(x) not in drop]


def digest(t: Any) -> str:
    """A host tensor's checksum: XXH3-128 of its bytes, hex (32 digits). It guards against corruption
    (bit flips, torn or garbled transfers, bugs), not against an adversary: the copies stay in the
    job's own memory and links. ~16x SHA-256's speed here (10 GB/s against 0.6 on one loaded core),
    which every restore pays on its critical path; xxhash lets go of the GIL while it hashes."""
    import torch
    import xxhash

    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return xxhash.xxh3_128(b"").hexdigest()
    return xxhash.xxh3_128(memoryview(flat.contiguous().view(torch.uint8).numpy())).hexdigest()


BACKGROUND_NICE = 19  # the copy and hash threads' niceness: the CPU the training thread leaves idle


def yield_to_training() -> None:
    """Lower this thread's priority (Linux: niceness is per thread) so that the copy and its
    digests take the CPU the training thread does not use (its waits in collectives, a GPU host's
    idle cores) instead of slowing its step where the cores are all busy."""
    # not Linux, or not allowed: the thread runs at the process's priority
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def digests(tensors: Any) -> list[str]:
    """Each host tensor's checksum, on as many threads as the host has cores (at most 8: xxhash lets
    go of the GIL), in order."""
    tensors = list(tensors)
    workers = min(8, os.cpu_count() or 1, len(tensors))
    if workers <= 1:
        return [digest(t) for t in tensors]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers, thread_name_prefix="runwarden-digest") as pool:
        return list(pool.map(digest, tensors))


def _hash_when_landed(
    buffers: list[Any], landed: threading.Event, out: list[str], hashed: threading.Event
) -> None:
    """Off the training thread: the digests a load checks the copy against, taken once it landed."""
    yield_to_training()
    try:
        if landed.wait(COPY_WAIT_S):
            out.extend(digest(b) for b in buffers)
    except Exception as exc:  # a copy without digests is not served (take)
        log.warning("hashing an in-memory copy failed: %s", exc)
    finally:
        hashed.set()


def fell_back(step: int, why: str) -> None:
    """Record why the load of `step` passed over a source (the reporter's load mark sends it)."""
    log.warning("step %d: %s", step, why)
    with _lock:
        _fell_back[step] = why[:500]
        for old in sorted(_fell_back)[:-8]:
            del _fell_back[old]


def why_fell_back(step: int) -> str:
    """Why this process's load of `step` passed over a source ("" if it did not)."""
    with _lock:
        return _fell_back.get(step, "")


def _plain_leaves(skeleton: Any) -> Any:
    """The skeleton's non-tensor leaves deep-copied (the optimizer's hyper-parameters: the next
    step must not change the copy's)."""
    return copy.deepcopy(skeleton)


class _HostDTensor:
    """A DTensor's local shard in host memory, with what makes it a DTensor again at the load."""

    __slots__ = ("local", "mesh", "placements", "shape", "stride")

    def __init__(self, local: Any, src: Any) -> None:
        self.local = local
        self.mesh, self.placements = src.device_mesh, tuple(src.placements)
        self.shape, self.stride = src.shape, src.stride()

    def rebuild(self, local: Any) -> Any:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)


def is_sharded(state: Any) -> bool:
    """Whether some tensor of a model/optimizer state is a DTensor (FSDP): each rank's is its own."""
    return any(_is_dtensor(t) for t in _split(state)[1])


def local_layout(state: Any) -> list[tuple[tuple[int, ...], Any]]:
    """The shape and dtype of each tensor's local part (a DTensor's shard), in slot order."""
    return [(tuple(t.shape), t.dtype) for t in (_local(s) for s in _split(state)[1])]


def with_locals(state: Any, locals_: list[Any]) -> Any:
    """`state` with each tensor's local part replaced by the host tensor of its slot (a DTensor's
    placement kept): the shape of state `restore_state` puts into a model."""
    skeleton, sources = _split(state)
    rebuilt = [
        _HostDTensor(h, s).rebuild(h) if _is_dtensor(s) else h for s, h in zip(sources, locals_, strict=True)
    ]
    return _join(skeleton, rebuilt)


def _local(t: Any) -> Any:
    """The tensor whose bytes are copied: a DTensor's local shard, else the tensor itself."""
    local = t.to_local() if _is_dtensor(t) else t
    if local.device.type == "meta":
        raise ValueError("a tensor on the meta device has no data to copy")
    return local


def _rewrap(src: Any, host: Any) -> Any:
    return _HostDTensor(host, src) if _is_dtensor(src) else host


def _reuse(dropped: list[MemoryCopy], layout: list[tuple[tuple[int, ...], Any]]) -> list[Any] | None:
    """The buffers of a dropped copy of the same layout (the same model: every save after the
    second reuses them), once its own copy has landed."""
    for old in dropped:
        if [(tuple(b.shape), b.dtype) for b in old.buffers] == layout:
            old.copied.wait(COPY_WAIT_S)
            return list(old.buffers)
    return None


def _allocate(locals_: list[Any]) -> list[Any]:
    import torch

    # pinned: what an async D2H copy needs; only for state on a GPU (pinning creates a CUDA context)
    pin = torch.cuda.is_available() and any(t.device.type == "cuda" for t in locals_)
    return [torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu", pin_memory=pin) for t in locals_]


def _copy(
    locals_: list[Any], buffers: list[Any], step: int, *, in_background: bool = False
) -> tuple[threading.Event, list[str]]:
    """Copy every tensor into its host buffer: CPU (or anything not on a CUDA device) here, now
    (`in_background`: on a thread); CUDA tensors on a side stream per device; landed when the
    returned event is set."""
    import torch

    if in_background and not any(t.device.type == "cuda" for t in locals_):

        def copy_all() -> None:
            with torch.no_grad():
                for src, dst in zip(locals_, buffers, strict=True):
                    dst.copy_(src)

        return _landing(step, copy_all)
    on_cuda: dict[Any, list[tuple[Any, Any]]] = {}
    with torch.no_grad():
        for src, dst in zip(locals_, buffers, strict=True):
            if src.device.type == "cuda" and torch.cuda.is_available():
                on_cuda.setdefault(src.device, []).append((src, dst))
            else:
                dst.copy_(src)
    if not on_cuda:
        return _done_event(), []
    events = []
    with torch.no_grad():
        for device, pairs in on_cuda.items():
            side = _side_streams.get(device)
            if side is None:
                side = _side_streams[device] = torch.cuda.Stream(device)
            current = torch.cuda.current_stream(device)
            side.wait_stream(current)  # the copy sees the state as it is now
            with torch.cuda.stream(side):
                for src, dst in pairs:
                    dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
            current.wait_event(done)  # the next step's kernels wait on the GPU, never the host
            events.append(done)

    def wait() -> None:  # off the training thread: only a load waits for this
        for done in events:
            done.synchronize()

    return _landing(step, wait)


def _landing(step: int, work: Callable[[], None]) -> tuple[threading.Event, list[str]]:
    """Run the copy's `work` on a thread at the lowest priority: an event set once it is done, and
    its error, if it failed (a copy that failed is never served)."""
    landed, failed = threading.Event(), list[str]()

    def run() -> None:
        yield_to_training()
        try:
            work()
        except Exception as exc:
            failed.append(f"{type(exc).__name__}: {exc}")
            log.warning("the copy of step %d failed: %s", step, failed[-1])
        landed.set()

    threading.Thread(target=run, name="runwarden-copy", daemon=True).start()
    return landed, failed


def clone_payload(payload: Any) -> Any:
    """A copy of a kept payload for a load (the optimizer's load may alias tensors it is given):
    tensors cloned, a DTensor's shard rebuilt into a DTensor, plain data deep-copied."""
    import torch

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.clone()
        if isinstance(x, _HostDTensor):
            return x.rebuild(x.local.clone())
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return copy.deepcopy(x)

    return walk(payload)


def kept_bytes() -> int:
    """The host bytes this process holds in copies."""
    with _lock:
        return sum(x.nbytes for x in _copies)


def take(
    step: int,
    committed_by: int | None,
    *,
    rank: int | None,
    world_size: int | None,
    env: Mapping[str, str] | None = None,
) -> Any | None:
    """A copy of the kept payload if it is the state of commit `step` (committed by attempt
    `committed_by`, from its marker) saved as global rank `rank` of `world_size`, else None (load
    from storage). `rank=None, world_size=None`: saved as any rank (its model and optimizer state
    serve a rank renumbered by a replacement when that state is replicated). Waits for a copy
    still landing (COPY_WAIT_S); one whose copy failed is none, and so is one whose bytes are no
    longer the checksum taken when it landed (host memory corrupted since: `why_fell_back` says so)."""
    held = _checked(step, committed_by, rank=rank, world_size=world_size, env=env)
    return clone_payload(held.payload) if held is not None else None


def _checked(
    step: int,
    committed_by: int | None,
    *,
    rank: int | None,
    world_size: int | None,
    env: Mapping[str, str] | None = None,
    kind: str = COMMIT,
) -> MemoryCopy | None:
    """The kept copy `take` would serve (`kind`: a snapshot instead), landed and checked against
    its digests; else None."""
    run, _ = _identity(os.environ if env is None else env)
    if committed_by is None:
        return None
    with _lock:
        held = next(
            (
                x
                for x in _copies
                if (x.run, x.step, x.attempt, x.kind) == (run, step, committed_by, kind)
                and rank in (None, x.rank)
                and world_size in (None, x.world_size)
            ),
            None,
        )
    if held is None:
        return None
    if not held.copied.wait(COPY_WAIT_S) or held.failed:
        log.warning("the copy of step %d did not land: %s", step, held.failed or "timed out")
        return None
    if not held.hashed.wait(COPY_WAIT_S) or len(held.digests) != len(held.buffers):
        fell_back(step, f"the in-memory copy of step {step} was never hashed: not served")
        return None
    changed = [
        i
        for i, (now, then) in enumerate(zip(digests(held.buffers), held.digests, strict=True))
        if now != then
    ]
    if changed:
        fell_back(
            step,
            f"the in-memory copy of step {step} (saved as rank {held.rank}) no longer matches the checksum "
            f"taken when it was kept ({len(changed)} of {len(held.buffers)} tensors differ): not served",
        )
        return None
    return held


# What each rank tells the others before a DCP load (bits of one integer, all-gathered).
_HOLDS = 1  # it holds its own copy of the commit (saved as this rank of this world size)
_WHOLE = 2  # the commit's tensors were saved whole (replicated state, dcp_format.whole_tensors_bytes)
_PEER_OK = 4  # it may take its state from a peer (load_checkpoint's from_peer)
_HOLDS_STATE = 8  # it holds a copy of the commit saved as any rank (a replacement renumbered it)
_HOLDS_SHARD = 16  # it holds, as its buddy, the shard of the rank behind it (sharded state: shard_replica)
MAX_PEER_HEADER_BYTES = 16 * 1024 * 1024  # a peer's header: the state's structure and plain data


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """How every rank of the attempt loads one DCP commit, decided alike on every rank from the
    same gathered flags: all from their own copies, or from memory with a peer's help, or all
    from storage (DCP's collective load). With a peer's help, a rank that holds its own copy uses
    it; one that holds a copy saved as another rank (renumbered by a replacement) uses its model
    and optimizer state and reads its own small state file from storage; one that holds none
    receives the state `sender` (the lowest rank holding a copy) broadcasts."""

    source: str  # this rank's: MEMORY, PEER or STORAGE
    sender: int = -1  # >= 0: the state is broadcast from this rank (some rank holds no copy)
    own_rank_state: bool = True  # MEMORY: the copy's rank state is this rank's (else from storage)


def plan_load(flags: list[int], rank: int) -> LoadPlan:
    """The plan, from every rank's flags (`flags[r]` is rank r's)."""
    if all(f & _HOLDS for f in flags):
        return LoadPlan(MEMORY)
    holders = [r for r, f in enumerate(flags) if f & (_HOLDS | _HOLDS_STATE)]
    if not holders or not all(f & _WHOLE and f & _PEER_OK for f in flags):
        return LoadPlan(STORAGE)
    sender = holders[0] if len(holders) < len(flags) else -1
    mine = flags[rank]
    if mine & _HOLDS:
        return LoadPlan(MEMORY, sender)
    if mine & _HOLDS_STATE:
        return LoadPlan(MEMORY, sender, own_rank_state=False)
    return LoadPlan(PEER, sender, own_rank_state=False)


class BuddyShards(Protocol):
    """Where a rank of sharded state that holds no copy of a commit gets its shard: its buddy's
    memory (nodeagent.trainer.shard_replica.HeldShards; the caller gives it, this module sits
    below that one)."""

    def wait(self) -> None:
        """Until the exchanges with the buddies this attempt started have ended."""

    def holds(self, owner: int, attempt: int, step: int) -> bool:
        """Whether this rank holds rank `owner`'s shard of the commit of `step` attempt `attempt` saved."""

    def fetch(self, donors: tuple[int, ...], attempt: int, step: int, local: int) -> tuple[Any, str]:
        """Every rank: move the shards `donors` names (rank r's from rank donors[r]). (this rank's
        state with its shard received, or None if it took none; why it refused its shard, or "")."""


def shard_donors(flags: list[int], local: int) -> tuple[int, ...] | None:
    """For sharded state some rank holds no copy of: where each rank's shard comes from (itself,
    or its buddy, the rank `local` after it, which holds it), or None if some rank's shard is held
    by neither or a rank may not take its state from a peer. The same on every rank."""
    world = len(flags)
    if all(f & _HOLDS for f in flags) or not all(f & _PEER_OK for f in flags):
        return None
    donors = []
    for r, f in enumerate(flags):
        buddy = (r + local) % world
        if f & _HOLDS:
            donors.append(r)
        elif buddy != r and flags[buddy] & _HOLDS_SHARD:
            donors.append(buddy)
        else:
            return None
    return tuple(donors)


def restore_committed_dcp(
    commit: Any,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    rank: int,
    restore_rng: bool,
    from_peer: bool = True,
    buddies: BuddyShards | None = None,
) -> tuple[Any, Any] | None:
    """Serve the load of DCP commit `commit` from memory, this rank's or a peer's: (data_state,
    extra), or None when every rank must load from storage (nodeagent.trainer.dcp.load_dcp). A collective
    on the default group: every rank of the attempt calls it, and every rank takes the same way.

    A DCP commit (the default format; its load is a collective) is served by `restore_committed_dcp`,
    one plan agreed by every rank of the attempt: all from their own copies (every host kept its
    processes); or, when the replacement host's fresh ranks hold none and the state is whole on every
    rank (DDP's replicas), those ranks receive the lowest holder's copy over the attempt's own process
    group (a peer), the others use their own; else all from storage, which stays the truth on disk.
    Which source served the load is remembered (`loaded_from`) and the progress reporter sends it
    with its load mark, so the event log says per attempt where the state came from ("memory",
    "peer", "storage"). Two copies are kept per process (the newest; KEEP says why).

    Without every rank holding its own copy, memory serves only state every rank holds in full
    (DDP's replicas; the commit's `.metadata` says so: dcp_format.whole_tensors_bytes): the replacement
    host's ranks, which hold no copy, receive the lowest holder's model and optimizer state over
    the process group (the attempt's own, fenced by its rendezvous: `send_state` says how, and how
    it is checked), and a rank whose number changed uses its own copy's; both read only their own
    small state file (RNG, data position, scheduler) from storage. If any receiver finds the
    offered state wrong, every rank loads from storage instead. Sharded state (FSDP, DTensor)
    cannot come from one peer: with `buddies`, a rank without its copy takes its shard from its
    buddy, which holds it (nodeagent.trainer.shard_replica; checked against its checksums), and
    reads its own state file from storage; if some rank's shard has no holder, or one is refused,
    every rank loads from storage."""
    from nodeagent.trainer.checkpoint import CheckpointError

    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    by = commit.meta.get("attempt")
    by = by if isinstance(by, int) else None
    held = _checked(commit.step, by, rank=rank, world_size=world_size)
    payload = clone_payload(held.payload) if held is not None else None
    plan = LoadPlan(MEMORY if payload is not None else STORAGE)
    if payload is None and (why := why_not_kept(commit.step)):
        log.info("rank %d: no copy of step %d in this process's memory: %s", rank, commit.step, why)
    expected: int | None = None
    if world_size > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            plan = LoadPlan(STORAGE)
        else:
            if held is None:
                held = _checked(commit.step, by, rank=None, world_size=None)
                other = clone_payload(held.payload) if held is not None else None
            else:
                other = None
            if from_peer:
                try:
                    expected = dcp_format.whole_tensors_bytes(dcp_format.read_dcp_metadata(commit))
                except CheckpointError as exc:
                    log.warning("rank %d: no state from a peer: %s", rank, exc)
            if buddies is not None:
                buddies.wait()  # this commit's exchange may be ending; a fetch uses the same groups
            local = local_world_size()
            behind = (rank - local) % world_size
            mine = (
                (_HOLDS if payload is not None else 0)
                | (_HOLDS_STATE if other is not None else 0)
                | (_WHOLE if expected is not None else 0)
                | (_PEER_OK if from_peer else 0)
                | (
                    _HOLDS_SHARD
                    if buddies is not None and by is not None and buddies.holds(behind, by, commit.step)
                    else 0
                )
            )
            flags = gather_ints(mine, world_size)
            plan = plan_load(flags, rank)
            if other is not None:
                payload = other
            donors = shard_donors(flags, local) if plan.source == STORAGE else None
            if donors is not None and buddies is not None and by is not None:
                plan, payload = _shards_from_buddies(
                    buddies, commit, donors, payload, by=by, rank=rank, world_size=world_size, local=local
                )
    if plan.sender >= 0:
        assert expected is not None
        ok, received = send_state(
            payload,
            plan.sender,
            rank=rank,
            expected=expected,
            receive=plan.source == PEER,
            digests=held.digests if held is not None else (),
        )
        if not ok:
            fell_back(
                commit.step,
                f"the state rank {plan.sender} offered of step {commit.step} was refused by a receiver "
                "(its size or its checksum): every rank loads from storage",
            )
            plan = LoadPlan(STORAGE)
        elif plan.source == PEER:
            payload = {"state": received}
    if plan.source == STORAGE:
        loaded(commit.step, STORAGE)
        return None
    assert payload is not None  # MEMORY: it holds a copy; PEER: it received one
    if not plan.own_rank_state:
        payload = {"state": payload["state"], "rank_state": dcp_format.read_rank_state(commit, rank)}
    log.info("rank %d: state of step %d from %s", rank, commit.step, plan.source)
    result = restore_dcp(
        payload, commit.path, model=model, optimizer=optimizer, scheduler=scheduler, restore_rng=restore_rng
    )
    loaded(commit.step, plan.source)
    return result


def _shards_from_buddies(
    buddies: BuddyShards,
    commit: Any,
    donors: tuple[int, ...],
    payload: Any,
    *,
    by: int,
    rank: int,
    world_size: int,
    local: int,
) -> tuple[LoadPlan, Any]:
    """Every rank: the ranks without their copy of sharded commit `commit` take their shards from
    the buddies `donors` names. (the plan, this rank's payload): PEER for a rank that received its
    shard, MEMORY for one that holds its own; STORAGE for all if any rank refused its shard."""
    missing = donors[rank] != rank
    state, refused = buddies.fetch(donors, by, commit.step, local)
    if min(gather_ints(int(not refused and (state is not None or not missing)), world_size)) != 1:
        fell_back(
            commit.step,
            f"a shard of step {commit.step} from a buddy's memory was refused"
            + (f" (this rank: {refused})" if refused else "")
            + ": every rank loads from storage",
        )
        return LoadPlan(STORAGE), payload
    if missing:
        return LoadPlan(PEER, own_rank_state=False), {"state": state}
    return LoadPlan(MEMORY), payload


def _device(group: Any = None) -> str:
    import torch.distributed as dist

    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"


def gather_ints(value: int, world_size: int, group: Any = None) -> list[int]:
    """Every rank's `value` of `group` (default: the default group), in rank order."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([value], dtype=torch.int64, device=_device(group))
    out = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(out, mine, group=group)
    return [int(t.item()) for t in out]


def gather_rows(row: list[int], world_size: int, group: Any = None) -> list[list[int]]:
    """Every rank's `row` of integers (the same length on every rank), in rank order."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(row, dtype=torch.int64, device=_device(group))
    out = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(out, mine, group=group)
    return [[int(v) for v in t.tolist()] for t in out]


def _everyone(ok: bool, world_size: int) -> bool:
    """Whether `ok` holds on every rank (a MIN all-reduce)."""
    return min(gather_ints(int(ok), world_size)) == 1


_SLOT = "__runwarden_tensor__"  # a tensor's place in the skeleton a peer sends: {_SLOT: index}


def _split(state: Any) -> tuple[Any, list[Any]]:
    """`state` with every tensor replaced by its slot, and the tensors in slot order."""
    import torch

    tensors: list[Any] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return {_SLOT: len(tensors) - 1}
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(state), tensors


def _join(skeleton: Any, tensors: list[Any]) -> Any:
    """The inverse of `_split` (a slot out of range raises ValueError)."""

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if set(x) == {_SLOT}:
                i = x[_SLOT]
                if not (isinstance(i, int) and 0 <= i < len(tensors)):
                    raise ValueError(f"tensor slot {i!r} out of range")
                return tensors[i]
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(skeleton)


def _specs_bytes(specs: Any) -> int | None:
    """The bytes the tensor specs [(shape, dtype name), ...] a peer sent describe, None if malformed."""
    import torch

    total = 0
    if not isinstance(specs, list):
        return None
    for spec in specs:
        if not (isinstance(spec, (list, tuple)) and len(spec) == 2):
            return None
        shape, name = spec
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        if not isinstance(dtype, torch.dtype) or not isinstance(shape, (list, tuple)):
            return None
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            return None
        total += math.prod(shape) * dtype.itemsize
    return total


def send_state(
    payload: Any, sender: int, *, rank: int, expected: int, receive: bool, digests: Any = ()
) -> tuple[bool, Any]:
    """Broadcast the sender's kept state (`payload["state"]`) on the default group (the holders
    take part, and drop it): first a small header (the state with its tensors replaced by slots,
    and each tensor's shape and dtype), read with torch's weights_only unpickler and checked by
    every rank (bounded; its tensors add up to the commit's `expected` bytes), then one flat
    buffer per dtype, received in place and cut into the tensors, each checked against the
    checksum the sender's copy took of it when it landed (in the header). (every rank agrees the header
    is good, the state where `receive`), or (False, None) on every rank if any refused."""
    import io

    import torch
    import torch.distributed as dist

    device = _device()
    header, tensors = b"", list[Any]()
    if rank == sender:
        skeleton, tensors = _split(payload["state"])
        offer = [(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]
        # the checksum of each tensor taken when the copy landed (its tensors come first in the copy's
        # order: the rank state holds none), which `_checked` just found the copy still matches
        offered: list[str] = list(digests)[: len(tensors)]
        if len(offered) != len(tensors):
            offered = [digest(t) for t in tensors]
        buf = io.BytesIO()
        torch.save({"skeleton": skeleton, "specs": offer, "xxh3": offered}, buf)
        header = buf.getvalue()
    size = len(header) if len(header) <= MAX_PEER_HEADER_BYTES else -1
    length = torch.tensor([size], dtype=torch.int64, device=device)
    dist.broadcast(length, src=sender)
    n = int(length.item())
    if n < 0:
        return False, None
    data = (
        torch.frombuffer(bytearray(header), dtype=torch.uint8)
        if rank == sender
        else torch.empty(n, dtype=torch.uint8)
    )
    data = data.to(device)
    dist.broadcast(data, src=sender)
    doc: Any = None
    if rank != sender:
        try:
            doc = torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True)
        except Exception as exc:
            log.warning("rank %d: the header rank %d sent is not plain data: %s", rank, sender, exc)
    specs: Any = doc.get("specs") if isinstance(doc, dict) else None
    sums: Any = doc.get("xxh3") if isinstance(doc, dict) else None
    ok = rank == sender or (
        _specs_bytes(specs) == expected
        and "skeleton" in doc
        and isinstance(sums, list)
        and len(sums) == len(specs)
        and all(is_xxh3(x) for x in sums)
    )
    if rank != sender and not ok:
        log.warning(
            "rank %d: the state rank %d offers does not match the commit's %d bytes", rank, sender, expected
        )
    if not _everyone(ok, dist.get_world_size()):
        return False, None
    layout: list[tuple[list[int], torch.dtype]] = (
        [(list(t.shape), t.dtype) for t in tensors]
        if rank == sender
        else [(list(shape), getattr(torch, name)) for shape, name in specs]
    )
    received: list[Any] = [None] * len(layout)
    intact = True
    for dtype in dict.fromkeys(d for _, d in layout):
        slots = [i for i, (_, d) in enumerate(layout) if d == dtype]
        if rank == sender:  # the kept copy is in host memory: so is this
            flat = torch.cat([tensors[i].detach().reshape(-1).cpu() for i in slots])
        else:
            flat = torch.empty(sum(math.prod(layout[i][0]) for i in slots), dtype=dtype)
        _broadcast_host(flat, sender, rank=rank, device=device)
        if not receive:
            continue
        at = 0
        for i in slots:
            k = math.prod(layout[i][0])
            received[i] = flat[at : at + k].view(layout[i][0])
            at += k
            # each tensor must match the sender's checksum of it (a transfer that garbled it is refused)
            if intact and digest(received[i]) != sums[i]:
                intact = False
                log.warning("rank %d: tensor %d rank %d sent does not match its checksum", rank, i, sender)
    if not _everyone(intact, dist.get_world_size()):
        return False, None
    if not receive:
        return True, None
    try:
        return True, _join(doc["skeleton"], received)
    except ValueError as exc:  # every receiver parsed the same header: all of them fail alike
        raise RuntimeError(f"rank {rank}: the state rank {sender} sent: {exc}") from None


STAGE_BYTES = 64 * 1024 * 1024  # under NCCL, a peer's state crosses the GPU in chunks of this size


def _broadcast_host(
    flat: Any, sender: int, *, rank: int, device: str, stage_bytes: int | None = None
) -> None:
    """Broadcast a host tensor in place: directly on a CPU backend (gloo); under NCCL through one
    GPU staging buffer of at most STAGE_BYTES, so the state never occupies the GPU whole
    (`stage_bytes`: stage through `device` in chunks of that size, whatever the device)."""
    import torch
    import torch.distributed as dist

    if device == "cpu" and stage_bytes is None:
        dist.broadcast(flat, src=sender)
        return
    step = max(1, min(flat.numel(), (stage_bytes or STAGE_BYTES) // flat.element_size()))
    stage = torch.empty(step, dtype=flat.dtype, device=device)
    for at in range(0, flat.numel(), step):
        n = min(step, flat.numel() - at)
        if rank == sender:
            stage[:n].copy_(flat[at : at + n])
        dist.broadcast(stage[:n], src=sender)
        if rank != sender:
            flat[at : at + n].copy_(stage[:n])
    del stage


def restore_dcp(
    payload: Any, path: Path, *, model: Any, optimizer: Any, scheduler: Any, restore_rng: bool
) -> tuple[Any, Any]:
    """Put a kept DCP save (`{"state": <model/optim state dicts>, "rank_state": <its JSON>}`) into
    model, optimizer and scheduler, and the RNG states; returns (data_state, extra)."""
    state, rank_state = payload["state"], payload["rank_state"]
    restore = dcp_format.rng_restorer(rank_state.get("rng"), path) if restore_rng else None
    restore_state(state, model=model, optimizer=optimizer)
    if scheduler is not None and rank_state.get("scheduler") is not None:
        scheduler.load_state_dict(rank_state["scheduler"])
    if restore is not None:
        restore()
    return rank_state.get("data_state"), rank_state.get("extra")


def restore_state(state: Any, *, model: Any, optimizer: Any) -> None:
    """Put a kept model (and optimizer) state into the model (and optimizer)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def loaded(step: int, source: str) -> None:
    """Record which source served the load of `step` (the reporter's load mark sends it)."""
    global _loaded
    with _lock:
        _loaded = (step, source)


def loaded_from(step: int) -> str:
    """The source of this process's last load if it loaded `step`, else ""."""
    with _lock:
        last = _loaded
    return last[1] if last is not None and last[0] == step else ""


def snapshot(
    step: int,
    attempt: int,
    *,
    env: Mapping[str, str] | None = None,
    checked: bool = False,
    kind: str = SNAPSHOT,
) -> MemoryCopy | None:
    """The snapshot (or `kind` copy) of `step` attempt `attempt` of this run took, saved as any
    rank, if this process holds it (`checked`: landed and still matching its digests, as a load
    needs it)."""
    if checked:
        return _checked(step, attempt, rank=None, world_size=None, env=env, kind=kind)
    run, _ = _identity(os.environ if env is None else env)
    with _lock:
        return next(
            (x for x in _copies if (x.kind, x.run, x.attempt, x.step) == (kind, run, attempt, step)), None
        )


def kept_steps() -> tuple[int, ...]:
    """The steps of the kept copies of commits, oldest first."""
    with _lock:
        return tuple(x.step for x in _copies if x.kind == COMMIT)


def copy_keys(kind: str = SNAPSHOT) -> set[tuple[str, int, int]]:
    """(run, attempt, step) of every copy of `kind` this process holds."""
    with _lock:
        return {(x.run, x.attempt, x.step) for x in _copies if x.kind == kind}


def snapshot_steps(attempt: int, env: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """The steps of the snapshots this process holds that attempt `attempt` of this run took."""
    run, _ = _identity(os.environ if env is None else env)
    with _lock:
        return tuple(x.step for x in _copies if x.kind == SNAPSHOT and (x.run, x.attempt) == (run, attempt))
