"""DCP checkpoints under the commit protocol, one process (DCP without a process group): what
`latest_committed` accepts and what a load refuses. Each case damages a real DCP step after its
commit and checks that the previous step is the answer (or that the load says why it refuses).
The 2-rank path, a rank killed mid-save, is tests/nodeagent/test_dcp_kill.py."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from nodeagent import trainer
from nodeagent.trainer.checkpoint import (
    MARKER,
    CheckpointError,
    CommittedCheckpoint,
    CorruptCheckpoint,
    latest_committed,
    read_commit,
    sha256_file,
    step_dir,
    xxh3_file,
)
from nodeagent.trainer.dcp import DCP_METADATA, DcpCheckpointer, rank_state_name

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 3))
    return model, opt, sched


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler
) -> float:
    loss = model(torch.randn(4, 8)).pow(2).mean()  # the data and the dropout both draw from the RNG
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def _two_steps(root: Path, *, async_save: bool = True) -> DcpCheckpointer:
    """Steps 1 and 2 committed under root."""
    torch.manual_seed(0)
    model, opt, sched = _model()
    saver = DcpCheckpointer(root, async_save=async_save)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (1, 2):
            _train(model, opt, sched)
            saver.save(step, model=model, optimizer=opt, scheduler=sched, data_state={"next_step": step})
            saver.wait()
    return saver


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp")
    _two_steps(root)
    latest = latest_committed(root)
    assert latest is not None and latest.step == 2 and latest.meta["format"] == "dcp"
    assert set(latest.files) == {"__0_0.distcp", DCP_METADATA, rank_state_name(0), "rank0.shards.json"}
    assert set(latest.sha256) == {DCP_METADATA}
    # every shard's digest, taken by the rank that wrote it, is in the marker
    assert latest.shard_xxh3 == {"__0_0.distcp": xxh3_file(latest.path / "__0_0.distcp")}
    return root


@pytest.fixture
def two_steps(saved_once: Path, tmp_path: Path) -> Path:
    """A copy of steps 1 and 2, to damage."""
    shutil.copytree(saved_once, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _step2(root: Path) -> Path:
    return step_dir(root, 2)


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-1])


def _flip_a_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "no marker": lambda d: (d / MARKER).unlink(),
    "metadata missing": lambda d: (d / DCP_METADATA).unlink(),
    "metadata same size, other bytes": lambda d: _flip_a_byte(d / DCP_METADATA),
    "shard missing": lambda d: (d / "__0_0.distcp").unlink(),
    "shard size mismatch": lambda d: _truncate(d / "__0_0.distcp"),
    "rank state missing": lambda d: (d / rank_state_name(0)).unlink(),
    "marker lists a path outside the step": lambda d: _rewrite_marker(d, files_extra={"../escape": 0}),
    "marker with a malformed hash": lambda d: _rewrite_marker(d, sha256={DCP_METADATA: "not-hex"}),
    "marker with a malformed shard hash": lambda d: _rewrite_marker(d, shard_xxh3={"__0_0.distcp": "0" * 31}),
    "marker with a shard hash of an unlisted file": lambda d: _rewrite_marker(
        d, shard_xxh3={"x.distcp": "0" * 32}
    ),
    "an old marker with a malformed shard SHA-256": lambda d: _rewrite_marker(
        d, shard_sha256={"__0_0.distcp": "0" * 63}
    ),
}


def _rewrite_marker(
    d: Path,
    *,
    files_extra: dict[str, int] | None = None,
    sha256: dict[str, str] | None = None,
    shard_xxh3: dict[str, str] | None = None,
    shard_sha256: dict[str, str] | None = None,
) -> None:
    doc = json.loads((d / MARKER).read_text())
    doc["files"].update(files_extra or {})
    if sha256 is not None:
        doc["sha256"] = sha256
    if shard_xxh3 is not None:
        doc["shard_xxh3"] = shard_xxh3
    if shard_sha256 is not None:
        doc["shard_sha256"] = shard_sha256
    (d / MARKER).write_text(json.dumps(doc))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_dcp_step_is_never_the_latest_commit(two_steps: Path, damage: str) -> None:
    DAMAGE[damage](_step2(two_steps))
    latest = latest_committed(two_steps)
    assert latest is not None and latest.step == 1, damage


def test_async_and_sync_saves_load_back_to_the_same_losses(tmp_path: Path) -> None:
    """Save at step 2, train 3 more; load step 2 into fresh objects and replay: the same losses
    (model, AdamW moments, the LR schedule and the RNG all round-trip)."""
    for async_save in (True, False):
        root = tmp_path / f"async-{async_save}"
        torch.manual_seed(0)
        model, opt, sched = _model()
        saver = DcpCheckpointer(root, async_save=async_save)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(2):
                _train(model, opt, sched)
            commit = saver.save(2, model=model, optimizer=opt, scheduler=sched, data_state={"next_step": 2})
            assert (commit is None) == async_save  # async: the commit comes later
            after = [_train(model, opt, sched) for _ in range(3)]
            waited = saver.wait()
            assert (waited is not None) == async_save and saver.last_commit is not None
            torch.manual_seed(99)  # a fresh process would start elsewhere
            model2, opt2, sched2 = _model()
            loaded = trainer.load_checkpoint(root, model=model2, optimizer=opt2, scheduler=sched2)
        assert loaded.step == 2 and loaded.data_state == {"next_step": 2}
        assert [_train(model2, opt2, sched2) for _ in range(3)] == after


def _load(root: Path) -> None:
    model, opt, sched = _model()
    commit = latest_committed(root)
    assert isinstance(commit, CommittedCheckpoint)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.load_checkpoint(commit, model=model, optimizer=opt, scheduler=sched)


class _Exploit:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("this ran while unpickling",))


def _rehash(d: Path) -> None:
    """What someone who can write the checkpoint directory can do: make the marker agree."""
    doc = json.loads((d / MARKER).read_text())
    data = (d / DCP_METADATA).read_bytes()
    doc["files"][DCP_METADATA] = len(data)
    doc["sha256"][DCP_METADATA] = hashlib.sha256(data).hexdigest()
    (d / MARKER).write_text(json.dumps(doc))


def test_metadata_naming_a_callable_is_refused_before_it_runs(two_steps: Path, capsys) -> None:
    (_step2(two_steps) / DCP_METADATA).write_bytes(pickle.dumps(_Exploit()))
    _rehash(_step2(two_steps))
    with pytest.raises(CheckpointError, match=r"builtins\.print: not a DCP metadata type"):
        _load(two_steps)
    assert "this ran" not in capsys.readouterr().out


def test_metadata_pointing_outside_the_committed_files_is_refused(two_steps: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    d = _step2(two_steps)
    with (d / DCP_METADATA).open("rb") as f:
        metadata = pickle.load(f)  # our own file, just written: the test reads it to forge one
    for info in metadata.storage_data.values():
        assert isinstance(info, _StorageInfo)
        info.relative_path = "../../etc/passwd"
    (d / DCP_METADATA).write_bytes(pickle.dumps(metadata))
    _rehash(d)
    with pytest.raises(CheckpointError, match="which the commit marker does not list"):
        _load(two_steps)


def test_a_marker_without_the_metadata_hash_is_not_trusted(two_steps: Path) -> None:
    doc = json.loads((_step2(two_steps) / MARKER).read_text())
    del doc["sha256"]
    (_step2(two_steps) / MARKER).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="records no SHA-256"):
        _load(two_steps)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("step", 7, "not the DCP rank state of step 2"),
        ("rank", 3, "written by rank 3"),
        ("rng", {"python": [3, [1, 2], None], "torch": ""}, "expected 625 integers"),
    ],
)
def test_a_bad_rank_state_is_refused_with_the_field(
    two_steps: Path, field: str, value: object, message: str
) -> None:
    d = _step2(two_steps)
    doc = json.loads((d / rank_state_name(0)).read_text())
    doc[field] = value
    body = json.dumps(doc).encode()
    (d / rank_state_name(0)).write_bytes(body)
    marker = json.loads((d / MARKER).read_text())
    marker["files"][rank_state_name(0)] = len(body)
    (d / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=message):
        _load(two_steps)


def test_rank_state_must_be_json_data(tmp_path: Path) -> None:
    model, opt, _ = _model()
    saver = DcpCheckpointer(tmp_path, async_save=False)
    with pytest.raises(CheckpointError, match="not JSON data"):
        saver.save(1, model=model, optimizer=opt, data_state={"when": object()})
    assert latest_committed(tmp_path) is None


def test_a_shard_with_other_bytes_is_refused_at_load_and_the_supervisor_told(
    two_steps: Path, tmp_path: Path
) -> None:
    """Same size, one byte flipped (bit rot, a torn write the size does not show): the directory
    still looks committed (the shards are not hashed on every look), but the load hashes them
    before DCP reads a byte, refuses the step, and tells the supervisor which step and why."""
    from tests.nodeagent.helpers import AgentSocket

    _flip_a_byte(_step2(two_steps) / "__0_0.distcp")
    commit = latest_committed(two_steps)
    assert commit is not None and commit.step == 2
    agent = AgentSocket(tmp_path)
    rep = trainer.ProgressReporter(
        run="r", attempt=3, rank=0, local_rank=0, world_size=1, agent_socket=agent.path, flush_interval_s=30.0
    )
    model, opt, sched = _model()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        with pytest.raises(CorruptCheckpoint, match=r"__0_0\.distcp.*step 2 is no resume point") as raised:
            trainer.load_checkpoint(commit, model=model, optimizer=opt, scheduler=sched, reporter=rep)
        assert raised.value.step == 2
        assert agent.seen.wait(5)
        (r,) = agent.got[-1].reports
        assert r.invalid_step == 2 and "__0_0.distcp" in r.load_error
    finally:
        rep.close()
        agent.stop()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))
    # the step before it is intact and loads
    first = read_commit(step_dir(two_steps, 1))
    assert first is not None
    trainer.load_checkpoint(first, model=model, optimizer=opt, scheduler=sched)


def test_a_commit_without_shard_digests_still_loads(two_steps: Path) -> None:
    """A step committed before the shards were hashed (no shard checksums in its marker) loads as before."""
    doc = json.loads((_step2(two_steps) / MARKER).read_text())
    del doc["shard_xxh3"]
    (_step2(two_steps) / MARKER).write_text(json.dumps(doc))
    _load(two_steps)


def test_a_marker_from_before_xxh3_is_checked_by_its_sha256(two_steps: Path) -> None:
    """A step committed when markers recorded each shard's SHA-256 (`shard_sha256`) loads, checked
    against it: intact it loads, a flipped byte is refused."""
    d = _step2(two_steps)
    doc = json.loads((d / MARKER).read_text())
    doc["shard_sha256"] = {name: sha256_file(d / name) for name in doc.pop("shard_xxh3")}
    (d / MARKER).write_text(json.dumps(doc))
    commit = latest_committed(two_steps)
    assert commit is not None and commit.step == 2 and not commit.shard_xxh3 and commit.shard_sha256
    _load(two_steps)
    _flip_a_byte(d / "__0_0.distcp")
    model, opt, sched = _model()
    with pytest.raises(CorruptCheckpoint, match=r"__0_0\.distcp.*step 2 is no resume point"):
        trainer.load_checkpoint(commit, model=model, optimizer=opt, scheduler=sched)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[1, 2]", "not a JSON object"),
        (b"{nope", "not JSON"),
        (json.dumps({"__0_0.distcp": "A" * 32}).encode(), "is not an XXH3-128 hex digest"),
        (json.dumps({"__0_0.distcp": "a" * 64}).encode(), "is not an XXH3-128 hex digest"),
        (json.dumps({"__0_0.distcp": 7}).encode(), "is not an XXH3-128 hex digest"),
    ],
)
def test_a_bad_shard_digest_file_is_refused_with_why(tmp_path: Path, body: bytes, message: str) -> None:
    from nodeagent.trainer.dcp_format import read_shard_digests

    (tmp_path / "rank0.shards.json").write_bytes(body)
    with pytest.raises(CheckpointError, match=message):
        read_shard_digests(tmp_path / "rank0.shards.json")
