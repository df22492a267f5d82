#!/usr/bin/env python3
"""Decode attention with a compiled prefix through torch.ops.asmem, on a CUDA device.

Loads libasmem_torch_ops.so, loads a dictionary on the GPU, builds a random paged KV cache
(the non-prefix tokens of each request), decodes one layer for a batch that mixes requests
with the dictionary and requests without one, and checks:
  - requests without a dictionary against full attention with torch SDPA (fp32) over the
    same tokens (o and lse);
  - every request against the same op on the CPU (the double-accumulation reference);
  - decode_into writing the same step into the caller's (padded) buffers;
  - with --replace: a CUDA graph captured around the op, the dictionary hot-swapped with
    torch.ops.asmem.replace_dictionary, and the replay seeing the new dictionary;
  - with --compile: the step through torch.compile (fullgraph: the op traces with fake
    tensors through its Meta kernel, no graph break) equal to the eager op bit for bit.
Prints the largest errors and the op's latency (CUDA events, median of --iters after
warm-up). Exits with status 1 when an error is over tolerance.

    python3 examples/torch_ops/decode_example.py --lib build/runtime/libasmem_torch_ops.so \
        --dict rulebook.asmd [--replace rebuilt.asmd] [--compile] [--batch 8] [--seq-len 2048]
"""
import argparse
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F


def paged_kv(num_pages, hkv, page_size, d, dtype, device, gen):
    shape = (num_pages, hkv, page_size, d)  # the HND layout (kv_layout="HND")
    k = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    v = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    return k, v


def gather_tokens(cache, pages, t):
    """[n_pages, Hkv, page_size, d] pages of one request -> [Hkv, T, d]."""
    x = cache[pages.long()]                       # [n, Hkv, ps, d]
    x = x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])
    return x[:, :t]


def sdpa_reference(q, k_cache, v_cache, block_table, seq_lens, page_size, b):
    """Full attention of request b in fp32 with torch SDPA, plus its lse."""
    t = int(seq_lens[b])
    hq, d = q.shape[1], q.shape[2]
    n = (t + page_size - 1) // page_size
    k = gather_tokens(k_cache, block_table[b, :n], t).float()   # [Hkv, T, d]
    v = gather_tokens(v_cache, block_table[b, :n], t).float()
    g = hq // k.shape[0]
    k = k.repeat_interleave(g, dim=0)                            # [Hq, T, d]
    v = v.repeat_interleave(g, dim=0)
    qb = q[b].float().unsqueeze(1)                               # [Hq, 1, d]
    o = F.scaled_dot_product_attention(qb, k, v).squeeze(1)      # [Hq, d]
    lse = torch.logsumexp((qb @ k.transpose(1, 2)).squeeze(1) / math.sqrt(d), dim=-1)
    return o, lse


