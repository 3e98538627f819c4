"""What gets a gloo rank out of a collective whose peer is gone or hung (issue 18, warm restarts).

    flock /tmp/runwarden-heavy.lock .venv/bin/python bench/bench_warm_abort.py --trials 3 \
        --out bench/results/bench_warm_abort.json

Two real processes, gloo on CPU, one TCPStore: rank 0 waits in an all_reduce its peer never joins.
Each mode does one thing from another thread of rank 0 (or to the peer) after 1 s and times how
long the all_reduce takes to raise (the collective timeout is 10 s: a mode that does not work
raises only then), then checks that the process can join a
new process group with a new peer (what a warm rank parked again needs):

* kill: SIGKILL the peer (a crash);
* stop+abort / stop+shutdown / stop+destroy: SIGSTOP the peer (a hang), then ProcessGroup.abort(),
  ProcessGroup.shutdown(), or destroy_process_group() from the other thread;
* stop+sockets: SIGSTOP the peer, then shutdown(2) the TCP sockets the attempt opened
  (nodeagent.warm.rank.shut_sockets: what a warm rank's `abort` does).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("kill", "stop+abort", "stop+shutdown", "stop+destroy", "stop+sockets")
CAP_S = 10.0


def peer(port: int) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=1, world_size=2)
    dist.all_reduce(torch.ones(4))
    time.sleep(3600)


def trial(mode: str, port: int) -> dict[str, object]:
    """Run in a fresh process (a blocked all_reduce cannot be left by a mode that does not work)."""
    import torch
    import torch.distributed as dist

    from nodeagent.warm.rank import attempt_sockets, shut_sockets

    before = set(attempt_sockets().values())
    store = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    p = subprocess.Popen([sys.executable, __file__, "--peer", str(port)])
    # the collective timeout is the cap: a mode that does not work raises only when it runs out
    dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=CAP_S))
    dist.all_reduce(torch.ones(4))
    pg = dist.distributed_c10d._get_default_group()
    acted = [0.0]

    def act() -> None:
        time.sleep(1.0)
        acted[0] = time.perf_counter()
        if mode == "kill":
            p.kill()
            return
        os.kill(p.pid, signal.SIGSTOP)
        if mode == "stop+abort":
            pg.abort()
        elif mode == "stop+shutdown":
            pg.shutdown()
        elif mode == "stop+destroy":
            dist.destroy_process_group()
        else:
            shut_sockets(before)

    threading.Thread(target=act, daemon=True).start()
    raised: float | None = None
    try:
        dist.all_reduce(torch.ones(1024))
    except Exception:
        raised = time.perf_counter() - acted[0]
    p.kill()
    p.wait()
    t0 = time.perf_counter()
    if dist.is_initialized():
        dist.destroy_process_group()
    store2 = dist.TCPStore("127.0.0.1", port + 1, 2, True, timedelta(seconds=30), wait_for_workers=False)
    p2 = subprocess.Popen([sys.executable, __file__, "--peer", str(port + 1)])
    dist.init_process_group("gloo", store=store2, rank=0, world_size=2)
    t = torch.ones(4)
    dist.all_reduce(t)
    p2.kill()
    p2.wait()
    return {
        "raised_after_s": raised,
        "new_group_ok": float(t[0]) == 2.0,
        "new_group_s": time.perf_counter() - t0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--peer", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--trial", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        peer(args.peer)
        return 0
    if args.trial:
        print(json.dumps(trial(args.trial[0], int(args.trial[1]))), flush=True)
        return 0
    results: dict[str, list[dict[str, object]]] = {m: [] for m in MODES}
    port = 29750
    for _ in range(args.trials):
        for mode in MODES:
            port += 4
            cmd = [sys.executable, __file__, "--trial", mode, str(port)]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=CAP_S + 8)
                row = json.loads(out.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                row = {"raised_after_s": None, "new_group_ok": False, "new_group_s": None}
            results[mode].append(row)
            print(mode, json.dumps(row), flush=True)  # a cut-off run keeps what it measured
    print(f"{'mode':<14} {'n':>2} {'raised after (median)':>22} {'new group ok':>13}")
    summary = {}
    for mode, rows in results.items():
        times = [r["raised_after_s"] for r in rows if isinstance(r["raised_after_s"], float)]
        med = statistics.median(times) if len(times) == len(rows) else None
        summary[mode] = {"n": len(rows), "median_raised_after_s": med, "rows": rows}
        shown = (
            f"{med * 1000:.1f} ms" if med is not None else f"blocked ({len(rows) - len(times)}/{len(rows)})"
        )
        print(
            f"{mode:<14} {len(rows):>2} {shown:>22} {sum(bool(r['new_group_ok']) for r in rows):>10}/{len(rows)}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
