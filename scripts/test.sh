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
python -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when it collected nothing: a suite that ran no test has failed.
if [[ $rc == 5 ]]; then echo "test.sh: no tests were collected" >&2; exit 1; fi
exit $rc
