#!/usr/bin/env bash
# Installs what is missing, builds cpattn (optimized) and runs the main job on its built-in
# default: CP attention forward and backward over 2 MPI ranks on a packed batch of 4096
# tokens, checked against a single-process run. Extra arguments go to `cpattn run`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)"
if [ "$(id -u)" -eq 0 ]; then  # Open MPI refuses root unless told
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
exec mpirun -np "${CPATTN_RANKS:-2}" --oversubscribe build/release/tools/cpattn run "$@"
