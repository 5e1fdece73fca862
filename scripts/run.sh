#!/usr/bin/env bash
# Installs what is missing, builds cpattn (optimized) and runs the main job on its built-in
# default: a small causal LM trained on the license texts of /usr/share/common-licenses with
# context parallelism over 2 MPI ranks (CPATTN_RANKS to change). Extra arguments go to
# `cpattn train`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target cpattn_cli  # the main job needs the CLI alone
if [ "$(id -u)" -eq 0 ]; then  # Open MPI refuses root unless told
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
ranks=${CPATTN_RANKS:-2}
exec mpirun -np "$ranks" --oversubscribe build/release/tools/cpattn train --cp "$ranks" "$@"
