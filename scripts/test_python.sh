#!/usr/bin/env bash
# The Python package's tests (docs/python.md): a virtual environment in build/pyenv (or
# $CPATTN_PYENV; reused when present) with the test dependencies, `pip install .` into it, then
# pytest tests/python [pytest args]. Needs the ci preset's command line (build/ci/tools/cpattn),
# which two tests compare with.
# torch is PyPI's wheel, which needs its CUDA library wheels to import even on a CPU (PyPI has no
# CPU-only torch for Linux; libtorch_python.so links libtorch_cuda.so, which links cuDNN, cuBLAS,
# NCCL...; docs/python.md): about 5.5 GB installed. `pip install torch` downloads every wheel
# before it installs one (9-10 GB at its peak with its cache, which ran a CI machine out of
# space), so pip resolves torch first from the index's metadata alone (--dry-run --report), then
# installs what it chose one wheel at a time, uncached, torch last: the peak stays near what is
# installed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${CPATTN_PYENV:-build/pyenv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip install -q --no-cache-dir)
if ! "$py" -c "import torch, numpy, pytest, mpi4py, nanobind, scikit_build_core" 2>/dev/null; then
  "${pip[@]}" --upgrade pip
  "${pip[@]}" numpy pytest mpi4py scikit-build-core nanobind
  report=$(mktemp)
  trap 'rm -f "$report"' EXIT
  "${pip[@]}" --dry-run --ignore-installed --report "$report" torch
  "$py" - "$report" <<'PY' | while IFS= read -r pin; do "${pip[@]}" --no-deps "$pin"; done
import json, sys
pins = [f"{p['metadata']['name']}=={p['metadata']['version']}" for p in json.load(open(sys.argv[1]))["install"]]
print("\n".join(sorted(pins, key=lambda pin: pin.lower().startswith("torch=="))))  # torch last
PY
  "$py" -c "import torch"  # a requirement missing: its name, here
fi
# The package itself; build isolation off: the build requirements are the ones just installed.
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$py" -m pip install -q --no-build-isolation \
  -Cbuild-dir=build/pywheel -Ccmake.define.CPATTN_WARNINGS_AS_ERRORS=ON .
CPATTN_CLI=$PWD/build/ci/tools/cpattn "$py" -m pytest -q tests/python "$@"
