#!/usr/bin/env bash
# Sets up everything runwarden needs on a fresh Debian machine (Python 3.11, root):
# Debian's etcd-server and prometheus (for promtool: the alert-rule tests), then a virtual
# environment in .venv with runwarden and its extras.
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need_apt+=(etcd-client)
# promtool checks and unit-tests deploy/prometheus/alerts.yaml; the prometheus service itself stays off.
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
if [[ "${RUNWARDEN_WITH_SLURM:-0}" == 1 ]]; then
  command -v slurmctld >/dev/null 2>&1 || need_apt+=(slurmctld slurmd slurm-client munge)
fi
if (( ${#need_apt[@]} )); then
  echo "setup: installing ${need_apt[*]} from Debian"
  # Keep the packages from starting system daemons: tests and the demo start their own.
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  if [[ " ${need_apt[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null 2>&1; then
    # only promtool is wanted: the package enables a Prometheus server for the next boot; not that
    systemctl disable prometheus >/dev/null 2>&1 || true
  fi
fi

PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  if ! "$PY" -m venv .venv 2>/dev/null; then
    # Debian's own python3 ships venv/ensurepip separately.
    rm -rf .venv
    echo "setup: installing python3-venv from Debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
    "$PY" -m venv .venv
  fi
fi
stamp=.venv/.runwarden-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  echo "setup: installing runwarden and its extras into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch==2.13.0 exactly, inside the [torch] extra's range: that CPU build installs from local disk
  # (the range alone would pull the newest CUDA build); ray==2.40.0 (the [ray] extra) for
  # tests/backends/test_ray.py's real Ray cluster.
  .venv/bin/python -m pip install -q -e ".[torch,plot,kubernetes,ray,dev]" torch==2.13.0
  touch "$stamp"
fi
# testbed/ (the private etcd, the namespace fleet, the test clusters the tests, benchmarks and the demo
# stand up) is not part of the wheel: the dev venv finds it through the repo root.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD" > "$site/runwarden-testbed.pth"
