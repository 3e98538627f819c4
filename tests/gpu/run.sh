#!/usr/bin/env bash
# Exercises every GPU code path of preflight on a real GPU node (NVML inventory and counters, CUDA
# known-answer matmul, NCCL all-reduce, the burn-in's sustained matmul / memory test / NCCL soak at
# short durations, the trainer's collective timer (DDP comm hook, CUDA events), then
# `preflight run --full`), in well under 5 minutes.
# On a host without an NVIDIA GPU it prints SKIPPED with the reason and exits 0 (CPU-only CI).
# Needs a torch with CUDA: set PYTHON to its interpreter (default: .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ ! -e /dev/nvidiactl ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "tests/gpu/run.sh: SKIPPED: no NVIDIA GPU on this host (no /dev/nvidiactl, no nvidia-smi)"
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "tests/gpu/run.sh: SKIPPED: nvidia-smi finds no usable GPU: $(nvidia-smi -L 2>&1 | head -1)"
  exit 0
fi

PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "tests/gpu/run.sh: FAILED: a GPU is present but $PYTHON has no CUDA-enabled torch;" \
       "set PYTHON to an interpreter with one (e.g. pip install torch==2.13.0 from the CUDA index)" >&2
  exit 1
fi

nvidia-smi -L || true
export PYTHONUNBUFFERED=1
exec timeout 290 "$PYTHON" tests/gpu/gpu_checks.py
