#!/usr/bin/env bash
# Set up, then run the whole test suite (unit, integration, chaos, deploy) against real etcd,
# torchrun, Prometheus and Helm. Extra arguments go to pytest (e.g. tests/unit -x).
# Needs Prometheus (apt-get install prometheus); .ci/run installs it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(bash scripts/setup.sh test | tail -n 1)
export OMP_NUM_THREADS=1
exec "$venv/bin/python" -m pytest -p no:cacheprovider "${@:-tests}"
