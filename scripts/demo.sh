#!/usr/bin/env bash
# Set up, then train the built-in example elastically (--nnodes 1:2) on an embedded etcd, with
# the node's Prometheus metrics on http://127.0.0.1:${METRICS_PORT:-9400}/metrics.
# Extra arguments go to `elastic-trainer run` before the module (e.g. --nproc-per-node 4).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(bash scripts/setup.sh etcd | tail -n 1)
ckpt="${CHECKPOINT_DIR:-runs/demo/checkpoints}"
mkdir -p "$ckpt"
exec "$venv/bin/elastic-trainer" run --nnodes 1:2 --nproc-per-node 2 \
    --metrics-port "${METRICS_PORT:-9400}" --metrics-addr 127.0.0.1 "$@" \
    -m elastic_trainer.examples.synthetic_cnn \
    --max-steps "${MAX_STEPS:-200}" --epochs 2 --global-batch-size 64 \
    --checkpoint-dir "$ckpt" --checkpoint-every 50 --seed 0