def median_ms(fn, iters, warmup=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", required=True, help="path of libasmem_torch_ops.so")
    ap.add_argument("--dict", required=True, help="dictionary file (.asmd)")
    ap.add_argument("--replace", help="a second dictionary of the same model: hot-swap demo")
    ap.add_argument("--compile", action="store_true", help="also run the step through torch.compile")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048, help="longest non-prefix length")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--dtype", choices=["bf16", "f16"], default="bf16")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.ops.load_library(args.lib)
    asmem = torch.ops.asmem
    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    gen = torch.Generator(device=dev).manual_seed(args.seed)

    slot = asmem.load_dictionary(args.dict, str(dev))
    info = json.loads(asmem.dictionary_info(slot, str(dev)))
    cpu_slot = asmem.load_dictionary(args.dict, "cpu")
    hq, hkv, d = info["num_q_heads"], info["num_kv_heads"], info["head_dim"]
    print(f"dictionary {info['path']}: slot {slot}, L={info['num_layers']} Hq={hq} Hkv={hkv} "
          f"d={d}, {info['total_entries']} entries, {info['device_bytes'] / 2**20:.1f} MiB on {dev}, "
          f"prefix {info['prefix_tokens']} tokens")

    B, ps = args.batch, args.page_size
    seq_lens = torch.randint(1, args.seq_len + 1, (B,), generator=gen, device=dev, dtype=torch.int32)
    seq_lens[0] = args.seq_len
    pages_per_req = (seq_lens + ps - 1) // ps
    max_pages = int(pages_per_req.max())
    num_pages = int(pages_per_req.sum()) + 4
    perm = torch.randperm(num_pages, generator=gen, device=dev).to(torch.int32)
    block_table = torch.zeros((B, max_pages), dtype=torch.int32, device=dev)
    at = 0
    for b in range(B):
        n = int(pages_per_req[b])
        block_table[b, :n] = perm[at:at + n]
        at += n
    k_cache, v_cache = paged_kv(num_pages, hkv, ps, d, dtype, dev, gen)
    q = torch.randn((B, hq, d), generator=gen, device=dev).to(dtype)
    q_pre = torch.randn((B, hq, d), generator=gen, device=dev).to(dtype)
    # Even requests use the dictionary, odd ones do not.
    dict_ids = torch.tensor([slot if b % 2 == 0 else -1 for b in range(B)], dtype=torch.int32, device=dev)
    cpu_ids = torch.tensor([cpu_slot if b % 2 == 0 else -1 for b in range(B)], dtype=torch.int32)

    def step(ids=dict_ids, pre=q_pre):
        return asmem.decode(q, pre, k_cache, v_cache, block_table, seq_lens, ids, args.layer)

    o, lse = step()
    torch.cuda.synchronize()

    # Requests without a dictionary: plain attention over their tokens.
    err_o_sdpa = err_lse_sdpa = 0.0
    for b in range(1, B, 2):
        ref_o, ref_lse = sdpa_reference(q, k_cache, v_cache, block_table, seq_lens, ps, b)
        err_o_sdpa = max(err_o_sdpa, (o[b].float() - ref_o).abs().max().item())
        err_lse_sdpa = max(err_lse_sdpa, (lse[b] - ref_lse).abs().max().item())

    # Every request against the CPU op (DecodeAttentionCpu) on the same inputs.
    o_cpu, lse_cpu = asmem.decode(q.cpu(), q_pre.cpu(), k_cache.cpu(), v_cache.cpu(),
                                  block_table.cpu(), seq_lens.cpu(), cpu_ids, args.layer)
    err_o_cpu = (o.float().cpu() - o_cpu.float()).abs().max().item()
    err_lse_cpu = (lse.cpu() - lse_cpu).abs().max().item()
    with_dict = list(range(0, B, 2))
    gain = (lse[with_dict].cpu() - lse_cpu[with_dict]).abs().max().item()

    tol_o = 2e-2 if dtype == torch.bfloat16 else 4e-3
    ok = err_o_sdpa <= tol_o and err_lse_sdpa <= 1e-2 and err_o_cpu <= tol_o and err_lse_cpu <= 1e-2
    print(f"no-dictionary requests vs torch SDPA (fp32): max |o| error {err_o_sdpa:.3e}, "
          f"max |lse| error {err_lse_sdpa:.3e}")
    print(f"all requests vs the CPU reference op:       max |o| error {err_o_cpu:.3e}, "
          f"max |lse| error {err_lse_cpu:.3e} (dictionary rows' lse error {gain:.3e})")

    # decode_into: the same step written into the caller's buffers (an engine's output, here
    # with each request's row padded past Hq * d).
    o_buf = torch.zeros((B, hq * d + 64), dtype=dtype, device=dev)
    lse_buf = torch.empty((B, hq), dtype=torch.float32, device=dev)
    asmem.decode_into(q, q_pre, k_cache, v_cache, block_table, seq_lens, dict_ids, args.layer,
                      o=o_buf[:, :hq * d].view(B, hq, d), lse=lse_buf)
    torch.cuda.synchronize()
    same_into = (torch.equal(o_buf[:, :hq * d].view(B, hq, d), o) and torch.equal(lse_buf, lse) and
                 not o_buf[:, hq * d:].any().item())
    print(f"decode_into the caller's buffers: equal to decode: {same_into}")
    ok = ok and same_into

    ms_mixed = median_ms(lambda: step(), args.iters)
    none_ids = torch.full((B,), -1, dtype=torch.int32, device=dev)
    ms_none = median_ms(lambda: step(none_ids), args.iters)
    ms_plain = median_ms(lambda: asmem.decode(q, None, k_cache, v_cache, block_table, seq_lens, None,
                                              args.layer), args.iters)
    print(f"latency (median of {args.iters}, B={B}, T<={args.seq_len}, page {ps}): "
          f"mixed batch {ms_mixed * 1e3:.1f} us, dict ids all -1 {ms_none * 1e3:.1f} us, "
          f"no dict_ids {ms_plain * 1e3:.1f} us")

    if args.compile:
        # The op inside a compiled region: traced with fake tensors (the Meta kernel gives
        # o and lse shapes), called as is at run time.
        def decode_and_scale(q_, q_pre_, ids_):
            o_, lse_ = asmem.decode(q_, q_pre_, k_cache, v_cache, block_table, seq_lens, ids_, args.layer)
            return o_ * 2, lse_ + 1

        compiled = torch.compile(decode_and_scale, fullgraph=True)
        c_o, c_lse = compiled(q, q_pre, dict_ids)
        torch.cuda.synchronize()
        same_compiled = torch.equal(c_o, o * 2) and torch.equal(c_lse, lse + 1)
        print(f"torch.compile (fullgraph): equal to the eager op: {same_compiled}")
        ok = ok and same_compiled

    if args.replace:
        # Capture one step in a CUDA graph, then hot-swap the dictionary: the replay reads
        # the slot's new contents (the runtime's view tables live at fixed addresses).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_o, g_lse = step()
        graph.replay()
        torch.cuda.synchronize()
        same_before = torch.equal(g_o, o)
        asmem.replace_dictionary(slot, args.replace, str(dev))
        graph.replay()
        eager_o, eager_lse = step()
        torch.cuda.synchronize()
        # The replay keeps the split plan of its capture; eager steps plan for the new
        # dictionary: equal up to float rounding.
        after_err = (g_o.float() - eager_o.float()).abs().max().item()
        same_after = after_err <= tol_o and (g_lse - eager_lse).abs().max().item() <= 1e-3
        changed = not torch.equal(eager_o[with_dict], o[with_dict])
        unchanged = torch.equal(eager_o[1::2], o[1::2])
        info2 = json.loads(asmem.dictionary_info(slot, str(dev)))
        print(f"hot swap: slot {slot} now {info2['path']} (generation {info2['generation']}); "
              f"graph replay == eager before: {same_before}, after: {same_after} "
              f"(max |o| difference {after_err:.1e}); "
              f"dictionary rows changed: {changed}; other rows unchanged: {unchanged}")
        ok = ok and same_before and same_after and changed and unchanged

    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
