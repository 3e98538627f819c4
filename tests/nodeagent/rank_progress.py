"""A rank process for the tests: reports progress at a high rate, then its final step, and exits.

    python rank_progress.py DURATION_S FINAL_STEP
Identity (RANK, LOCAL_RANK, RUNWARDEN_*) comes from the environment, as under the launcher.
"""

import sys
import time

from nodeagent.trainer import ProgressReporter


def main() -> int:
    duration_s, final_step = float(sys.argv[1]), int(sys.argv[2])
    reporter = ProgressReporter.from_env(flush_interval_s=0.02)
    end = time.monotonic() + duration_s
    step = 0
    while time.monotonic() < end and step < final_step:
        reporter.report(step, step_time_s=0.001, compute_s=0.0008, wait_s=0.0002)
        step += 1
        time.sleep(0.001)
    reporter.report(final_step, step_time_s=0.5, compute_s=0.25, wait_s=0.125, loss=1.5)
    assert reporter.flush(), "final flush did not reach the agent"
    print("flushed", flush=True)
    time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0)
    reporter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
