"""In-memory snapshots between durable commits: the training script's side.

    snapshots = Snapshotter(reporter=reporter)           # after init_process_group; every rank
    for step in ...:
        ...; opt.step(); done = step + 1
        if done % ckpt_every == 0: saver.save(done, ...)  # the durable commit: the truth on disk
        elif snapshots.due(done): snapshots.take(done, model=ddp, optimizer=opt, data_state={...})

Every `snapshot_interval_s` of steps (the controller's policy, RUNWARDEN_SNAPSHOT_INTERVAL_S at each
launch: the ranks time their first steps and agree once on how many steps that is; or every
RUNWARDEN_SNAPSHOT_EVERY steps; 0: none; a cold launch takes none) each rank copies its model and
optimizer state into host memory (`memory_state.keep`, kind SNAPSHOT: the newest three are kept, in buffers reused from snapshot to
snapshot) and its rank state (RNG states, data position, scheduler: small JSON) too, and sends that
rank state to its buddy, the same local rank on the next host ((rank + local world size) mod world
size), which keeps it. A snapshot is never written to storage.

Who holds what, so that a lost host's state survives: a rank's model and optimizer state in DDP
is a replica every rank holds; its rank state is held by itself and its buddy on another host.
Sharded state (FSDP, DTensor) is each rank's own: its shard goes to the buddy's host memory too
(nodeagent.trainer.shard_replica, on a thread once the copy has landed: the snapshot counts as
complete, and is reported, once the shard of the rank behind is held). The controller chooses the
resume point from the ranks' reports (RankProgress.snapshot_steps, the complete snapshots each holds): the
newest snapshot for which every rank's state has a holder among the next attempt's hosts
(controller/supervisor/snapshots.py), else the newest commit; it launches with RUNWARDEN_RESUME_STEP and RUNWARDEN_RESUME_SNAPSHOT (the attempt that took it).

`resume_point` returns a `SnapshotPoint` then, and `load_checkpoint` serves it with `restore`, a
collective: every rank says what it holds, every rank computes the same plan (the model and
optimizer from its own copy or, for a rank without one, a holder's broadcast, checksum checked as a
commit's peer load is, or a sharded state's shard from the buddy that holds it; each rank's rank
state from itself or from its buddy, over a ring),
and where any rank's state has no holder every rank raises `SnapshotUnavailable`: the reporter
tells the controller, which relaunches from the newest commit.

The copy's stall: the host copy runs on a thread (at the lowest priority, its digests after it)
while the next step's forward and backward read the same tensors; the optimizer's next step waits for it (a step pre-hook), so the state copied is
the state at `step`. Anything else that changes the model or optimizer state in between (an EMA
update outside the optimizer) must call `wait()` first.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from nodeagent.trainer import memory_state, shard_replica
from nodeagent.trainer.checkpoint import CheckpointError
from nodeagent.trainer.dcp_format import MAX_RANK_STATE_BYTES, rng_restorer
from nodeagent.trainer.dcp_format import rank_state as own_state

log = logging.getLogger(__name__)

FORMAT = "snapshot"  # a snapshot's rank state says so (a commit's says "dcp")
SNAPSHOT_EVERY_ENV = "RUNWARDEN_SNAPSHOT_EVERY"  # steps (an override of the interval)
SNAPSHOT_INTERVAL_ENV = "RUNWARDEN_SNAPSHOT_INTERVAL_S"  # seconds; the policy's snapshot_interval_s
CALIBRATION_STEPS = 5  # steps timed before the ranks agree on how many steps make the interval
RESUME_SNAPSHOT_ENV = "RUNWARDEN_RESUME_SNAPSHOT"


class SnapshotUnavailable(CheckpointError):
    """Some rank's state of the snapshot being resumed has no holder (every rank raises it)."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True, slots=True)
class SnapshotPoint:
    """The in-memory snapshot the supervisor resumes this attempt from."""

    step: int
    attempt: int  # the attempt that took it


