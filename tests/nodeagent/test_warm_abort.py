"""A parked rank's abort (nodeagent.warm.rank) is level-triggered: the windows where a one-shot
socket scan missed the attempt's collectives, each made deterministic.

* abort before the attempt's process group exists: the group is built after it (its gloo pairs did
  not exist at the scan) and a collective whose peer never joins must still fail within a bound;
* abort after the hand-off was queued but before the main thread took it: the attempt must end
  before its script runs (before, the abort found no attempt running and was dropped).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from nodeagent.warm import protocol
from nodeagent.warm.rank import WarmRank
from tests.nodeagent.helpers import wait_for

# Run in a child process: the abort shuts every TCP socket the process opens after it, and this
# test's own process must not have its sockets shut.
LATE_GROUP = """
import os, sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist
from nodeagent.warm.rank import WarmRank, attempt_sockets

rank = WarmRank(os.open(os.devnull, os.O_WRONLY))
with rank.lock:  # what run_attempt does when an attempt starts
    rank.before = set(attempt_sockets().values())
    rank.in_attempt = True
rank.abort()  # no socket of the attempt exists yet: the scan shuts nothing
store = dist.HashStore()
out = {}
groups = []  # kept: a group that is freed closes its sockets, which would end the collective too

def member(i):
    try:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=120)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(store, i, 2, opts)
        groups.append(pg)
        if i == 0:  # the peer never joins this collective: only the abort can end it
            pg.allreduce([torch.ones(1)]).wait()
        out[i] = "returned"
    except RuntimeError as exc:
        out[i] = f"failed: {exc}"

threads = [threading.Thread(target=member, args=(i,), daemon=True) for i in (0, 1)]
t0 = time.monotonic()
for t in threads:
    t.start()
threads[0].join(20)
print(f"rank 0: {out.get(0, 'still blocked')} after {time.monotonic() - t0:.2f} s", flush=True)
os._exit(0 if out.get(0, "").startswith("failed") else 1)
"""


def test_a_collective_of_a_group_built_after_the_abort_fails_at_once():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", LATE_GROUP], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def test_an_abort_that_arrives_before_the_queued_hand_off_starts_ends_that_attempt(tmp_path):
    ran = tmp_path / "ran"
    script = tmp_path / "job.py"
    script.write_text(f"open({str(ran)!r}, 'w').close()\n")
    status_r, status_w = os.pipe()
    control_r, control_w = os.pipe()
    rank = WarmRank(status_w)
    reader = threading.Thread(target=rank.read_control, args=(control_r,), daemon=True)
    reader.start()
    handoff = protocol.encode_handoff(
        argv=(str(script),),
        cwd=str(tmp_path),
        env={},
        rendezvous={
            "rdzv_id": "abort-1",
            "node_rank": 0,
            "nnodes": 1,
            "local_rank": 0,
            "local_world_size": 1,
            "master_addr": "127.0.0.1",
            "master_port": 1,  # never reached: the attempt ends before its rendezvous
            "timeout_s": 5.0,
        },
        attempt=1,
    )
    try:
        os.write(control_w, handoff + b"\n" + protocol.ABORT + b"\n")
        wait_for(lambda: rank.aborted_through == 1, 10, "the abort read after the queued hand-off")
        code = rank.run_attempt(rank.handoffs.get(timeout=10))
        assert code == 1 and not ran.exists()
        assert rank.last_attempt == 1  # fenced all the same: the attempt is never run later
        assert not rank.in_attempt and not rank.aborted
    finally:
        for fd in (control_w, status_r, status_w):
            os.close(fd)
        reader.join(10)
