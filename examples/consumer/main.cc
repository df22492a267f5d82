// Opens a dictionary, loads it into a CPU runtime and runs one decode step of layer 0 on a
// small random batch: request 0 uses the dictionary, request 1 does not.
//
//   asmem_consumer DICT.asmd
#include <asmem/dictionary.h>
#include <asmem/error.h>
#include <asmem/runtime.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DICT.asmd\n", argv[0]);
    return 2;
  }
  try {
    // The model shape: a real engine knows it; here it comes from the file.
    const asmem::ModelFingerprint model =
        asmem::DictionaryFile::open(argv[1], /*verify_data=*/false)->manifest().model;
    asmem::RuntimeOptions opt;  // CPU
    opt.num_layers = int32_t(model.n_layers);
    opt.num_q_heads = int32_t(model.n_heads);
    opt.num_kv_heads = int32_t(model.n_kv_heads);
    opt.head_dim = int32_t(model.head_dim);
    opt.step.dtype = asmem::KernelDType::kF32;
    opt.step.page_size = 4;
    opt.step.max_batch = 2;
    asmem::DecodeRuntime rt(opt);
    const int32_t slot = rt.load(argv[1]);

    const int B = 2, Hq = opt.num_q_heads, Hkv = opt.num_kv_heads, d = opt.head_dim;
    const int T = 6, pages_per_request = 2, num_pages = B * pages_per_request;
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    std::vector<float> q(size_t(B) * Hq * d), q_pre(q.size());
    std::vector<float> k(size_t(num_pages) * Hkv * 4 * d), v(k.size());
    for (auto* buf : {&q, &q_pre, &k, &v}) {
      for (float& x : *buf) x = nd(rng);
    }
    const std::vector<int32_t> block_table = {0, 1, 2, 3};  // [B, 2] pages of 4 tokens
    const std::vector<int32_t> seq_lens = {T, T};
    const std::vector<int32_t> dict_ids = {slot, -1};
    std::vector<float> o(q.size()), lse(size_t(B) * Hq);
    std::vector<int32_t> index(size_t(B) * Hkv);

    asmem::DecodeArgs a;
    a.batch = B;
    a.q = q.data();
    a.q_pre = q_pre.data();
    a.k_cache = k.data();
    a.v_cache = v.data();
    a.block_table = block_table.data();
    a.block_table_stride = pages_per_request;
    a.seq_lens = seq_lens.data();
    a.dict_ids = dict_ids.data();
    a.o = o.data();
    a.lse = lse.data();
    a.lookup_index = index.data();
    rt.decode(/*layer=*/0, a);

    bool finite = true;
    for (float x : o) finite = finite && std::isfinite(x);
    for (float x : lse) finite = finite && std::isfinite(x);
    const asmem::DictionaryInfo info = *rt.info(slot);
    std::printf("dictionary %s: slot %d, %lld entries, L=%d Hq=%d Hkv=%d d=%d\n", info.path.c_str(),
                slot, (long long)info.total_entries, opt.num_layers, Hq, Hkv, d);
    std::printf("request 0 (dictionary): lookup entry %d, lse[0] %.4f, o[0] %.4f\n", index[0],
                lse[0], o[0]);
    std::printf("request 1 (none):       lookup entry %d, lse[0] %.4f, o[0] %.4f\n",
                index[size_t(Hkv)], lse[size_t(Hq)], o[size_t(Hq) * d]);
    if (!finite || index[0] < 0 || index[size_t(Hkv)] != -1) {
      std::fprintf(stderr, "unexpected decode output\n");
      return 1;
    }
    std::printf("decode ok\n");
  } catch (const asmem::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
