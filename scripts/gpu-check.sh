#!/usr/bin/env bash
# Check a GPU node: the gpu-marked tests and every GPU benchmark claim, each step under its own
# time limit, the whole run within 9.5 minutes on one H100 (set-up excluded); ends with one table
# (claim, CPU figure, GPU figure, target, pass/fail) and writes it, results.json and each step's
# raw log to OUT. Exit 1 when a target is missed or a step fails, 2 when the node cannot run it.
#
#   bash scripts/gpu-check.sh OUT                 # on a node with one or more NVIDIA GPUs
#   bash scripts/gpu-check.sh --dry-run OUT       # anywhere: every step on CPU, tiny sizes
#   bash scripts/gpu-check.sh OUT --only launcher_gpt  # rerun some steps (names: --help)
#
# On a GPU node it uses the CUDA torch of `python3` (or $PYTHON) as it is and never installs
# torch: the few packages that such an image lacks (etcd3, tenacity, the etcd binary) come from
# the wheels in .whl/ ($GPU_WHEELS), which `bash scripts/gpu-wheels.sh` downloads on a machine
# that reaches a registry; they are installed into a folder of their own ($GPU_CHECK_SITE) put
# on PYTHONPATH, the environment of the node left untouched. The dry run uses .venv (made by
# scripts/setup.sh) when there is one. Details: docs/gpu-check.md; code: benchmarks/gpu_check/.
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
for arg in "$@"; do
    [ "$arg" = "--dry-run" ] && dry_run=1
done

if [ "$dry_run" = 1 ]; then
    default_python=python3
    [ -x .venv/bin/python ] && default_python=.venv/bin/python
    python="${PYTHON:-$default_python}"
else
    python="${PYTHON:-python3}"
    wheels="${GPU_WHEELS:-.whl}"
    if compgen -G "$wheels/*.whl" >/dev/null; then
        site="${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/elastic-trainer-gpu-site}"
        echo "gpu-check: installing $(ls "$wheels"/*.whl | wc -l) wheel(s) from $wheels into $site" >&2
        # --no-deps: nothing else (torch least of all) is fetched or replaced.
        if ! "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --disable-pip-version-check --target "$site" "$wheels"/*.whl; then
            echo "gpu-check: pip could not install the wheels of $wheels into $site" >&2
            exit 2
        fi
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m benchmarks.gpu_check "$@"
