#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks (packages, the bundled model) and builds
# asmem. Idempotent: a second run only rebuilds what changed.
#
#   tools/setup.sh [cmake targets...]      (default: every target)
#
#   ASMEM_BUILD_DIR   build directory (default: <repo>/build)
#   ASMEM_CACHE_DIR   model cache (default: ${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/asmem)
#   ASMEM_JOBS        parallel build jobs (default: nproc)
set -euo pipefail

# Relative paths in these settings name places under the caller's directory; the tests run
# elsewhere (ctest's working directories), so make them absolute.
for v in ASMEM_CACHE_DIR ASMEM_MODEL ASMEM_BUILD_DIR XDG_CACHE_HOME; do
  if [ -n "${!v:-}" ]; then export "$v=$(realpath -m "${!v}")"; fi
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${ASMEM_BUILD_DIR:-$ROOT/build}"
JOBS="${ASMEM_JOBS:-$(nproc)}"

step() { printf '\n== %s\n' "$*"; }

# --- Debian packages -------------------------------------------------------------------
PKGS=(build-essential cmake ninja-build ccache pkg-config unzip ca-certificates
      libtorch-dev libfaiss-dev libopenblas-dev libprotobuf-dev protobuf-compiler
      libcli11-dev libgtest-dev nlohmann-json3-dev libspdlog-dev libxxhash-dev libicu-dev)
if ! command -v python3 >/dev/null 2>&1 || ! python3 -m pip --version >/dev/null 2>&1; then
  PKGS+=(python3 python3-pip)
fi
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  step "installing ${#missing[@]} Debian packages: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  step "Debian packages: all present"
fi

# --- the bundled model -------------------------------------------------------------------
step "model"
"$ROOT/tools/fetch_model.sh"

# --- build ---------------------------------------------------------------------------------
if [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
export CCACHE_DIR="${CCACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/ccache}"
step "configure ($BUILD)"
mkdir -p "$BUILD"
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$BUILD/configure.log" 2>&1 \
  || { cat "$BUILD/configure.log"; exit 1; }
grep -E '^-- asmem:' "$BUILD/configure.log" || true
step "build (${*:-all targets}, $JOBS jobs)"
if [ $# -gt 0 ]; then
  cmake --build "$BUILD" -j "$JOBS" --target "$@"
else
  cmake --build "$BUILD" -j "$JOBS"
fi
