#!/usr/bin/env bash
# Installs what is missing, builds cpattn (optimized) and runs the main job on its built-in
# default. Extra arguments go to the job.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)"
exec build/release/tools/cpattn plan "$@"
