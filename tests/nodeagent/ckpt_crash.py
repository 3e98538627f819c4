"""Writes checkpoint step 1 (committed), then step 2, and SIGKILLs itself at the point named.

    python ckpt_crash.py ROOT POINT
POINT: mid_file | after_files | marker_tmp | after_commit | none
"""

import os
import signal
import sys

from nodeagent.trainer import checkpoint


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    root, point = sys.argv[1], sys.argv[2]
    w1 = checkpoint.CheckpointWriter(root, 1)
    w1.write_bytes("model.bin", b"a" * 10_000)
    w1.write_bytes("optim.bin", b"b" * 5_000)
    w1.commit()
    w2 = checkpoint.CheckpointWriter(root, 2)
    w2.write_bytes("model.bin", b"c" * 10_000)
    with w2.open("optim.bin") as f:
        f.write(b"d" * 2_000)
        if point == "mid_file":
            f.flush()
            die()
        f.write(b"d" * 3_000)
    if point == "after_files":
        die()
    if point == "marker_tmp":
        real_replace = os.replace

        def replace(src, dst):  # the marker's temp file is complete and fsynced, the rename not done
            if str(dst).endswith(checkpoint.MARKER):
                die()
            real_replace(src, dst)

        os.replace = replace
    w2.commit()
    if point == "after_commit":
        die()


if __name__ == "__main__":
    main()
