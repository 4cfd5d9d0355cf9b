#!/usr/bin/env bash
# Starts N processes of one multi-process JAX job on this machine (CPU devices by default).
# Usage: launch/local.sh N [python args...]
#   e.g. launch/local.sh 2 -m flux_jax.train --config configs/toy.py --workdir /tmp/run
# Env: FLUX_JAX_PORT (coordinator port, default 12355); FLUX_JAX_LOCAL_DEVICES (devices per process,
# default 1: CPU devices each, or with JAX_PLATFORMS=cuda|rocm GPUs i*k..i*k+k-1 for process i);
# JAX_PLATFORMS (default cpu); FLUX_JAX_LOG_DIR (each process's output to DIR/process_<i>.log instead
# of this terminal); PYTHON (default python).
# SIGTERM / SIGINT to this script are passed on once to every process (each saves and stops, as under
# SLURM). A process that dies makes the others stop by themselves (flux_jax.distributed heartbeats).
# Exits 0 when every process did, else with the first non-zero status.
set -euo pipefail

if [[ $# -lt 2 || ! "$1" =~ ^[0-9]+$ || "$1" -lt 1 ]]; then
  echo "usage: $0 NUM_PROCESSES python-args..." >&2
  exit 2
fi
num="$1"
shift
port="${FLUX_JAX_PORT:-12355}"
local_devices="${FLUX_JAX_LOCAL_DEVICES:-1}"
platforms="${JAX_PLATFORMS:-cpu}"
python="${PYTHON:-python}"
log_dir="${FLUX_JAX_LOG_DIR:-}"
if [[ ! "$local_devices" =~ ^[0-9]+$ || "$local_devices" -lt 1 ]]; then
  echo "FLUX_JAX_LOCAL_DEVICES=$local_devices must be a positive integer" >&2
  exit 2
fi
[[ -n "$log_dir" ]] && mkdir -p "$log_dir"
# Each process in its own session: a Ctrl-C reaches it once, through the trap below.
setsid=()
command -v setsid >/dev/null 2>&1 && setsid=(setsid)

pids=()
for ((i = 0; i < num; i++)); do
  device_env=()
  unset_env=()
  if [[ "$platforms" == cpu ]]; then
    device_env=(XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${local_devices}")
    # A CPU job of several processes that loads executables from a persistent compilation cache
    # can deadlock in its first cross-process collective (seen with jax 0.10.2): compile afresh.
    if [[ "$num" -gt 1 ]]; then unset_env=(-u JAX_COMPILATION_CACHE_DIR); fi
  else
    ids=$(seq -s, $((i * local_devices)) $((i * local_devices + local_devices - 1)))
    device_env=(FLUX_JAX_LOCAL_DEVICE_IDS="$ids")
  fi
  cmd=(env "${unset_env[@]}" FLUX_JAX_COORDINATOR="localhost:${port}" FLUX_JAX_NUM_PROCESSES="${num}" FLUX_JAX_PROCESS_ID="${i}"
    JAX_PLATFORMS="${platforms}" "${device_env[@]}" "${setsid[@]}" "$python" "$@")
  if [[ -n "$log_dir" ]]; then
    "${cmd[@]}" >"$log_dir/process_$i.log" 2>&1 &
  else
    "${cmd[@]}" &
  fi
  pids+=("$!")
done

forward() {
  for pid in "${pids[@]}"; do
    kill -s "$1" "$pid" 2>/dev/null || true
  done
}
trap 'forward TERM' TERM
trap 'forward INT' INT

status=0
for pid in "${pids[@]}"; do
  while true; do
    rc=0
    wait "$pid" || rc=$?
    # A trapped signal interrupts `wait` while the process still runs (or is not yet reaped).
    kill -0 "$pid" 2>/dev/null || break
  done
  if [[ $rc -ne 0 && $status -eq 0 ]]; then
    status=$rc
  fi
done
exit "$status"
