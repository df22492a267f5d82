// Opens a dictionary, loads it into a CPU runtime and runs one decode step of layer 0 on a
// small random batch: request 0 uses the dictionary, request 1 does not. Then one MAC step
// (asmem/reuse.h, in-request reuse) over the same KV with the dictionary's state as its
// prefix, on the CPU reference.
//
//   asmem_consumer DICT.asmd
#include <asmem/dictionary.h>
#include <asmem/error.h>
#include <asmem/reuse.h>
#include <asmem/runtime.h>

#include <cmath>
#include <cstdint>
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

    // MAC: the rings of one layer for 2 request slots, then one step of both requests with
    // the decode's output as their prefix state (16-bit inputs: the MAC op takes bf16/f16).
    asmem::MacDecodeConfig mc;
    mc.batch = B;
    mc.num_q_heads = Hq;
    mc.num_kv_heads = Hkv;
    mc.head_dim = d;
    mc.dtype = asmem::KernelDType::kBF16;
    mc.page_size = 4;
    mc.max_seq_len = pages_per_request * 4;
    mc.num_slots = B;
    mc.mac.min_context = 0;
    std::vector<uint8_t> ring(asmem::MacLayerStateBytes(mc) + 256);
    void* ring_base = ring.data() + (256 - reinterpret_cast<uintptr_t>(ring.data()) % 256) % 256;
    const asmem::MacLayerState state = asmem::MacBindLayerState(mc, ring_base);
    asmem::MacInitLayerStateCpu(mc, state);
    std::vector<asmem::MacSlot> slots(static_cast<size_t>(B));
    for (asmem::MacSlot& sl : slots) sl.ready = 1;
    auto bf16 = [](const std::vector<float>& x) {
      std::vector<uint16_t> y(x.size());
      for (size_t i = 0; i < x.size(); ++i) y[i] = asmem::FloatToBF16Bits(x[i]);
      return y;
    };
    const std::vector<uint16_t> q16 = bf16(q), q_pre16 = bf16(q_pre), k16 = bf16(k), v16 = bf16(v), prefix16 = bf16(o);
    std::vector<uint16_t> mo(q.size());
    std::vector<float> mlse(lse.size());
    std::vector<int32_t> hit(lse.size());
    asmem::MacParams mp;
    mp.batch = B;
    mp.q = q16.data();
    mp.q_stride_b = int64_t(Hq) * d;
    mp.q_stride_h = d;
    mp.q_pre = q_pre16.data();
    mp.q_pre_stride_b = int64_t(Hq) * d;
    mp.q_pre_stride_h = d;
    mp.k_cache = k16.data();
    mp.v_cache = v16.data();
    asmem::MacKvStrides(mc, &mp);
    mp.block_table = block_table.data();
    mp.block_table_stride = pages_per_request;
    mp.seq_lens = seq_lens.data();
    mp.slots = slots.data();
    mp.state = state;
    mp.prefix_o = prefix16.data();
    mp.prefix_stride_b = int64_t(Hq) * d;
    mp.prefix_stride_h = d;
    mp.prefix_lse = lse.data();
    mp.o = mo.data();
    mp.o_stride_b = int64_t(Hq) * d;
    mp.o_stride_h = d;
    mp.lse = mlse.data();
    mp.hit_pos = hit.data();
    asmem::MacAttentionCpu(mc, mp);
    bool mac_finite = true;
    for (float x : mlse) mac_finite = mac_finite && std::isfinite(x);
    for (int32_t h : hit) mac_finite = mac_finite && h == -1;  // an empty ring: every head misses
    std::printf("mac step: lse[0] %.4f, o[0] %.4f, hit_pos[0] %d\n", mlse[0], asmem::BF16BitsToFloat(mo[0]), hit[0]);
    if (!mac_finite) {
      std::fprintf(stderr, "unexpected MAC output\n");
      return 1;
    }
    std::printf("mac ok\n");
  } catch (const asmem::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
