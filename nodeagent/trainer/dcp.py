"""Checkpoints through torch.distributed.checkpoint (DCP), under runwarden's commit protocol.

    ckpt = DcpCheckpointer(root, reporter=reporter)     # collective: every rank, same order
    ckpt.save(step, model=ddp, optimizer=opt, scheduler=sched, data_state={"next_step": step})
    ...                                                 # async: training goes on while it uploads
    ckpt.wait()                                         # before exit (a stop request, the last step)
    found = resume_point(root); load_dcp(found, model=ddp, optimizer=opt, scheduler=sched)

Layout of one step (nodeagent.trainer.checkpoint's `step_<N>/`):

    __0_0.distcp __1_0.distcp ...   DCP's shards: model and optimizer, written by whichever rank
                                    DCP's planner assigns each tensor to (replicated DDP state is
                                    spread over the ranks, sharded FSDP/DTensor state stays sharded)
    .metadata                       DCP's index of the shards, written by its coordinator (rank 0)
    rank<r>.state.json              rank r's own state: RNG states, data position, scheduler, extra
    rank<r>.shards.json             the XXH3-128 of each shard rank r wrote (hashed by it, after its
                                    write, off the training thread when the save is async)
    COMMITTED                       the marker, written last by rank 0; its `shard_xxh3` is every
                                    rank's checksums, which every load from storage checks first

`save()` writes every rank's files, and rank 0 writes COMMITTED only once every one of them is
durable: a rank killed anywhere before leaves no marker, and the step is not there
(DcpCheckpointer says in which order). `load_dcp` validates what it reads before it trusts it (the
files come from storage, outside this process's control).

The old format (`step_N/rank<r>.pt`, nodeagent.trainer.save_checkpoint) stays readable: a
commit's `meta["format"]` says which one it is (`trainer.load_checkpoint` dispatches on it).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from nodeagent.trainer import (
    memory_state,  # the in-memory copy a warm restart may load from
    shard_replica,  # a sharded copy's second copy, in the buddy's memory
)
from nodeagent.trainer.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    CommittedCheckpoint,
    CorruptCheckpoint,
    mismatched,
    read_commit,
    shard_names,
    step_dir,
    xxh3_file,
)
from nodeagent.trainer.dcp_format import (
    DCP_METADATA,
    FORMAT,
    bad,
    load_metadata_pickle,
    rank_state_name,
    read_dcp_metadata,
    read_rank_state,
    read_shard_digests,
    rng_restorer,
    shard_digests_name,
    whole_tensors_bytes,
)
from nodeagent.trainer.dcp_format import rank_state as own_state
from nodeagent.trainer.torch_api import set_nested

log = logging.getLogger(__name__)


class SaveFailed(CheckpointError):
    """An async save failed after `save()` returned: no marker was written for `step`."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedState:
    """What a load gives back besides the model and optimizer it filled in."""

    step: int
    path: Path
    data_state: Any
    extra: Any


def _verified_reader(path: Path, metadata: Any) -> Any:
    """A FileSystemReader that hands DCP the metadata read and checked by read_dcp_metadata (the
    very bytes that were verified: the file is not read a second time)."""
    from torch.distributed.checkpoint import FileSystemReader

    class VerifiedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return VerifiedReader(path)


def _plain_data_planner() -> Any:
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class PlainDataLoadPlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner, but non-tensor values come back through torch's weights_only
        unpickler (plain data only), not torch.load(weights_only=False)."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_nested(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return PlainDataLoadPlanner()


# --- saving -----------------------------------------------------------------------------------


def _recording_digests(storage: Any, writer: CheckpointWriter, rank: int) -> Any:
    """`storage` (a DCP StorageWriter of files in the step directory) whose `write_data` also hashes
    the files it wrote and writes their digests to this rank's shard digest file (fsynced) before
    it answers. DCP gathers every rank's write results to its coordinator only once each rank's
    `write_data` answered, so when rank 0's save returns every rank's digest file is durable."""
    write = storage.write_data

    def write_data(plan: Any, planner: Any) -> Any:
        done = write(plan, planner)
        names = set()
        for result in done.wait():
            name = getattr(result.storage_data, "relative_path", None)
            if not isinstance(name, str):
                raise CheckpointError(f"{writer.path}: a write result names no file: {result.storage_data!r}")
            names.add(name)
        digests = {name: xxh3_file(writer.path / name) for name in sorted(names)}
        writer.write_bytes(shard_digests_name(rank), json.dumps(digests).encode())
        return done

    storage.write_data = write_data
    return storage


