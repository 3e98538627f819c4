"""examples/train.py under a peer launcher, with the thinnest adapter each peer needs.

    python bench/peers/train_adapter.py <examples/train.py's arguments>

The job is examples/train.py's own `main`, unchanged; only `trainer.ProgressReporter.report` (called
once per step, and twice more at a checkpoint) is wrapped:

* BENCH_NVRX_HEARTBEAT=1: NVRx's rank heartbeat, `RankMonitorClient.send_heartbeat()`, every report
  (the adapter NVRx's docs describe: init once, heartbeat in the training loop);
* BENCH_SLOW_FILE: while that file exists the rank sleeps the seconds written in it on every report,
  as runwarden's agent makes a rank sleep on `controllerctl chaos slow-rank` (the straggler fault).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples import train
from nodeagent import trainer


def _slow_seconds(path: str) -> float:
    try:
        return float(Path(path).read_text() or 0.0)
    except (OSError, ValueError):
        return 0.0


def install() -> None:
    slow_file = os.environ.get("BENCH_SLOW_FILE", "")
    heartbeat: Any = None
    if os.environ.get("BENCH_NVRX_HEARTBEAT") == "1":
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        heartbeat = RankMonitorClient()
        heartbeat.init_workload_monitoring()
    original = trainer.ProgressReporter.report

    def report(self: trainer.ProgressReporter, step: int, **kwargs: Any) -> None:
        original(self, step, **kwargs)
        if heartbeat is not None:
            heartbeat.send_heartbeat()
        if slow_file and (seconds := _slow_seconds(slow_file)) > 0:
            time.sleep(seconds)

    trainer.ProgressReporter.report = report  # the one adapter hook


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR2)  # a stuck rank's stacks, on demand (debugging a trial)
    install()
    sys.exit(train.main())
