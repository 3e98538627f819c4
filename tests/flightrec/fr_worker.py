"""One gloo rank for the flight-recorder tests: train a few steps, then hang (culprit) or time out (others).

Run as `python tests/flightrec/fr_worker.py SPEC_JSON RANK`. The spec (written by scenarios.py) says
the world size, extra process groups, steps, ring size, the culprit, and where it hangs. Every rank
sets up flight recording the production way (nodeagent.trainer.flight_recording), so the agent-side
collection reads real dumps over the worker-server socket.

Markers in the work dir tell the parent where each rank is: `hung<R>` (the culprit reached its hang
point), `timeout<R>` (the rank's collective raised; the text is the error), `pickled<R>` (its pickle
dump is written, after the parent created `dump_now`). Ranks never exit on their own: the parent
SIGKILLs them, as a supervisor would kill a hung job.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nodeagent.trainer.flight_recording import FlightRecording, setup_flight_recording, socket_path_for

PICKLE_PREFIX = "nccl_trace_rank_"


def _dump_pickle_on_request(rec: FlightRecording, work: Path, rank: int) -> None:
    """A daemon thread: the in-process dump works while the main thread sleeps or is blocked."""
    while not (work / "dump_now").exists():
        time.sleep(0.05)
    out = work / "pickle" / f"{PICKLE_PREFIX}{rank}"
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(rec.dump_pickle())
    os.replace(tmp, out)
    (work / f"pickled{rank}").write_text("ok")


def _set_op_timeout(group: object, seconds: float) -> None:
    import torch

    group._get_backend(torch.device("cpu")).set_timeout(timedelta(seconds=seconds))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    work = Path(spec["work"])
    world = int(spec["world"])
    rec = setup_flight_recording(
        socket_path_for(work / "sockets", rank), buffer_size=int(spec["buffer_size"])
    )

    import torch
    import torch.distributed as dist

    store = dist.FileStore(str(work / "filestore"), world)
    # Rendezvous may be slow on loaded cores: 60 s for init, then the short per-op timeout.
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    groups = {}
    for name, ranks in spec["groups"].items():  # every rank creates every group, in the same order
        pg = dist.new_group(ranks, timeout=timedelta(seconds=60), group_desc=name)
        if rank in ranks:
            groups[name] = pg
    rec.record_process_groups()
    threading.Thread(target=_dump_pickle_on_request, args=(rec, work, rank), daemon=True).start()

    plan = [("default", None)] + [(name, pg) for name, pg in groups.items()]
    try:
        for step in range(int(spec["steps"])):
            if step == spec["hang_step"]:
                # The short per-op timeout only from the hang step on: a loaded machine must not make
                # a healthy step time out (60 s until then, as init_process_group set it).
                for _, pg in plan:
                    _set_op_timeout(pg or dist.distributed_c10d._get_default_group(), spec["op_timeout_s"])
            for name, pg in plan:
                if rank == spec["culprit"] and step == spec["hang_step"] and name == spec["hang_group"]:
                    (work / f"hung{rank}").write_text(f"step {step} group {name}")
                    while True:  # "spin": busy in Python, holding the GIL most of the time
                        if not spec["spin"]:
                            time.sleep(1)
                size = 8 if name == "default" else 4 + len(name)
                dist.all_reduce(torch.ones(size), group=pg)
    except RuntimeError as exc:
        (work / f"timeout{rank}").write_text(str(exc)[:2000])
    else:
        (work / f"finished{rank}").write_text("ok")
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
