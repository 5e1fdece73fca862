#!/usr/bin/env bash
# Installs cpattn's build and test dependencies from Debian 12's packages. Idempotent: it
# installs only what is missing, and does nothing (not even apt-get update) when all is there.
set -euo pipefail
packages=(
  cmake ninja-build g++ pkg-config        # build
  libgtest-dev libgmock-dev               # tests
  libbenchmark-dev                        # benchmarks
  libcli11-dev nlohmann-json3-dev         # command line and its JSON output
  openmpi-bin libopenmpi-dev              # the distributed engine
  libopenblas-dev                         # GEMM for the training example
  python3 python3-numpy                   # command-line tests
  python3-venv python3-dev                # the Python package (scripts/test_python.sh)
  clang-14 libclang-rt-14-dev             # libFuzzer targets
  iproute2 iptables                       # the multi-host tests (network namespaces)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
