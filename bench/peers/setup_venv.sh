#!/usr/bin/env bash
# The peer virtualenv for bench/bench_peers.py: bench/.peer-venv (git-ignored), never a project dependency.
#
#   bash bench/peers/setup_venv.sh
#
# torch: the peers must run on the project's torch (2.13.0, CPU). The venv is created from the project's
# interpreter and a .pth file appends the project's .venv site-packages (torch, and the project's own deps
# that examples/train.py imports), so pip sees torch 2.13.0 as installed and the constraint file below pins
# it: no other torch can be pulled in. The peers themselves are pinned exactly.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$REPO/bench/.peer-venv"
BASE_PY="$REPO/.venv/bin/python"
NVRX_VERSION="0.4.1"    # 0.7.0's wheels need a newer glibc/Python than this machine; 0.4.1 installs with pip
TORCHFT_VERSION="0.2.0"

"$BASE_PY" -m venv --clear "$VENV"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
BASE_SITE="$("$BASE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$BASE_SITE" > "$SITE/zz-project-venv.pth"   # after the venv's own packages
echo "torch==2.13.0" > "$VENV/constraints.txt"
"$VENV/bin/python" -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__'
"$VENV/bin/python" -m pip install --quiet -c "$VENV/constraints.txt" \
    "nvidia-resiliency-ext==$NVRX_VERSION"
# torchft is optional: installed if it installs; bench_peers.py checks whether it runs with this torch.
"$VENV/bin/python" -m pip install --quiet -c "$VENV/constraints.txt" "torchft==$TORCHFT_VERSION" \
    || echo "setup_venv: torchft==$TORCHFT_VERSION did not install; bench_peers.py skips it" >&2
"$VENV/bin/python" -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__'
"$VENV/bin/python" -m pip list 2>/dev/null | grep -Ei '^(torch|torchft|nvidia-resiliency-ext) ' || true
