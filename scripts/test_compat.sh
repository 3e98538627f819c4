#!/usr/bin/env bash
# runwarden as operators install it, beside the user's torch (issue 32). From the wheel built here:
#   * a controller host: a virtualenv with the wheel alone, no torch;
#   * an agent host at each end of the supported torch range (nodeagent.trainer.torch_api.SUPPORTED):
#     a virtualenv with that torch and the wheel's [torch] extra.
# In each agent host's virtualenv the tests that touch torch run: the installs themselves
# (tests/compat), the private torch calls, the trainer side, the bootstrap, the flight recorder, the
# warm path and live supervised runs (instrumented and unmodified) whose agents run from that install
# and whose controller runs from the controller host's.
# Each torch virtualenv is kept in $RUNWARDEN_COMPAT_CACHE (torch alone is 5-7 GB; from this machine's
# disk, ~2.5 min each the first time); the wheel is installed afresh every run.
#   RUNWARDEN_COMPAT_TORCH="2.9.1 2.14.1"   the torch versions (the range's ends by default)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
repo=$PWD
versions=${RUNWARDEN_COMPAT_TORCH:-"2.9.1 2.14.1"}
cache=${RUNWARDEN_COMPAT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/runwarden-compat}
work=$(mktemp -d /tmp/rwcXXXX)
mkdir -p "$cache"
PY=${PYTHON:-python3}

# pip, its exit status kept, without the lines this machine's index configuration prints on every call
pip_q() {
  local out status=0
  out=$("$@" 2>&1) || status=$?
  printf '%s\n' "$out" | grep -v '^WARNING: Location' || true
  return "$status"
}

echo "== build the wheel"
pip_q .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" .
wheel=$(ls "$work"/dist/runwarden-*.whl)
echo "built $(basename "$wheel")"

# The testbed (private etcd, test clusters) and the tests stay in this checkout: a .pth at the END of
# sys.path lets an agent host's venv import them while runwarden itself comes from the wheel.
testbed_pth() {
  local site
  site=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$repo" > "$site/runwarden-testbed.pth"
}

echo "== controller host: the wheel, no torch"
ctl_venv="$work/controller-host"
"$PY" -m venv "$ctl_venv"
pip_q "$ctl_venv/bin/python" -m pip install -q "$wheel"
export RUNWARDEN_TESTBED_CONTROLLER_BIN="$ctl_venv/bin"

rc=0
for version in $versions; do
  venv="$cache/torch-$version"
  echo "== agent host: torch $version and the wheel's [torch] extra"
  if [[ ! -f $venv/.torch-installed ]]; then
    rm -rf "$venv"
    "$PY" -m venv "$venv"
    pip_q "$venv/bin/python" -m pip install -q "torch==$version" numpy
    touch "$venv/.torch-installed"
  fi
  pip_q "$venv/bin/python" -m pip install -q --force-reinstall --no-deps "$wheel"
  # the wheel's own dependencies, then what the tests use; torch stays the one installed above
  pip_q "$venv/bin/python" -m pip install -q "${wheel}[torch]" "torch==$version" \
    "pytest>=8,<10" "pytest-timeout>=2.3,<3" "hypothesis>=6.100,<7" "cryptography>=42,<60"
  testbed_pth "$venv"
  (cd / && "$venv/bin/python" -c 'import torch, runwarden; print(f"torch {torch.__version__}, runwarden {runwarden.__version__} from {runwarden.__file__}")')
  set +e
  (cd "$repo" && "$venv/bin/python" -m pytest -p no:cacheprovider --basetemp "$work/t$version" -q \
    tests/compat \
    tests/nodeagent/test_torch_api.py \
    tests/nodeagent/test_trainer.py \
    tests/nodeagent/test_dcp.py \
    tests/nodeagent/test_bootstrap.py \
    tests/nodeagent/test_flight_recorder_rpc.py \
    tests/nodeagent/test_warm_leader.py \
    tests/nodeagent/test_warm_restart.py \
    tests/e2e/test_live_controller.py \
    tests/live/test_unmodified_script.py)
  status=$?
  set -e
  [[ $status == 0 ]] || rc=$status
done

if [[ $rc == 0 ]]; then
  rm -rf "$work"
else
  find "$work" -type d -path '*/member/wal' -prune -exec rm -rf {} + 2>/dev/null || true
  echo "test_compat.sh: the tests' files are in $work" >&2
fi
exit $rc
