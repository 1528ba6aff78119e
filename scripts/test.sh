#!/usr/bin/env bash
# Set up, then run ruff, mypy and the whole test suite (unit, integration, chaos, deploy) against
# real etcd, torchrun, Prometheus and Helm. CUDA tests (marker gpu) need a GPU: run them with
# `bash scripts/test.sh -m gpu`. Arguments replace the default and go to pytest (e.g. tests/unit -x).
# Needs Prometheus and openssl (apt-get install prometheus openssl); .ci/run installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(bash scripts/setup.sh test | tail -n 1)
export OMP_NUM_THREADS=1
if [ $# -eq 0 ]; then
    # The whole suite: lint and types first (cheap, and they catch what tests miss).
    "$venv/bin/python" -m ruff check .
    "$venv/bin/python" -m mypy
    set -- tests -m "not gpu"
fi
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
