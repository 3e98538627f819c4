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