def _dist() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def model_and_optim_state(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _blocks_training(method: _Method) -> _Method:
    """`method(self, step, ...)` blocks the training thread on behalf of the save of `step`."""

    @functools.wraps(method)
    def measured(self: DcpCheckpointer, step: int, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._stalls.pop(step, None)  # a step saved again (after a rollback) starts from zero
        with self._blocking_for(step):
            return method(self, step, *args, **kwargs)

    return cast(_Method, measured)


class DcpCheckpointer:
    """Saves through DCP under the commit protocol; one per rank, made by every rank (it creates the
    saves' process group: a collective).

    `async_save` (default): `save()` blocks only while DCP stages a CPU copy of the state dict;
    the upload and the commit follow on a background thread. `reporter` (a ProgressReporter):
    rank 0 tells it each commit, and every rank tells it a failed save.

    Each save's stall is measured: the time the training thread spent blocked by it, that is in
    its `save()` call (less the wait there for the previous save, which is that save's) and in any
    `wait()` for it, up to its commit (`stall_s(step)`). It goes to the reporter with the commit
    (`set_committed(step, save_stall_s=...)`, the supervisor's save_duration_s, goodput's
    checkpoint_stall) and into the marker's meta as `save_stall_s` (rank 0's).

    Order of obligations in `save()`, and why the marker means "every rank's files are durable":

    1. Every rank un-commits the step (removes a marker left by an earlier save of the same step, fsyncs
       the directory), then writes and fsyncs its `rank<r>.state.json`.
    2. DCP's save (`async_save`: a CPU copy of the state dict is staged now, the upload runs on a
       background thread) plans collectively first, so no rank writes a shard before every rank has
       finished step 1. Each rank writes its shards and fsyncs them (FileSystemWriter sync_files);
       the coordinator gathers every rank's write results, and only then writes `.metadata` (fsynced,
       renamed into place). So the coordinator is the one rank that knows every rank is done: when
       its save completes, every shard and every state file (written before that rank's save began)
       is on disk.
    3. Rank 0, when its save's future completes, lists the shards `.metadata` names plus every
       rank's state and digest files with their sizes, hashes `.metadata`, takes every shard's
       XXH3-128 from the checksum files (each rank hashed what it wrote), and writes COMMITTED
       (nodeagent.trainer.checkpoint: temp file, fsync, rename, fsync dir); then tells the reporter
       (`set_committed`). A rank killed anywhere before that leaves no marker: the step is not there.

    One save is in flight at a time: `save()` first waits for the previous one. The saves use their
    own gloo process group, so the background thread's collectives never interleave with the
    training loop's (and async save needs a CPU backend anyway).
    """

    def __init__(
        self,
        root: Path | str,
        *,
        reporter: Any = None,
        async_save: bool = True,
        process_group: Any = None,
        storage_writer: Any = None,
    ) -> None:
        import torch.distributed as dist

        self.root = Path(root)
        self.reporter = reporter
        self.async_save = async_save
        self.rank, self.world_size = _dist()
        if process_group is None and self.world_size > 1:
            process_group = dist.new_group(backend="gloo")
        self.process_group = process_group
        # storage_writer(path) -> a DCP StorageWriter (default FileSystemWriter(path, sync_files=True));
        # it must make every file durable before its write_data returns.
        self._storage_writer = storage_writer
        self._pending: Future[CommittedCheckpoint | None] | None = None
        self._pending_step = -1
        self._lock = threading.Lock()
        self.last_commit: CommittedCheckpoint | None = None
        self._unconfirmed: list[int] = []  # steps this rank saved whose marker it has not seen yet
        self._stalls: dict[int, float] = {}  # step -> seconds its save blocked training (closed spans)
        self._blocked: tuple[int, float] | None = None  # (step, since): training blocked by it now

    @contextlib.contextmanager
    def _blocking_for(self, step: int) -> Iterator[None]:
        """Inside: the training thread's time is the stall of `step`'s save (an inner block, the
        wait in save() for the previous save, is the previous step's)."""
        outer = self._switch_blocked(step)
        try:
            yield
        finally:
            self._switch_blocked(outer)

    def _switch_blocked(self, step: int | None) -> int | None:
        """Close the open span (to its step's stall) and open one for `step`; the step it closed."""
        now = time.perf_counter()
        with self._lock:
            closed = self._blocked
            if closed is not None:
                self._stalls[closed[0]] = self._stalls.get(closed[0], 0.0) + now - closed[1]
                for old in sorted(self._stalls)[:-8]:  # bounded: a step's stall is reported at its commit
                    del self._stalls[old]
            self._blocked = (step, now) if step is not None else None
        return closed[0] if closed is not None else None

    def stall_s(self, step: int) -> float:
        """Seconds the training thread has been blocked by the save of `step` so far (0: none)."""
        now = time.perf_counter()
        with self._lock:
            stall = self._stalls.get(step, 0.0)
            if self._blocked is not None and self._blocked[0] == step:
                stall += now - self._blocked[1]
        return stall

    @_blocks_training
    def save(
        self,
        step: int,
        *,
        model: Any,
        optimizer: Any = None,
        scheduler: Any = None,
        data_state: Any = None,
        extra: Any = None,
    ) -> CommittedCheckpoint | None:
        """Save `step` (steps completed). Synchronous: returns the commit on rank 0 (None elsewhere).
        Async: returns None; the commit follows (`wait()`, `last_commit`, the reporter).

        `data_state`, `extra` and the scheduler's state_dict() must be JSON data. Raises
        CheckpointError (or OSError) if this save cannot start or the previous one failed."""
        from torch.distributed.checkpoint import FileSystemWriter, async_save, save

        self.wait()
        self._confirm_commits()
        writer = CheckpointWriter(self.root, step)  # un-commits the step (every rank, before any write)
        rank_state = own_state(
            FORMAT, step, self.rank, self.world_size, scheduler=scheduler, data_state=data_state, extra=extra
        )
        try:
            body = json.dumps(rank_state, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{writer.path}: rank state is not JSON data: {exc}") from None
        writer.write_bytes(rank_state_name(self.rank), body)
        state = model_and_optim_state(model, optimizer)

        def keep() -> None:
            # After DCP has read the state (its staging, or the whole sync save): on a GPU the
            # copy's D2H then overlaps what the training thread does next instead of DCP's own.
            self._keep_copy(step, state, rank_state)

        if self.rank != 0:
            self._unconfirmed.append(step)
        storage = _recording_digests(
            self._storage_writer(writer.path)
            if self._storage_writer is not None
            else FileSystemWriter(writer.path, sync_files=True),
            writer,
            self.rank,
        )
        if not self.async_save:
            metadata = save(state, storage_writer=storage, process_group=self.process_group)
            keep()
            commit = self._commit(writer, metadata)
            self.last_commit = commit or self.last_commit
            return commit
        done: Future[CommittedCheckpoint | None] = Future()
        response = async_save(state, storage_writer=storage, process_group=self.process_group)
        keep()
        # A FileSystemWriter stages itself (synchronously, above): a plain Future comes back. A
        # stager of its own (a custom storage_writer) gives both futures; the upload is the one.
        upload = response if isinstance(response, Future) else response.upload_completion
        with self._lock:
            self._pending, self._pending_step = done, step
        upload.add_done_callback(lambda f: self._finish(f, writer, done))
        return None

    def _keep_copy(self, step: int, state: Any, rank_state: Any) -> None:
        """Keep this rank's in-memory copy of `step`; for sharded state, also its shard in the
        buddy's memory (nodeagent.trainer.shard_replica, off this thread), so that a lost host's
        replacement loads its shards of this commit from memory instead of storage."""
        shard_replica.wait_all()  # an exchange may still be sending the buffers a copy would reuse
        sharded = self._replicates(state)
        why = memory_state.keep(
            step,
            {"state": state, "rank_state": rank_state},
            rank=self.rank,
            world_size=self.world_size,
            # the shards this rank holds for the rank behind share its copy budget
            budget_bytes=max(0, memory_state.budget() - shard_replica.held_bytes()) if sharded else None,
        )
        if not sharded:
            return
        run, attempt = os.environ.get("RUNWARDEN_RUN", ""), int(os.environ["RUNWARDEN_ATTEMPT"])
        own = memory_state.snapshot(step, attempt, kind=memory_state.COMMIT) if not why else None
        ring = shard_replica.ring_place(self.rank, self.world_size, memory_state.local_world_size())
        shard_replica.replicate(own, step, run=run, attempt=attempt, ring=ring, kind=memory_state.COMMIT)

    def _replicates(self, state: Any) -> bool:
        """Whether this save's shards go to the buddies: the same answer on every rank (sharded
        state, a warm launch of a supervised attempt, ranks on more than one host, and the saves'
        group is every rank)."""
        import torch.distributed as dist

        local = memory_state.local_world_size()
        return (
            self.world_size > 1
            and self.world_size % local == 0
            and self.world_size > local
            and os.environ.get("RUNWARDEN_LAUNCH_PATH", "") == memory_state.WARM
            and os.environ.get("RUNWARDEN_ATTEMPT", "").isdigit()
            and (self.process_group is None or dist.get_world_size(self.process_group) == self.world_size)
            and memory_state.is_sharded(state)
        )

    def _confirm_commits(self) -> None:
        """Every rank but 0: report the commits of this rank's earlier saves whose marker is now on
        disk (rank 0 wrote it after this rank's part was durable). Rank 0 reports each commit as
        it writes it; the others tell it too so that the supervisor still learns of it when rank
        0's host cannot report (its agent lost while its ranks go on training): the resume point
        is then that commit, not an older one, and it is one the survivors still hold in memory."""
        if self.rank == 0 or self.reporter is None or not self._unconfirmed:
            return
        attempt = os.environ.get("RUNWARDEN_ATTEMPT", "")
        newest = None
        for step in list(self._unconfirmed):
            commit = read_commit(step_dir(self.root, step))
            if commit is None:
                continue
            self._unconfirmed.remove(step)
            if str(commit.meta.get("attempt", "")) == attempt:  # this attempt's save, not a rival's
                newest = step if newest is None else max(newest, step)
        self._unconfirmed = self._unconfirmed[-8:]  # a step never committed (a failed save) ages out
        if newest is not None:
            self.reporter.set_committed(newest, save_stall_s=self.stall_s(newest))

    def _finish(self, upload: Future[Any], writer: CheckpointWriter, done: Future[Any]) -> None:
        """On the upload thread: commit (rank 0) once DCP's save returned on this rank."""
        try:
            commit = self._commit(writer, upload.result())
        except BaseException as exc:
            log.warning("rank %d: async save of step %d failed: %s", self.rank, writer.step, exc)
            if self.reporter is not None:
                self.reporter.checkpoint_failed(writer.step, f"{type(exc).__name__}: {exc}")
            done.set_exception(exc)
            return
        if commit is not None:
            self.last_commit = commit
        done.set_result(commit)

    def _commit(self, writer: CheckpointWriter, metadata: Any) -> CommittedCheckpoint | None:
        """Rank 0 only: DCP's save returned there, so its coordinator wrote `.metadata` after every
        rank's write results came in (the module doc); list and commit."""
        if self.rank != 0:
            return None
        if not isinstance(getattr(metadata, "storage_data", None), dict):
            # torch 2.9's async_save answers with a Metadata whose storage data is None; the
            # .metadata file its coordinator wrote before answering has it
            path = writer.path / DCP_METADATA
            metadata = load_metadata_pickle(path.read_bytes(), path)
            if not isinstance(getattr(metadata, "storage_data", None), dict):
                raise bad(path, "DCP wrote no storage data: the shards cannot be listed")
        shards = sorted({info.relative_path for info in metadata.storage_data.values()})
        recorded: dict[str, str] = {}
        for r in range(self.world_size):
            recorded.update(read_shard_digests(writer.path / shard_digests_name(r)))
        missing = [name for name in shards if name not in recorded]
        if missing:
            raise bad(writer.path, f"no rank recorded the checksum of shard(s) {missing}")
        files = [
            *shards,
            DCP_METADATA,
            *(rank_state_name(r) for r in range(self.world_size)),
            *(shard_digests_name(r) for r in range(self.world_size)),
        ]
        meta: dict[str, Any] = {"format": FORMAT, "world_size": self.world_size}
        attempt = os.environ.get("RUNWARDEN_ATTEMPT", "")
        if attempt.isdigit():
            meta["attempt"] = int(
                attempt
            )  # which attempt committed it (a superseded one is never resumed from)
        stall = self.stall_s(writer.step)  # up to now: a wait() for this save ends at this commit
        meta["save_stall_s"] = round(stall, 6)
        commit = writer.commit(
            files=files,
            meta=meta,
            hashed=(DCP_METADATA,),
            shard_xxh3={name: recorded[name] for name in shards},
        )
        if self.reporter is not None:
            self.reporter.set_committed(commit.step, save_stall_s=stall)
        return commit

    @property
    def in_flight(self) -> bool:
        """An async save started and not yet finished (committed or failed)."""
        with self._lock:
            return self._pending is not None and not self._pending.done()

    def wait(self, timeout_s: float | None = None) -> CommittedCheckpoint | None:
        """Block until the save in flight (if any) is committed; its commit on rank 0, else None.
        Raises SaveFailed (a CheckpointError naming the step) if it failed; the reporter was told."""
        with self._lock:
            pending, step = self._pending, self._pending_step
        if pending is None:
            return None
        try:
            with self._blocking_for(step):
                result = pending.result(timeout=timeout_s)
        except TimeoutError:
            raise  # still in flight
        except BaseException as exc:
            with self._lock:
                if self._pending is pending:
                    self._pending = None
            raise SaveFailed(step, f"async save of step {step} failed: {type(exc).__name__}: {exc}") from exc
        with self._lock:
            if self._pending is pending:
                self._pending = None
        return result


def verify_shards(commit: CommittedCheckpoint, *, process_group: Any = None) -> None:
    """Check every shard of `commit` against the checksum its writer recorded; a collective on
    `process_group` (default: the default group, if initialized) where each rank hashes every
    world-size-th file, so the whole step is read once however many ranks load it. Raises
    CorruptCheckpoint on every rank if any file differs (the message names them and the rank that
    found them). A commit that records no digests (written before they were) is loaded unchecked."""
    import torch.distributed as dist

    names = shard_names(commit)
    if not names:
        log.info("%s: no shard digests recorded: loaded unchecked", commit.path)
        return
    rank, world = 0, 1
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    bad_here = mismatched(commit, names[rank::world])
    found = memory_state.gather_ints(len(bad_here), world, process_group) if world > 1 else [len(bad_here)]
    if not any(found):
        return
    by = [r for r, n in enumerate(found) if n]
    what = (
        f"shard(s) {bad_here} differ" if bad_here else f"{sum(found)} shard(s) differ, found by rank(s) {by}"
    )
    raise CorruptCheckpoint(
        commit.step,
        f"{commit.path}: {what} from the checksum recorded at the commit: step {commit.step} is no resume point",
    )


def load_dcp(
    commit: CommittedCheckpoint,
    *,
    model: Any,
    optimizer: Any = None,
    scheduler: Any = None,
    rank: int | None = None,
    restore_rng: bool = True,
    process_group: Any = None,
) -> LoadedState:
    """Load a committed DCP step into model (and optimizer, scheduler) on every rank (collective),
    restore this rank's RNG states, and return its data position.

    Reading is validation first (the files come from storage, outside this process's control):

    * the marker must list `.metadata` with its SHA-256, and the bytes handed to DCP must hash to it
      (a torn or swapped `.metadata` is refused, not unpickled);
    * DCP's own FileSystemReader unpickles `.metadata` with the standard unpickler, which runs any
      callable a pickle names. `load_dcp` reads it with a restricted unpickler instead, which accepts
      only DCP's metadata classes, torch.Size, dtypes and layouts, and paths; every shard it names
      must be a file the marker lists, with an offset and length inside it;
    * DCP's default load planner unpickles non-tensor values (optimizer hyper-parameters) with
      `torch.load(weights_only=False)`; `load_dcp` uses a planner that loads them with
      `weights_only=True` (torch's own plain-data unpickler); tensors are loaded that way by DCP already;
    * `rank<r>.state.json` is JSON, bounded in size, and checked field by field;
    * every shard's content is checked against the XXH3-128 its writer recorded before DCP reads a
      byte of it (`verify_shards`: each rank hashes its share of the files, and every rank raises
      CorruptCheckpoint if any differs: a torn, bit-rotted or swapped shard is never loaded).
    """
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if commit.meta.get("format") != FORMAT:
        raise bad(commit.path, f"not a DCP checkpoint (format {commit.meta.get('format')!r})")
    if rank is None:
        rank = _dist()[0]
    name = rank_state_name(rank)
    rank_state = read_rank_state(commit, rank)
    restore_rng_states = rng_restorer(rank_state.get("rng"), commit.path / name) if restore_rng else None
    sched = rank_state.get("scheduler")
    if scheduler is not None and not isinstance(sched, dict):
        raise bad(commit.path / name, "no scheduler state saved")
    metadata = read_dcp_metadata(commit)  # checked here, so a refusal is ours, not wrapped by DCP
    verify_shards(commit, process_group=process_group)
    state = model_and_optim_state(model, optimizer)
    load(
        state,
        storage_reader=_verified_reader(commit.path, metadata),
        planner=_plain_data_planner(),
        process_group=process_group,
    )
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if scheduler is not None:
        scheduler.load_state_dict(sched)
    if restore_rng_states is not None:
        restore_rng_states()
    return LoadedState(
        step=commit.step,
        path=commit.path,
        data_state=rank_state.get("data_state"),
        extra=rank_state.get("extra"),
    )


__all__ = [
    "DCP_METADATA",
    "FORMAT",
    "DcpCheckpointer",
    "LoadedState",
    "SaveFailed",
    "load_dcp",
    "rank_state_name",
    "read_dcp_metadata",
    "read_rank_state",
    "verify_shards",
    "whole_tensors_bytes",
]