def resume_snapshot(env: Mapping[str, str], step: int) -> SnapshotPoint | None:
    """The snapshot the launch names (RUNWARDEN_RESUME_SNAPSHOT, with the resume step), else None."""
    raw = env.get(RESUME_SNAPSHOT_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise CheckpointError(f"{RESUME_SNAPSHOT_ENV}={raw!r} is not an attempt number")
    return SnapshotPoint(step=step, attempt=int(raw))


def every_from_env(env: Mapping[str, str]) -> int | None:
    """RUNWARDEN_SNAPSHOT_EVERY's steps (0: no snapshots), None if unset."""
    raw = env.get(SNAPSHOT_EVERY_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"{SNAPSHOT_EVERY_ENV}={raw!r}: a number of steps >= 0")
    return int(raw)


def interval_from_env(env: Mapping[str, str]) -> float:
    """RUNWARDEN_SNAPSHOT_INTERVAL_S's seconds (0, or unset: no snapshots)."""
    raw = env.get(SNAPSHOT_INTERVAL_ENV, "").strip() or "0"
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{SNAPSHOT_INTERVAL_ENV}={raw!r}: a finite number of seconds >= 0")
    return value


def steps_for(interval_s: float, step_times: list[float]) -> int:
    """How many steps of the median of `step_times` make `interval_s` (at least 1)."""
    median = statistics.median(step_times)
    return max(1, round(interval_s / median)) if median > 0 else 1


# (run, attempt, step, rank) -> that rank's state as it sent it to this rank, its buddy
_buddy_states: dict[tuple[str, int, int, int], dict[str, Any]] = {}


def _dist() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _identity(env: Mapping[str, str]) -> tuple[str, int]:
    attempt = env.get("RUNWARDEN_ATTEMPT", "")
    return env.get("RUNWARDEN_RUN", ""), int(attempt) if attempt.isdigit() else -1


class Snapshotter:
    """Takes this rank's snapshots (see the module's doc); one per rank, made by every rank."""

    def __init__(
        self,
        *,
        every: int | None = None,
        interval_s: float | None = None,
        reporter: Any = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`every` steps (default RUNWARDEN_SNAPSHOT_EVERY), else every `interval_s` seconds (default
        RUNWARDEN_SNAPSHOT_INTERVAL_S, the policy's): the ranks time their first CALIBRATION_STEPS
        steps and agree once (a MAX all-reduce inside that `due()` call) on the steps it takes."""
        self.env = os.environ if env is None else env
        chosen = every_from_env(self.env) if every is None else every
        self.interval_s = interval_from_env(self.env) if interval_s is None else interval_s
        if chosen is not None and (not isinstance(chosen, int) or chosen < 0):
            raise ValueError(f"snapshot every: a number of steps >= 0, got {chosen!r}")
        self.every = chosen if chosen is not None else 0
        self._marks: list[float] | None = (
            [] if chosen is None and self.interval_s > 0 else None
        )  # step boundaries timed until the ranks agree on `every`
        if self.env.get("RUNWARDEN_LAUNCH_PATH", "") != memory_state.WARM:
            # a cold launch's processes end with the attempt: no snapshot would outlive the failure
            # it is for (every rank of an attempt takes the same path)
            self.every, self._marks = 0, None
        self.reporter = reporter
        self.rank, self.world_size = _dist()
        self.local_world_size = memory_state.local_world_size(self.env)
        self._landing: Any = None  # the copy now landing (its `copied` event)
        self._hooked: set[int] = set()  # the optimizers whose step waits for the copy
        # step -> seconds take() blocked the training thread: in all, and in the exchange with the buddy
        self.stalls: dict[int, float] = {}
        self.exchanges: dict[int, float] = {}
        self._complete: set[int] = set()  # steps whose copy is kept and rank state with the buddy
        self._replications: dict[int, shard_replica.Replication] = {}  # step -> its shard's exchange
        self._reported: tuple[int, ...] = ()  # what the reporter was last told

    def due(self, step: int) -> bool:
        """Whether to snapshot after `step` steps; every rank calls it after every step (while the
        interval is being calibrated one of these calls is a collective)."""
        if self._marks is not None:
            self._marks.append(time.perf_counter())
            if len(self._marks) > CALIBRATION_STEPS:
                times = [b - a for a, b in zip(self._marks, self._marks[1:], strict=False)]
                self._marks = None
                mine = steps_for(self.interval_s, times)
                self.every = (
                    max(memory_state.gather_ints(mine, self.world_size)) if self.world_size > 1 else mine
                )
                log.info("rank %d: a snapshot every %d steps (%g s)", self.rank, self.every, self.interval_s)
        if self._replications:
            self._report()  # a shard's exchange may have ended since
        return self.every > 0 and step > 0 and step % self.every == 0

    def buddy(self) -> int:
        """The rank that keeps this rank's rank state: the same local rank on the next host."""
        return (self.rank + self.local_world_size) % self.world_size

    def wait(self) -> None:
        """Until the copy now landing has landed (the optimizer's step calls it)."""
        landing = self._landing
        if landing is not None:
            landing.wait(memory_state.COPY_WAIT_S)
            self._landing = None

    def wait_replicated(self, timeout_s: float = shard_replica.PAIR_TIMEOUT_S) -> bool:
        """Until every sharded snapshot's exchange with the buddies has ended (and is reported):
        whether they all ended within `timeout_s`."""
        ended = all(job.done.wait(timeout_s) for job in list(self._replications.values()))
        self._report()
        return ended

    def _report(self) -> None:
        """Tell the reporter the complete snapshots this rank holds, if they changed: kept, the rank
        state with the buddy, and for sharded state the shard of the rank behind held here."""
        _, attempt = _identity(self.env)
        held = memory_state.snapshot_steps(attempt, env=self.env)
        for old in [s for s in self._replications if s not in held]:
            del self._replications[old]
        self._complete &= set(held)
        steps = tuple(
            s
            for s in held
            if s in self._complete
            and ((job := self._replications.get(s)) is None or (job.done.is_set() and not job.why))
        )
        if steps != self._reported and self.reporter is not None:
            self.reporter.set_snapshots(steps)
        self._reported = steps

    def take(
        self,
        step: int,
        *,
        model: Any,
        optimizer: Any = None,
        scheduler: Any = None,
        data_state: Any = None,
        extra: Any = None,
    ) -> str:
        """Snapshot `step` (steps completed): "" once this rank's copy is kept and its buddy holds
        its rank state, else why not. A collective (every rank, the same step). `data_state`,
        `extra` and the scheduler's state_dict() must be JSON data."""
        from nodeagent.trainer.dcp import model_and_optim_state

        started = time.perf_counter()
        self.wait()  # the previous copy's buffers may be reused now
        shard_replica.wait_all()  # one exchange with the buddies at a time (a commit's too)
        run, attempt = _identity(self.env)
        rank_state = own_state(
            FORMAT, step, self.rank, self.world_size, scheduler=scheduler, data_state=data_state, extra=extra
        )
        body = json.dumps(rank_state, allow_nan=False).encode()
        state = model_and_optim_state(model, optimizer)
        sharded = memory_state.is_sharded(state)  # the same on every rank
        why = memory_state.keep(
            step,
            {"state": state, "rank_state": rank_state},
            rank=self.rank,
            world_size=self.world_size,
            env=self.env,
            kind=memory_state.SNAPSHOT,
            in_background=True,
            # the shards this rank holds for the rank behind share its copy budget
            budget_bytes=max(0, memory_state.budget() - shard_replica.held_bytes()) if sharded else None,
        )
        held = memory_state.snapshot(step, attempt, env=self.env)
        if held is not None:
            self._landing = held.copied
            if optimizer is not None and id(optimizer) not in self._hooked:
                optimizer.register_step_pre_hook(lambda *_: self.wait())
                self._hooked.add(id(optimizer))
        sent = body if not why else b""
        exchange_started = time.perf_counter()
        if self.buddy() != self.rank:  # one host: no other host to keep it
            received = _ring(sent, self.buddy(), (self.rank - self.local_world_size) % self.world_size)
            owner = (self.rank - self.local_world_size) % self.world_size
            kept_theirs = _keep_buddy_state(received, run, attempt, step, owner)
            if not received:
                why = why or f"rank {owner} sent no state of step {step}"
            elif not kept_theirs:
                why = why or f"rank {owner}'s state of step {step} is not its snapshot"
            if sharded:  # its shard to the buddy too, off this thread
                ring = shard_replica.ring_place(self.rank, self.world_size, self.local_world_size)
                self._replications[step] = shard_replica.replicate(
                    held, step, run=run, attempt=attempt, ring=ring
                )
        ended = time.perf_counter()
        self.stalls[step], self.exchanges[step] = ended - started, ended - exchange_started
        for old in sorted(self.stalls)[:-8]:
            del self.stalls[old], self.exchanges[old]
        if not why:
            self._complete.add(step)
        else:
            log.warning("rank %d: snapshot of step %d incomplete: %s", self.rank, step, why)
        self._report()
        return why


def _device() -> str:
    import torch.distributed as dist

    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _ring(body: bytes, to: int, source: int) -> bytes:
    """Send `body` to rank `to` and receive what rank `source` sends this rank (lengths first).
    Every rank sends one message and receives one in each of the two rounds, whatever it has to
    say (an empty body goes as one byte): the default group's collective count, which counts
    point-to-point messages too, stays the same on every rank (the collective hang rule compares it)."""
    import torch
    import torch.distributed as dist

    device = _device()
    out_n = torch.tensor([len(body)], dtype=torch.int64, device=device)
    in_n = torch.zeros(1, dtype=torch.int64, device=device)
    for work in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, out_n, to), dist.P2POp(dist.irecv, in_n, source)]
    ):
        work.wait()
    n = int(in_n.item())
    if not 0 <= n <= MAX_RANK_STATE_BYTES:
        raise CheckpointError(f"rank {source} announced a rank state of {n} bytes")
    out = torch.frombuffer(bytearray(body or b"\0"), dtype=torch.uint8).to(device)
    into = torch.empty(max(n, 1), dtype=torch.uint8, device=device)
    for work in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, out, to), dist.P2POp(dist.irecv, into, source)]
    ):
        work.wait()
    return into[:n].cpu().numpy().tobytes() if n else b""


