#!/usr/bin/env bash
# Starts N processes of one multi-process JAX job on this machine (CPU devices by default).
# Usage: launch/local.sh N [python args...]
#   e.g. launch/local.sh 2 -m flux_jax.train --config configs/toy.py --workdir /tmp/run
# Env: FLUX_JAX_PORT (coordinator port, default 12355), FLUX_JAX_LOCAL_DEVICES (CPU devices per
# process, default 1), JAX_PLATFORMS (default cpu). Exits non-zero if any process fails.
set -euo pipefail

if [[ $# -lt 2 || ! "$1" =~ ^[0-9]+$ || "$1" -lt 1 ]]; then
  echo "usage: $0 NUM_PROCESSES python-args..." >&2
  exit 2
fi
num="$1"
shift
port="${FLUX_JAX_PORT:-12355}"
local_devices="${FLUX_JAX_LOCAL_DEVICES:-1}"
python="${PYTHON:-python}"

pids=()
cleanup() {
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
}
trap cleanup INT TERM

for ((i = 0; i < num; i++)); do
  FLUX_JAX_COORDINATOR="localhost:${port}" \
    FLUX_JAX_NUM_PROCESSES="${num}" \
    FLUX_JAX_PROCESS_ID="${i}" \
    JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" \
    XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${local_devices}" \
    "$python" "$@" &
  pids+=("$!")
done

status=0
for pid in "${pids[@]}"; do
  if ! wait "$pid"; then
    status=1
  fi
done
if [[ $status -ne 0 ]]; then
  cleanup
fi
exit "$status"
