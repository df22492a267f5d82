#!/usr/bin/env bash
# Sets up everything missing (tools/setup.sh), builds the tests and runs them with ctest.
# Tests labelled `gpu` report as skipped where no GPU is present.
#
#   tools/test.sh [extra ctest arguments...]
set -euo pipefail
# Relative paths in these settings name places under the caller's directory; the tests run
# elsewhere (ctest's working directories), so make them absolute.
for v in ASMEM_CACHE_DIR ASMEM_MODEL ASMEM_BUILD_DIR XDG_CACHE_HOME; do
  if [ -n "${!v:-}" ]; then export "$v=$(realpath -m "${!v}")"; fi
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${ASMEM_BUILD_DIR:-$ROOT/build}"
"$ROOT/tools/setup.sh" asmem asmem_kernels_tests asmem_format_tests asmem_tokenizer_tests \
  asmem_model_tests asmem_golden_tests asmem_dictionary_tests asmem_cluster_tests asmem_compiler_tests \
  asmem_decode_tests asmem_runtime_tests asmem_torch_ops_tests asmem_synth_dictionary asmem_engine_tests asmem_dictionary_prefix_cpu_tests asmem_mac_engine_tests \
  asmem_reuse_tests asmem_query_trace_tests
# GPU test targets exist only in CUDA builds.
targets="$(cmake --build "$BUILD" --target help)"
for t in asmem_kmeans_gpu_tests asmem_decode_gpu_tests asmem_runtime_gpu_tests asmem_engine_gpu_tests \
  asmem_reuse_gpu_tests asmem_mac_engine_gpu_tests; do
  if grep -q "^$t:" <<<"$targets"; then
    cmake --build "$BUILD" -j "${ASMEM_JOBS:-$(nproc)}" --target "$t"
  fi
done
printf '\n== tests\n'
cd "$BUILD"
ctest --output-on-failure -j "${ASMEM_JOBS:-$(nproc)}" "$@"
