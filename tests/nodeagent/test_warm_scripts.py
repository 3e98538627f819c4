"""Golden scripts for the warm group: the agent's side of one parked group (nodeagent.warm.groups'
ParkedGroup, its lifecycle in nodeagent.warm.lifecycle) and the wire protocol (nodeagent.warm.protocol),
driven line by line with no process: the leader is a fake whose stdin is a buffer.

Each file in tests/nodeagent/warm_scripts/ is a list of blocks: one command line, a `----` line, then
the expected output, then a blank line (the supervisor's scenarios' format, raft's interaction tests'
style). Regenerate after an intended change with
`REWRITE_WARM_SCRIPTS=1 pytest tests/nodeagent/test_warm_scripts.py` and review the diff like code.

Commands:
  group ranks=2                  a fresh group (leader pid 500), STARTING
  leader <line>                  the leader's next line on its ready fd (`ready <pids>`, `ended <code>`,
                                 anything else); its first line decides ready or failed
  leader-gone                    the leader's pipe closed (it exited)
  hand-off attempt=3 [nnodes=2] [node-rank=0] [argv=t.py,--lr,1]
                                 the agent hands a launch to the group: the line written to the leader's
                                 stdin, and the hand-off each local rank gets from the leader, parsed
  end                            the agent asks the running attempt's ranks to leave it (`end`)
  close                          the agent closes the group
  parse <raw line>               a rank's parse of a hand-off line: its fields, or the HandOffError
  transition <STATE> <event>     the pure transition alone
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, cast

import pytest

from nodeagent.daemon.launcher import AttemptEnd, LaunchSpec
from nodeagent.warm import protocol
from nodeagent.warm.groups import ParkedGroup, WarmAsk, handoff_message
from nodeagent.warm.lifecycle import ParkedEvent, ParkedState, transition
from tests.support.golden import check_golden

SCRIPTS = Path(__file__).parent / "warm_scripts"
LEADER_PID = 500


class FakeLeader:
    """What ParkedGroup uses of the leader's Popen: its pid, stdin, and poll (alive)."""

    def __init__(self) -> None:
        self.pid = LEADER_PID
        self.stdin = io.BytesIO()
        self.written = 0

    def poll(self) -> int | None:
        return None

    def new_lines(self) -> list[bytes]:
        data = self.stdin.getvalue()
        lines, self.written = data[self.written :].splitlines(), len(data)
        return lines


def _kv(args: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in args)


def _handoff_line(h: protocol.HandOff) -> str:
    r = h.rendezvous
    return (
        f"attempt={h.attempt} argv={list(h.argv)} module={h.module or '-'} cwd={h.cwd or '-'} "
        f"env={dict(h.env)} rdzv={r.rdzv_id} node_rank={r.node_rank}/{r.nnodes} "
        f"local_rank={r.local_rank}/{r.local_world_size} master={r.master_addr}:{r.master_port} "
        f"timeout={r.timeout_s:g}"
    )


class Runner:
    def __init__(self) -> None:
        self.group: ParkedGroup | None = None
        self.leader = FakeLeader()

    def run(self, cmd: str) -> list[str]:
        name, _, rest = cmd.partition(" ")
        handler = getattr(self, "cmd_" + name.replace("-", "_"))
        group = self.group
        before = group.state if group is not None else None
        out: list[str] = handler(rest)
        if group is not None and group is self.group and group.state is not before:
            assert before is not None
            out.append(f"state {before.name} -> {group.state.name}")
        if self.group is not None:
            out += [f"agent -> leader: {line.decode()}" for line in self.leader.new_lines()]
        return out

    def _group(self) -> ParkedGroup:
        assert self.group is not None, "no group: start the script with `group`"
        return self.group

    def cmd_group(self, rest: str) -> list[str]:
        ranks = int(_kv(rest.split()).get("ranks", "1"))
        self.leader = FakeLeader()
        self.group = ParkedGroup(cast(Any, self.leader), ranks, {"PATH": "/bin"})
        return [f"group leader={LEADER_PID} ranks={ranks} state {self.group.state.name}"]

    def cmd_leader(self, rest: str) -> list[str]:
        group = self._group()
        line = rest.encode()
        if group.state is ParkedState.STARTING:
            pids = protocol.parse_ready(line, group.local_ranks)
            if pids:
                group.on_ready(pids)
                return [f"ready: rank pids {list(pids)}"]
            group.on_failed(f"not a ready line: {rest!r}")
            return [f"failed: {group.failure}"]
        running = group.current
        group.on_line(line)
        return self._ended(running) or ["ignored"]

    def cmd_leader_gone(self, rest: str) -> list[str]:
        group = self._group()
        running = group.current
        group.on_gone()
        return self._ended(running)

    def _ended(self, end: AttemptEnd | None) -> list[str]:
        if end is None or not end.done.is_set():
            return []
        keep = f" keep={list(end.keep_pids)}" if end.keep_pids else ""
        return [f"attempt ended: exit={end.exit_code} parked={end.parked}{keep}"]

    def cmd_hand_off(self, rest: str) -> list[str]:
        group = self._group()
        kv = _kv(rest.split())
        attempt = int(kv.get("attempt", "1"))
        nnodes, node_rank = int(kv.get("nnodes", "1")), int(kv.get("node-rank", "0"))
        argv = tuple(kv.get("argv", "train.py").split(","))
        spec = LaunchSpec(
            run="r",
            attempt=attempt,
            rendezvous_id=f"r-{attempt}",
            argv=argv,
            env={},
            cwd="/job",
            node_rank=node_rank,
            nnodes=nnodes,
            stop_file=Path("/stop"),
            fr_socket_dir=Path("/fr"),
        )
        ask = WarmAsk(
            command=argv,
            rdzv_endpoint="host0:29400",
            is_host=node_rank == 0,
            no_python=False,
            node_rank=node_rank,
            nnodes=nnodes,
        )
        message = handoff_message(spec, ask, {"A": "1"}, group.local_ranks)
        end = group.hand_off(message, attempt)
        out = [f"hand-off: {'started' if end is not None else 'refused (nothing started)'}"]
        if end is not None:
            for i in range(group.local_ranks):
                copy = protocol.with_local_rank(message, i)
                out.append(f"leader -> rank {i}: {_handoff_line(protocol.parse_handoff(copy))}")
        return out

    def cmd_end(self, rest: str) -> list[str]:
        self._group().end_attempt()
        return []

    def cmd_close(self, rest: str) -> list[str]:
        self._group().on_closed()
        return []

    def cmd_parse(self, rest: str) -> list[str]:
        try:
            return [_handoff_line(protocol.parse_handoff(rest.encode()))]
        except protocol.HandOffError as exc:
            return [f"HandOffError: {exc}"]

    def cmd_transition(self, rest: str) -> list[str]:
        state, event = rest.split()
        step = transition(ParkedState[state], ParkedEvent(event))
        flags = [f for f in ("attempt_ended", "parked_again", "ignored") if getattr(step, f)]
        return [f"{state} --{event}--> {step.state.name}" + (f" ({', '.join(flags)})" if flags else "")]


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.txt")), ids=lambda p: p.stem)
def test_warm_script(path: Path) -> None:
    check_golden(path, Runner().run, "REWRITE_WARM_SCRIPTS")


def test_every_state_and_event_is_scripted() -> None:
    text = "".join(p.read_text() for p in SCRIPTS.glob("*.txt"))
    for state in ParkedState:
        assert f"transition {state.name} " in text, state
    for event in ParkedEvent:
        assert f" {event.value}\n" in text, event
