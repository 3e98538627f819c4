"""A rank for the stop tests, without torch: a step every 20 ms, reported to the agent.

    python stop_rank.py obedient|stubborn
obedient: on a stop request (stop_requested()) it closes its reporter and exits 0;
stubborn: it never stops by itself (SIGTERM only sets the reporter's flag): KILL ends it.
"""

import sys
import time

from nodeagent.trainer import ProgressReporter


def main() -> int:
    mode = sys.argv[1]
    reporter = ProgressReporter.from_env(flush_interval_s=0.05)
    reporter.loaded(-1)
    step = 0
    while True:
        step += 1
        reporter.report(step, step_time_s=0.02)
        time.sleep(0.02)
        if mode == "obedient" and reporter.stop_requested():
            reporter.close()
            return 0


if __name__ == "__main__":
    sys.exit(main())
