#!/usr/bin/env bash
# Create .venv with this project installed. torch is pinned to 2.13.0 on purpose: on these
# machines that is the CPU wheel on disk; an unpinned torch would pull GBs of CUDA packages,
# and every later install only sees a range that 2.13.0 satisfies, so it never upgrades torch.
# Usage: scripts/setup.sh [EXTRAS]   (e.g. "etcd" or "test")
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-etcd}"
venv="${VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
quiet=(-q --disable-pip-version-check)
"$venv/bin/pip" install "${quiet[@]}" "torch==2.13.0"
"$venv/bin/pip" install "${quiet[@]}" -e ".[${extras}]" "torch==2.13.0"
echo "$venv"
