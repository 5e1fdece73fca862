#!/usr/bin/env bash
# The Python package's tests (docs/python.md): a virtual environment in build/pyenv (or
# $CPATTN_PYENV; reused when present) with the test dependencies, `pip install .` into it, then
# pytest tests/python [pytest args]. Needs the ci preset's command line (build/ci/tools/cpattn),
# which two tests compare with.
# torch is PyPI's wheel with its CUDA dependency wheels (about 5 GB, downloaded once per
# venv): PyPI has no CPU-only torch for Linux, and `pip install --no-deps torch` does not
# import (libtorch_cpu.so itself needs libcudart and libcupti; docs/python.md).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${CPATTN_PYENV:-build/pyenv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
if ! "$py" -c "import torch, numpy, pytest, mpi4py, nanobind, scikit_build_core" 2>/dev/null; then
  "$py" -m pip install -q --upgrade pip
  "$py" -m pip install -q torch numpy pytest mpi4py scikit-build-core nanobind
fi
# The package itself; build isolation off: the build requirements are the ones just installed.
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$py" -m pip install -q --no-build-isolation \
  -Cbuild-dir=build/pywheel .
CPATTN_CLI=$PWD/build/ci/tools/cpattn "$py" -m pytest -q tests/python "$@"
