#!/usr/bin/env bash
# Exercises every GPU code path one GPU can run, in under 5 minutes:
# * tests/gpu/gpu_runwarden.py (about a minute, 120 s at most): runwarden's training side: DCP save/load of CUDA
#   tensors, the in-memory copies (pinned host memory, async D2H, no GPU memory; the save stall with
#   and without), the in-memory snapshots (no GPU memory, the stall, the step after, the restore),
#   the peer path's chunked staging, stop_agreed(device="cuda"), a warm rank's NCCL
#   abort and re-init and what a parked rank keeps (MiB), NCCL flight-recorder dumps, the bootstrap's
#   NCCL counters, the NVML poller and the Xid bus-id -> NVML index map;
# * tests/gpu/gpu_checks.py: preflight (NVML inventory and counters, CUDA known-answer matmul, NCCL
#   all-reduce, the burn-in's sustained matmul / memory test / NCCL soak at short durations, a
#   leftover rank's GPU memory, the trainer's collective timer), then `preflight run --full`, which
#   must exit 0 (175 s at most).
# Both run; the script fails if either does (any FAIL). Output also goes to $OUT/gpu-*.log when $OUT
# is set.
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
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
LOGS="${OUT:-$(mktemp -d)}"
status=0
started=$SECONDS
timeout 120 "$PYTHON" tests/gpu/gpu_runwarden.py 2>&1 | tee "$LOGS/gpu-runwarden.log" || status=1
timeout 175 "$PYTHON" tests/gpu/gpu_checks.py 2>&1 | tee "$LOGS/gpu-checks.log" || status=1
echo "tests/gpu/run.sh: $([[ $status == 0 ]] && echo PASSED || echo FAILED) in $((SECONDS - started)) s" \
     "($(date -u +%FT%TZ); logs in $LOGS)"
exit $status
