#!/bin/bash
# Slurm Prolog: refuse a bad node before a job starts on it.
#
# slurm.conf:
#   Prolog=/opt/runwarden/deploy/slurm/prolog.sh
#   PrologFlags=Alloc          # run at allocation on every node, not at the first step
#
# Runs `preflight run --quick` (at most ~15 s). preflight's exit codes: 0 all checks passed,
# 1 a check FAILED, 2 preflight could not run. On 1 this drains the node with a reason that
# starts with "runwarden:" (so runwarden may RESUME it after a burn-in, and never touches an
# operator's drain) and exits 1: Slurm then requeues the job onto other nodes. On 2 or a
# timeout the job starts and the event is logged: a broken checker must not drain a fleet.
#
# Settings come from the environment or KEY=VALUE lines in $RUNWARDEN_PROLOG_CONF
# (default /etc/runwarden/slurm-prolog.conf; read as data, never sourced):
#   RUNWARDEN_PREFLIGHT          the preflight command (default: `preflight` from PATH)
#   RUNWARDEN_PREFLIGHT_TIMEOUT  seconds (default 30)
#   SLURM_CONF                   for scontrol, when not the default
set -u
PATH=${PATH:-/usr/sbin:/usr/bin:/sbin:/bin}:/usr/local/bin:/usr/sbin:/usr/bin
conf=${RUNWARDEN_PROLOG_CONF:-/etc/runwarden/slurm-prolog.conf}
if [[ -r $conf ]]; then
  while IFS='=' read -r key value; do
    case $key in
      RUNWARDEN_PREFLIGHT | RUNWARDEN_PREFLIGHT_TIMEOUT | SLURM_CONF) export "$key=$value" ;;
    esac
  done < "$conf"
fi
preflight=${RUNWARDEN_PREFLIGHT:-preflight}
timeout_s=${RUNWARDEN_PREFLIGHT_TIMEOUT:-30}
node=${SLURMD_NODENAME:-$(hostname -s)}
log() { logger -t runwarden-prolog "$node job ${SLURM_JOB_ID:-?}: $*" 2>/dev/null || true; echo "runwarden-prolog: $node: $*" >&2; }

out=$(timeout --kill-after=5 "$timeout_s" "$preflight" run --quick 2>&1)
rc=$?
case $rc in
  0) exit 0 ;;
  1)
    # The evidence: the first line naming a failed check, else the last line of the report.
    evidence=$(grep -m 1 -i 'fail' <<< "$out" || tail -n 1 <<< "$out")
    evidence=$(tr -s '[:space:]|' ' ' <<< "$evidence" | cut -c 1-150)
    log "preflight FAILED: $evidence; draining"
    scontrol update NodeName="$node" State=DRAIN Reason="runwarden: preflight FAIL: ${evidence:-no detail}" ||
      log "scontrol update failed"
    exit 1 ;;
  *)
    log "preflight could not run (exit $rc): $(tail -n 1 <<< "$out" | cut -c 1-150); letting the job start"
    exit 0 ;;
esac
