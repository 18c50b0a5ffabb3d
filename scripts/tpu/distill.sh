#!/usr/bin/env bash
# Distillation on a Cloud TPU VM slice: one process per TPU VM worker, all started by
# `gcloud compute tpus tpu-vm ssh --worker=all`. JAX finds the coordinator, the process count
# and each worker's index in the TPU VM metadata, so the command only says --multiprocess.
#
#   scripts/tpu/distill.sh [--dry_run] STEP... [-- TRAIN_ARGS...]
#   scripts/tpu/distill.sh create copy install train -- --gin_file=experiments/gkd.gin \
#       --gin.MODEL_DIR=\"/mnt/runs/gkd\" --gin.TEACHER_CHECKPOINT=\"/mnt/target\" \
#       --gin.STUDENT_CHECKPOINT=\"/mnt/draft\" --gin.train.mesh_shape="(4, 4)"
#
# Steps, in the order given:
#   create   the TPU VM slice (SPOT=1 for spot capacity, which can be preempted)
#   copy     this checkout (without .git, runs/, virtual environments) to every worker
#   install  jax[tpu] and this package on every worker
#   train    python -m distillspec.train --multiprocess TRAIN_ARGS... on every worker
#   delete   the slice
# Settings (environment): TPU_NAME (default distillspec), ZONE (us-central2-b),
# ACCELERATOR_TYPE (v4-32: 4 workers), TPU_VERSION (tpu-ubuntu2204-base), PROJECT (gcloud's
# default project if unset), REMOTE_DIR (distillspec, in each worker's home).
#
# MODEL_DIR and the checkpoints it reads must be one directory every worker sees (e.g. a
# Cloud Storage bucket mounted with gcsfuse at the same path, or Filestore). A preempted spot
# slice sends SIGTERM: every worker saves a checkpoint and exits 75 (preempted: rerun to
# resume); recreate the slice and run the same `train` step to resume. --dry_run prints the gcloud commands without running them.
set -euo pipefail

DRY_RUN=0
if [[ "${1:-}" == --dry_run ]]; then DRY_RUN=1; shift; fi
STEPS=()
while [[ $# -gt 0 && "$1" != -- ]]; do STEPS+=("$1"); shift; done
[[ "${1:-}" == -- ]] && shift
TRAIN_ARGS=("$@")
if [[ ${#STEPS[@]} -eq 0 ]]; then
  sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi

TPU_NAME="${TPU_NAME:-distillspec}"
ZONE="${ZONE:-us-central2-b}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v4-32}"
TPU_VERSION="${TPU_VERSION:-tpu-ubuntu2204-base}"
REMOTE_DIR="${REMOTE_DIR:-distillspec}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
GCLOUD=(gcloud compute tpus tpu-vm)
LOCATION=(--zone="$ZONE")
[[ -n "${PROJECT:-}" ]] && LOCATION+=(--project="$PROJECT")
ARCHIVE="${TMPDIR:-/tmp}/distillspec-code.tar.gz"

run() {  # Prints the command; runs it unless --dry_run.
  printf '%q ' "$@"; echo
  [[ "$DRY_RUN" == 1 ]] || "$@"
}

on_all_workers() {
  run "${GCLOUD[@]}" ssh "$TPU_NAME" "${LOCATION[@]}" --worker=all --command="$1"
}

for step in "${STEPS[@]}"; do
  case "$step" in
    create)
      capacity=()
      [[ "${SPOT:-0}" == 1 ]] && capacity=(--spot)
      run "${GCLOUD[@]}" create "$TPU_NAME" "${LOCATION[@]}" \
        --accelerator-type="$ACCELERATOR_TYPE" --version="$TPU_VERSION" "${capacity[@]+"${capacity[@]}"}"
      ;;
    copy)
      run tar -czf "$ARCHIVE" -C "$REPO" --exclude=.git --exclude=runs --exclude=.venv \
        --exclude=venv --exclude=__pycache__ .
      run "${GCLOUD[@]}" scp "$ARCHIVE" "$TPU_NAME:distillspec-code.tar.gz" "${LOCATION[@]}" \
        --worker=all
      on_all_workers "mkdir -p $REMOTE_DIR && tar -xzf distillspec-code.tar.gz -C $REMOTE_DIR"
      ;;
    install)
      on_all_workers "pip install -U 'jax[tpu]' && pip install -e $REMOTE_DIR"
      ;;
    train)
      args="$(printf '%q ' "${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"}")"
      on_all_workers "cd $REMOTE_DIR && python3 -m distillspec.train --multiprocess $args"
      ;;
    delete)
      run "${GCLOUD[@]}" delete "$TPU_NAME" "${LOCATION[@]}" --quiet
      ;;
    *)
      echo "error: unknown step '$step'; steps: create copy install train delete" >&2
      exit 2
      ;;
  esac
done
