#!/usr/bin/env bash
# Set up, then watch a two-node job heal from real faults: an etcd and two `elastic-trainer run`
# nodes on this machine train the built-in example while a node joins, a worker is SIGKILLed and a
# node leaves with SIGTERM; the closing summary gives each recovery time and the steps lost.
# About 90 s; MAX_STEPS=300 shortens it. Node metrics on http://127.0.0.1:${METRICS_PORT:-9400}/metrics
# (node b on the next port) while it runs; checkpoints and logs in ${DEMO_DIR:-runs/demo}.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(bash scripts/setup.sh etcd | tail -n 1)
exec "$venv/bin/elastic-trainer" demo "$@"
