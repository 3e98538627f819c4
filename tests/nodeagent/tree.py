"""A worker that builds a process tree for the launcher tests, then waits.

    python tree.py PIDFILE MODE      MODE: "obedient" (dies on TERM) | "stubborn" (ignores TERM)
Tree: this leader -> two children -> one grandchild each; one grandchild calls setsid() (it leaves
the session, as daemons do). Every pid is written to PIDFILE, one per line, once all are up.
"""

import os
import signal
import sys
import time


def child(pidfile: str, stubborn: bool, escape: bool) -> None:
    if stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pid = os.fork()
    if pid == 0:
        if escape:
            os.setsid()
        if stubborn:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(pidfile, "a") as f:
            f.write(f"{os.getpid()}\n")
        while True:
            time.sleep(1)
    with open(pidfile, "a") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        time.sleep(1)


def main() -> None:
    pidfile, mode = sys.argv[1], sys.argv[2]
    stubborn = mode == "stubborn"
    if stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for i in range(2):
        if os.fork() == 0:
            child(pidfile, stubborn, escape=(i == 1))
            os._exit(0)
    with open(pidfile, "a") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