def _is_rank_state(doc: Any, step: int, rank: int) -> TypeGuard[dict[str, Any]]:
    """Whether `doc` is rank `rank`'s snapshot rank state of `step`."""
    return isinstance(doc, dict) and (doc.get("format"), doc.get("step"), doc.get("rank")) == (
        FORMAT,
        step,
        rank,
    )


def _parse_rank_state(raw: bytes, step: int, rank: int) -> dict[str, Any] | None:
    """A rank state another rank sent, if it is rank `rank`'s snapshot state of `step`."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return doc if _is_rank_state(doc, step, rank) else None


def _keep_buddy_state(raw: bytes, run: str, attempt: int, step: int, owner: int) -> bool:
    """Keep `owner`'s rank state of this snapshot; a buddy's state lives as long as this process's
    own snapshot of the same step (memory_state drops the oldest)."""
    doc = _parse_rank_state(raw, step, owner) if raw else None
    if doc is not None:
        _buddy_states[(run, attempt, step, owner)] = doc
    held = memory_state.copy_keys() | {(run, attempt, step)}
    for key in [k for k in _buddy_states if k[:3] not in held]:
        del _buddy_states[key]
    return doc is not None


def buddy_states(run: str, attempt: int, step: int) -> dict[int, dict[str, Any]]:
    """The rank states of snapshot `step` of (run, attempt) this process keeps for other ranks."""
    return {k[3]: v for k, v in _buddy_states.items() if k[:3] == (run, attempt, step)}


def restore(
    point: SnapshotPoint,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    rank: int,
    restore_rng: bool,
    env: Mapping[str, str] | None = None,
) -> tuple[Any, Any]:
    """Load snapshot `point` into model, optimizer and scheduler, and the RNG states: (data_state,
    extra). A collective on the default group; SnapshotUnavailable on every rank if some rank's
    state has no holder or a transfer was refused."""
    from pathlib import Path

    import torch.distributed as dist

    from nodeagent.trainer.dcp import model_and_optim_state

    env = os.environ if env is None else env
    run, _ = _identity(env)
    world = dist.get_world_size() if dist.is_initialized() else 1
    held = memory_state.snapshot(point.step, point.attempt, env=env, checked=True)
    theirs = buddy_states(run, point.attempt, point.step)
    buddy_rank, buddy_doc = next(iter(sorted(theirs.items())), (-1, None))
    # what this rank tells the others (one row, all-gathered): the rank its copy was taken as (-1:
    # none), whether its state is whole (a replica), the copy's bytes, the rank whose rank state it
    # keeps as its buddy (-1: none), whether it holds that rank's shard too
    mine = [
        held.rank if held is not None else -1,
        int(held.whole) if held is not None else 0,
        held.nbytes if held is not None else 0,
        buddy_rank,
        int(buddy_rank >= 0 and shard_replica.held(run, point.attempt, point.step, buddy_rank) is not None),
    ]
    flat = memory_state.gather_rows(mine, world) if world > 1 else [mine]
    local = memory_state.local_world_size(env)
    plan, why = plan_snapshot_load(flat, rank, local)
    if plan is None:
        raise SnapshotUnavailable(
            point.step, f"snapshot of step {point.step} (attempt {point.attempt}): {why}"
        )
    payload: Any = memory_state.clone_payload(held.payload) if held is not None else None
    source = memory_state.MEMORY
    if plan.sender >= 0:
        ok, received = memory_state.send_state(
            payload,
            plan.sender,
            rank=rank,
            expected=flat[plan.sender][2],
            receive=held is None,
            digests=held.digests if held is not None else (),
        )
        if not ok:
            raise SnapshotUnavailable(
                point.step,
                f"the state rank {plan.sender} offered of snapshot {point.step} was refused by a receiver",
            )
        if held is None:
            payload = {"state": received}
            source = memory_state.PEER
    elif any(d != r for r, d in enumerate(plan.shard_donors)):  # sharded: a shard from the buddy
        shards = shard_replica.HeldShards(
            rank, run, lambda: model_and_optim_state(model, optimizer), kind=memory_state.SNAPSHOT
        )
        state, refused = shards.fetch(plan.shard_donors, point.attempt, point.step, local)
        if min(memory_state.gather_ints(int(not refused), world)) != 1:
            raise SnapshotUnavailable(
                point.step,
                f"a shard of snapshot {point.step} was refused by the rank it was for"
                + (f" (this rank: {refused})" if refused else ""),
            )
        if state is not None:
            payload = {"state": state}
            source = memory_state.PEER
    # each rank's own rank state: from its own copy, else from its buddy
    own = payload.get("rank_state") if held is not None and held.rank == rank else None
    if world > 1 and (local % world) != 0:
        got = _exchange_rank_states(plan.rank_state_donors, buddy_doc, rank, local, point.step)
        own = own if own is not None else got
    if not _is_rank_state(own, point.step, rank):
        raise SnapshotUnavailable(
            point.step, f"rank {rank}: its rank state of snapshot {point.step} did not arrive"
        )
    path = Path(f"<snapshot of step {point.step}, attempt {point.attempt}>")
    restore = rng_restorer(own.get("rng"), path) if restore_rng else None
    memory_state.restore_state(payload["state"], model=model, optimizer=optimizer)
    if scheduler is not None and own.get("scheduler") is not None:
        scheduler.load_state_dict(own["scheduler"])
    if restore is not None:
        restore()
    memory_state.loaded(point.step, source)
    return own.get("data_state"), own.get("extra")


@dataclass(frozen=True, slots=True)
class SnapshotLoadPlan:
    sender: int  # >= 0: the model and optimizer state (a replica) are broadcast from this rank
    rank_state_donors: tuple[int, ...]  # rank r's rank state comes from rank_state_donors[r]
    shard_donors: tuple[int, ...] = ()  # rank r's shard of a sharded state comes from shard_donors[r]


def plan_snapshot_load(rows: list[list[int]], rank: int, local: int) -> tuple[SnapshotLoadPlan | None, str]:
    """Every rank's plan from the gathered rows (`rows[r]` is rank r's; `local`: ranks per host), or
    (None, why not). A rank's own rank state, and its shard of a sharded state, come from its own
    copy, else from its buddy (the rank `local` after it, which keeps them): the one place the
    exchange's ring reaches. A replica comes from any holder."""
    world = len(rows)
    holders = [r for r, row in enumerate(rows) if row[0] >= 0]
    if not holders:
        return None, "no rank holds a copy"
    sender, shard_donors = -1, tuple(range(world))
    if any(rows[r][0] != r for r in range(world)):
        # some rank holds no copy of its own: a replica (the same size everywhere) from any holder,
        # a shard from the buddy that holds it
        if all(rows[r][1] for r in holders) and len({rows[r][2] for r in holders}) == 1:
            sender = holders[0] if len(holders) < world else -1
        else:
            shards = []
            for r in range(world):
                buddy = (r + local) % world
                if rows[r][0] == r:
                    shards.append(r)
                elif buddy != r and rows[buddy][3] == r and rows[buddy][4] == 1:
                    shards.append(buddy)
                else:
                    return None, (
                        f"rank {r}'s shard of the sharded state is held neither by it nor by its buddy {buddy}"
                    )
            shard_donors = tuple(shards)
    donors = []
    for r in range(world):
        buddy = (r + local) % world
        if rows[r][0] == r:
            donors.append(r)
        elif buddy != r and rows[buddy][3] == r:
            donors.append(buddy)
        else:
            return (
                None,
                f"rank {r}'s rank state (RNG, data position) is held neither by it nor by its buddy {buddy}",
            )
    return SnapshotLoadPlan(sender=sender, rank_state_donors=tuple(donors), shard_donors=shard_donors), ""


def _exchange_rank_states(
    donors: tuple[int, ...], kept_for: Any, rank: int, local: int, step: int
) -> dict[str, Any] | None:
    """Each rank sends the rank before it on the ring (`local` back) the state it keeps for it as its
    buddy, if that rank needs it, and receives its own from its buddy if it needs it (`_ring`: one
    message each way on every rank). Every rank calls it with the same `donors`."""
    world = len(donors)
    behind, ahead = (rank - local) % world, (rank + local) % world
    body = json.dumps(kept_for).encode() if donors[behind] == rank and behind != rank else b""
    try:
        got = _ring(body, behind, ahead)
    except CheckpointError as exc:
        raise SnapshotUnavailable(step, str(exc)) from None
    if donors[rank] == rank or not got:
        return None
    try:
        return json.loads(got)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
