#!/usr/bin/env bash
# Sets everything up, then runs the main job: a supervised DDP training run on this machine
# (private etcd, six node agents, the controller), broken five ways, and its goodput report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
