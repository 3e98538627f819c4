"""`python -m lightfleet`: start a fleet of light agents, say when it is registered, take faults on stdin.

    python -m lightfleet --etcd 127.0.0.1:2379 --nodes 1024 --procs 2 --first-port 20000 \\
        [--preflight-s 5:30] [--launch-s ...] [--stop-s ...] [--dump-s ...] [--step-s 1] [--ranks 8]

Prints one line once every agent is registered (`ready: N agents registered in S s; pid P
light-0000..light-0511 ports ..., ...`), then one answer line per control line read on stdin
(lightfleet.faults; `stats` prints each process's counters). Runs until SIGTERM or SIGINT (stdin's
end does not stop it: it may run in the background); revokes its leases on the way out.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

from lightfleet import cli
from lightfleet.fleet import Fleet, FleetError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightfleet",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, required=True, help="light agents in all")
    parser.add_argument("--procs", type=int, default=1, help="OS processes hosting them (default 1)")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for registration")
    cli.add_common(parser)
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        fleet = Fleet(args, nodes=args.nodes, procs=args.procs)
        seconds = fleet.start(args.ready_timeout)
    except (cli.UsageError, FleetError) as exc:
        print(f"lightfleet: {exc}", file=sys.stderr)
        return 2
    print(f"ready: {args.nodes} agents registered in {seconds:.2f} s; {fleet.describe()}", flush=True)

    def control() -> None:
        for line in sys.stdin:
            if line.strip():
                print(fleet.inject(line), flush=True)

    threading.Thread(target=control, name="control", daemon=True).start()
    while not stop.wait(0.5):
        if dead := fleet.dead():
            print(f"lightfleet: process {dead[0].index} exited: {dead[0].failed}", file=sys.stderr)
            fleet.stop()
            return 1
    fleet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
