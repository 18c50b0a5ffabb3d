#!/usr/bin/env bash
# Starts N processes of one multi-process run on this machine (coordinator on 127.0.0.1), the
# way a cluster would: process i gets --multiprocess --coordinator_address=127.0.0.1:PORT
# --process_count=N --process_index=i appended to the command.
#
#   scripts/local_multiprocess.sh N [options] [-- COMMAND ARGS...]
#   scripts/local_multiprocess.sh 2 --cpu_devices 2 -- python -m distillspec.train \
#       --gin_file=configs/tests/tiny_multiprocess.gin --gin.MODEL_DIR=\"/tmp/tiny_2p\"
#
# Options:
#   --cpu_devices K   give each process K CPU devices (JAX_PLATFORMS=cpu and XLA's
#                     --xla_force_host_platform_device_count=K); default: the machine's devices
#   --gpu_per_process process i sees only GPU i (CUDA_VISIBLE_DEVICES=i)
#   --port PORT       the coordinator's port (default: a free one)
#   --grace SECONDS   after a process fails, how long the others get to exit before they are
#                     killed (default 10); a failed multi-process run cannot go on
#   --dry_run         print the N commands and exit
# COMMAND defaults to `$PYTHON -m distillspec.train` (PYTHON defaults to python), followed by
# the arguments. SIGTERM or SIGINT to this script is passed on to every process as SIGTERM (a
# preemption: they checkpoint and exit 75). The exit status is 0 if every process exits 0, else
# the first failure's. Use it for tests and a single multi-GPU machine; a cluster's scheduler
# (scripts/slurm/, scripts/tpu/) starts the processes itself.
set -euo pipefail

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
[[ $# -ge 1 ]] || usage 2
[[ "$1" == -h || "$1" == --help ]] && usage 0
N="$1"; shift
[[ "$N" =~ ^[1-9][0-9]*$ ]] || { echo "error: N must be a positive integer, got '$N'" >&2; exit 2; }

CPU_DEVICES="" GPU_PER_PROCESS=0 PORT="" GRACE=10 DRY_RUN=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu_devices) CPU_DEVICES="$2"; shift 2 ;;
    --gpu_per_process) GPU_PER_PROCESS=1; shift ;;
    --port) PORT="$2"; shift 2 ;;
    --grace) GRACE="$2"; shift 2 ;;
    --dry_run) DRY_RUN=1; shift ;;
    --) shift; break ;;
    *) break ;;
  esac
done
PYTHON="${PYTHON:-python}"
if [[ $# -gt 0 && "$1" != -* ]]; then COMMAND=("$@"); else COMMAND=("$PYTHON" -m distillspec.train "$@"); fi
if [[ -z "$PORT" ]]; then
  PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi

process_env() {  # The environment of process $1, as VAR=VALUE words.
  local env=()
  if [[ -n "$CPU_DEVICES" ]]; then
    env+=(JAX_PLATFORMS=cpu "XLA_FLAGS=${XLA_FLAGS:-} --xla_force_host_platform_device_count=$CPU_DEVICES")
  fi
  [[ "$GPU_PER_PROCESS" == 1 ]] && env+=(CUDA_VISIBLE_DEVICES="$1")
  printf '%s\n' "${env[@]+"${env[@]}"}"
}

process_args() {
  printf '%s\n' --multiprocess "--coordinator_address=127.0.0.1:$PORT" "--process_count=$N" \
    "--process_index=$1"
}

if [[ "$DRY_RUN" == 1 ]]; then
  for ((i = 0; i < N; i++)); do
    mapfile -t env < <(process_env "$i"); mapfile -t args < <(process_args "$i")
    printf '%q ' env "${env[@]+"${env[@]}"}" "${COMMAND[@]}" "${args[@]}"; echo
  done
  exit 0
fi

PIDS=()
stop_all() {  # Forward a preemption (SIGTERM) to every process that still runs.
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
}
trap stop_all TERM INT

for ((i = 0; i < N; i++)); do
  mapfile -t env < <(process_env "$i"); mapfile -t args < <(process_args "$i")
  env "${env[@]+"${env[@]}"}" "${COMMAND[@]}" "${args[@]}" &
  PIDS+=($!)
done

STATUS=0 FAILED_AT="" RUNNING=$N
declare -A DONE=()
while [[ $RUNNING -gt 0 ]]; do
  for i in "${!PIDS[@]}"; do
    pid=${PIDS[$i]}
    [[ -n "${DONE[$i]:-}" ]] && continue
    if ! kill -0 "$pid" 2>/dev/null; then
      rc=0; wait "$pid" || rc=$?
      DONE[$i]=$rc; RUNNING=$((RUNNING - 1))
      if [[ $rc -ne 0 ]]; then
        echo "local_multiprocess: process $i exited with status $rc" >&2
        if [[ -z "$FAILED_AT" ]]; then
          [[ $RUNNING -gt 0 ]] && echo "local_multiprocess: stopping the others" >&2
          STATUS=$rc FAILED_AT=$SECONDS
        fi
      fi
    fi
  done
  if [[ -n "$FAILED_AT" && $RUNNING -gt 0 && $((SECONDS - FAILED_AT)) -ge $GRACE ]]; then
    for i in "${!PIDS[@]}"; do
      [[ -z "${DONE[$i]:-}" ]] && kill -KILL "${PIDS[$i]}" 2>/dev/null || true
    done
  fi
  if [[ $RUNNING -gt 0 ]]; then sleep 0.2; fi
done
exit "$STATUS"
