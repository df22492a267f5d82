// Writes a synthetic dictionary (random finite data of a given model shape) for the
// install test, the examples and GPU runs without a compiled dictionary at hand.
//
//   asmem_synth_dictionary OUT.asmd [L Hq Hkv d K [parents [seed [whitening]]]]
//
// Defaults: 2 layers, Hq 6, Hkv 2, d 8, K 37 (section i holds K + 3i entries), no parents.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "runtime/runtime_test_util.h"

int main(int argc, char** argv) {
  if (argc < 2 || argc > 10 || (argc > 2 && argc < 7)) {
    std::fprintf(stderr, "usage: %s OUT.asmd [L Hq Hkv d K [parents [seed [whitening 0|1]]]]\n",
                 argv[0]);
    return 2;
  }
  asmem::test::SynthSpec s;
  auto num = [&](int i) { return std::strtoll(argv[i], nullptr, 10); };
  if (argc >= 7) {
    s.L = int32_t(num(2));
    s.Hq = int32_t(num(3));
    s.Hkv = int32_t(num(4));
    s.d = int32_t(num(5));
    s.K = num(6);
  }
  if (argc >= 8) s.parents = num(7);
  if (argc >= 9) s.seed = uint64_t(num(8));
  if (argc >= 10) s.whitening = num(9) != 0;
  if (s.parents > 0) s.top_m = 4;
  try {
    asmem::test::WriteSynthDictionary(argv[1], s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "asmem_synth_dictionary: %s\n", e.what());
    return 1;
  }
  std::printf("wrote %s: L=%d Hq=%d Hkv=%d d=%d K=%lld parents=%lld\n", argv[1], s.L, s.Hq, s.Hkv,
              s.d, (long long)s.K, (long long)s.parents);
  return 0;
}
