"""A parked rank's abort (nodeagent.warm.rank) is level-triggered: a window where the one-shot
abort was lost, made deterministic.

* abort after the hand-off was queued but before the main thread took it: the attempt must end
  before its script runs (before, the abort found no attempt running and was dropped).
"""

from __future__ import annotations

import os
import threading

from nodeagent.warm import protocol
from nodeagent.warm.rank import WarmRank
from tests.nodeagent.helpers import wait_for


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
