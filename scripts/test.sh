#!/usr/bin/env bash
# Sets everything up, then runs the whole test suite: stub check, lint, type check, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNWARDEN_WITH_SLURM=1 bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"

echo "== proto stubs"; python scripts/gen_proto.py --check
echo "== ruff";        ruff check . && ruff format --check .
echo "== mypy";        mypy
echo "== pytest"
set +e
# Two workers on the 2-core machine: the deployments (one "heavy" scope, tests/conftest.py) on one,
# the rest beside it. RUNWARDEN_TEST_WORKERS=0 runs everything in this one process.
# A short base temp dir: agents' and ranks' unix sockets live under the tests' tmp dirs, and a socket
# path holds 107 bytes (pytest's default /tmp/pytest-of-<user>/pytest-<n>/popen-gw<i>/ eats 40).
basetemp=$(mktemp -d /tmp/rwXXXX)
workers="${RUNWARDEN_TEST_WORKERS:-2}"
if [[ $workers == 0 ]]; then
  python -m pytest --basetemp "$basetemp" "$@"
else
  python -m pytest -n "$workers" --dist loadscope --no-loadscope-reorder --basetemp "$basetemp" "$@"
fi
rc=$?
set -e
# Removed after a pass; kept after a failure, for its logs, less any etcd data a test left behind
# (two preallocated 64 MB WAL files a server): a failed run's files then stay well under 1 GB.
if [[ $rc == 0 ]]; then
  rm -rf "$basetemp"
else
  find "$basetemp" -type d -path '*/member/wal' -prune -exec rm -rf {} + 2>/dev/null || true
  echo "test.sh: the tests' files are in $basetemp ($(du -sh "$basetemp" | cut -f1))" >&2
fi
# pytest exits 5 when it collected nothing: a suite that ran no test has failed.
if [[ $rc == 5 ]]; then echo "test.sh: no tests were collected" >&2; exit 1; fi
exit $rc
