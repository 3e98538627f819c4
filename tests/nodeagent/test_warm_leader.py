"""The parked group's leader as its ranks' template (nodeagent.warm.leader), driven in a child
interpreter through its own methods: its ranks are forked (they share the leader's imports), each
keeps only its own pipes (closing the group ends every rank on EOF, none is killed), and a rank that
died is forked again in its place while the others keep their processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

DRIVER = """
import json, os, signal, sys, time
from nodeagent.warm.leader import RANK_PROCESS_NAME, Leader
r, w = os.pipe()
os.close(r)  # the agent's end: not in the leader's process
leader = Leader(2, w, ())
assert leader.start() and leader.wait_parked(leader.ranks, 120)
before = [x.popen.pid for x in leader.ranks]

def pipes(pid):
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        if int(fd) > 2 and (link := os.readlink(f"/proc/{pid}/fd/{fd}")).startswith("pipe:"):
            found.add(link)
    return found

held = [sorted(pipes(pid)) for pid in before]
ready = os.readlink(f"/proc/self/fd/{w}")
names = [open(f"/proc/{pid}/comm").read().strip() for pid in before]
parents = [int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) for pid in before]
victim = leader.ranks[0].popen
os.kill(victim.pid, signal.SIGKILL)
while victim.poll() is None:
    time.sleep(0.001)
t0 = time.monotonic()
replaced = leader.replace_dead()
took = time.monotonic() - t0
after = [x.popen.pid for x in leader.ranks]
after_held = [sorted(pipes(pid)) for pid in after]
t0 = time.monotonic()
leader.end(0)
print(json.dumps({
    "before": before, "after": after, "held": held, "ready": ready,
    "after_held": after_held, "names": names, "parents": parents, "leader": os.getpid(),
    "replaced": replaced, "replace_s": took, "end_s": time.monotonic() - t0,
    "codes": [x.popen.returncode for x in leader.ranks], "victim_code": victim.returncode,
    "expected_name": RANK_PROCESS_NAME.decode(),
}))
"""


@pytest.mark.timeout(120)
def test_ranks_are_forked_keep_only_their_pipes_and_a_dead_one_is_forked_again() -> None:
    out = subprocess.run(
        [sys.executable, "-c", DRIVER],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=110,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["parents"] == [got["leader"]] * 2  # forked by the leader itself
    assert got["names"] == [got["expected_name"]] * 2
    assert got["victim_code"] == -9
    assert got["replaced"] and got["replace_s"] < 10, got  # a fork, not an interpreter importing torch
    assert got["after"][1] == got["before"][1] and got["after"][0] not in got["before"], got
    # each rank holds its own two pipes, none of a peer's and not the leader's to the agent (else
    # the agent would not see the leader go while a rank lives), the forked-again one too
    for held in (got["held"], got["after_held"]):
        assert all(len(h) == 2 for h in held) and not set(held[0]) & set(held[1]), held
        assert got["ready"] not in held[0] + held[1], (got["ready"], held)
    # EOF on each control pipe ended every rank (exit 0)
    assert got["codes"] == [0, 0] and got["end_s"] < 2.0, got


@pytest.mark.timeout(30)  # without the leader's fix, it waits for the abort for ever
def test_an_end_read_together_with_its_attempts_hand_off_still_ends_the_attempt(monkeypatch) -> None:
    """The agent's `end` can arrive in the same read as the hand-off before it (a stop right after a
    launch, a leader slow to read); the pipe then never turns readable for it again, so the leader
    must take it from what it already read, or the ranks never hear `abort`."""
    import os
    import threading

    from nodeagent.warm.leader import Leader, _Rank
    from nodeagent.warm.protocol import ABORT, END, Lines

    class Running:  # the rank's process, as the leader sees it: alive
        pid = 12345
        returncode = None

        def poll(self) -> int | None:
            return None

    agent_r, agent_w = os.pipe()
    status_r, status_w = os.pipe()
    control_r, control_w = os.pipe()
    with open(os.devnull) as devnull:
        monkeypatch.setattr(sys, "stdin", devnull)  # the leader's agent pipe, replaced below
        leader = Leader(1, os.open(os.devnull, os.O_WRONLY))
    leader.agent = Lines(agent_r)
    leader.ranks = [_Rank(popen=Running(), status=Lines(status_r), control=control_w)]
    os.write(agent_w, b'{"attempt": 5}\n' + END + b"\n")  # both lines in one read
    assert leader.parked_command() == b'{"attempt": 5}'
    result: list[tuple[int, bool]] = []
    t = threading.Thread(target=lambda: result.append(leader.supervise()), daemon=True)
    t.start()
    told = Lines(control_r)
    assert told.read_line() == ABORT  # the rank is told to leave
    os.write(status_w, b"ended 1\n")  # and says it left
    t.join(5.0)
    assert result == [(1, True)], "the attempt ended once its rank left"
    for fd in (agent_w, status_w, control_r):
        os.close(fd)
