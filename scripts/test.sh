#!/usr/bin/env bash
# Set up, then run ruff, mypy, the import contracts and the whole test suite (unit on both cores, then integration, chaos, deploy) against
# real etcd, torchrun, Prometheus and Helm. CUDA tests (marker gpu) need a GPU: run them with
# `bash scripts/test.sh -m gpu`. Arguments replace the default and go to pytest (e.g. tests/unit -x).
# `bash scripts/test.sh --busy 2 [args]` runs the same with 2 CPU-bound processes spinning beside it.
#
# What pip cannot install -- Prometheus with promtool (Debian package prometheus) and openssl
# (the TLS tests' throwaway certificates) -- is installed here with apt-get when it is missing:
# directly as root, else through `sudo -n`. Where neither works, the script stops with one line
# on stderr naming what is missing. PROMETHEUS_BIN / PROMTOOL_BIN point at binaries elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."

# The Debian packages of the missing system tools, space-separated (empty: nothing is missing).
missing_packages() {
    local packages=()
    if ! { [ -x "${PROMETHEUS_BIN:-}" ] || command -v prometheus >/dev/null 2>&1; } \
            || ! { [ -x "${PROMTOOL_BIN:-}" ] || command -v promtool >/dev/null 2>&1; }; then
        packages+=(prometheus)
    fi
    command -v openssl >/dev/null 2>&1 || packages+=(openssl)
    echo "${packages[*]-}"
}

# Install the missing packages with apt-get (as root, or with passwordless sudo); otherwise, or
# when that fails, print one line on stderr and exit 1. Silent when nothing is missing.
ensure_system_tools() {
    local missing packages
    missing=$(missing_packages)
    [ -z "$missing" ] && return 0
    read -ra packages <<<"$missing"
    local how="apt-get install -y --no-install-recommends $missing"
    local sudo=()
    if [ "$EUID" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo=(sudo -n)
        else
            echo "scripts/test.sh: missing $missing and not root (no passwordless sudo); as root run: $how" >&2
            exit 1
        fi
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "scripts/test.sh: missing $missing and there is no apt-get; install the package(s) $missing with this system's package manager" >&2
        exit 1
    fi
    echo "scripts/test.sh: installing $missing with apt-get" >&2
    local log
    log=$(mktemp)
    if ! { ${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
            && ${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive \
                apt-get install -y -qq --no-install-recommends "${packages[@]}"; } >"$log" 2>&1; then
        echo "scripts/test.sh: apt-get could not install $missing ($(tail -n 1 "$log")); run: $how" >&2
        rm -f "$log"
        exit 1
    fi
    rm -f "$log"
    missing=$(missing_packages)
    if [ -n "$missing" ]; then
        echo "scripts/test.sh: $missing still missing after apt-get install (not on PATH?)" >&2
        exit 1
    fi
}

# `--busy N` first: N CPU-bound processes spin beside the run (a busy machine, as users have;
# docs/testing.md), started here and always stopped when the script ends. BUSY_PIDS_FILE, when
# set, receives their process ids (the script's own test reads it).
busy_pids=()
stop_busy() {
    if [ "${#busy_pids[@]}" -gt 0 ]; then
        kill "${busy_pids[@]}" 2>/dev/null || true
        wait "${busy_pids[@]}" 2>/dev/null || true
    fi
}
trap stop_busy EXIT
if [ "${1:-}" = "--busy" ]; then
    if ! [[ "${2:-}" =~ ^[0-9]+$ ]]; then
        echo "scripts/test.sh: --busy takes a number of busy processes, got '${2:-}'" >&2
        exit 2
    fi
    for _ in $(seq 1 "$2"); do
        bash -c 'while :; do :; done' &
        busy_pids+=("$!")
    done
    [ -n "${BUSY_PIDS_FILE:-}" ] && echo "${busy_pids[*]-}" >"$BUSY_PIDS_FILE"
    echo "scripts/test.sh: $2 busy process(es) spin beside the run: ${busy_pids[*]-}" >&2
    shift 2
fi

# `bash scripts/test.sh --check-system-tools` only checks (and installs) the tools.
if [ "${1:-}" = "--check-system-tools" ]; then
    ensure_system_tools
    exit 0
fi

ensure_system_tools
venv=$(bash scripts/setup.sh test | tail -n 1)
export OMP_NUM_THREADS=1
if [ $# -eq 0 ]; then
    # The whole suite: lint and types first (cheap, and they catch what tests miss).
    "$venv/bin/python" -m ruff check .
    "$venv/bin/python" -m ruff format --check .   # the layout is the formatter's (100 columns)
    "$venv/bin/python" -m mypy
    "$venv/bin/lint-imports"
    # The unit and deploy tiers on both cores (pytest-xdist): their tests are CPU-bound, have no
    # timing assertion and share nothing but fakes, temp paths and free ports (docs/testing.md).
    # The real-process tiers follow one test at a time (their timing assertions assume the
    # machine to themselves). Both always run; the exit status is the first failure's.
    unit=0
    "$venv/bin/python" -m pytest -p no:cacheprovider -n 2 tests/unit tests/deploy -m "not gpu" || unit=$?
    rest=0
    # The 30 slowest tests close the log: the suite's time budget (about 30 min) is kept there.
    "$venv/bin/python" -m pytest -p no:cacheprovider tests --ignore=tests/unit --ignore=tests/deploy \
        -m "not gpu" --durations=30 || rest=$?
    [ "$unit" -ne 0 ] && exit "$unit"
    exit "$rest"
fi
"$venv/bin/python" -m pytest -p no:cacheprovider "$@"
