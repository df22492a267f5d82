#!/usr/bin/env python3
"""In-request reuse (MAC) through torch.ops.asmem, on a CUDA device.

Builds a random paged KV cache for a batch of requests, fills each request's rings with its
last W prompt positions (mac_fill), then decodes chained steps with mac_decode, where some
query heads repeat a recent pre-RoPE query (so they hit) and the rest are new (so they
miss). Checks, at every step:
  - the same ops on CPU copies (the double-accumulation reference, its own rings): identical
    hit decisions, outputs within bf16 tolerance;
  - heads that missed against full attention with torch SDPA (fp32) over all their tokens.
Then times one step at --time-context tokens (CUDA events, median of --iters) with every
head missing (tau 1: no hit) and with every head hitting (a filled position's query
repeated), against torch.ops.asmem.decode without a dictionary over the same tokens. Exits
with status 1 when a check fails. (The checked steps use a small window and context: the CPU
reference is naive.)

    python3 examples/torch_ops/mac_example.py --lib build/runtime/libasmem_torch_ops.so \
        [--batch 4] [--context 1024] [--steps 32] [--time-context 32768]
"""
import argparse
import statistics
import sys

import torch
import torch.nn.functional as F


def median_us(fn, iters, warmup=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", required=True, help="path of libasmem_torch_ops.so")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per request (checked steps)")
    ap.add_argument("--time-context", type=int, default=32768, help="tokens per request of the timed steps")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--band", type=int, default=64)
    ap.add_argument("--tau", type=float, default=0.45)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()

    torch.ops.load_library(args.lib)
    asmem = torch.ops.asmem
    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    B, hq, hkv, d, ps, W = args.batch, args.q_heads, args.kv_heads, args.head_dim, args.page_size, args.window
    settings = dict(tau=args.tau, window=W, band=args.band, front_sink=0, min_context=0)
    total = args.context + args.steps + 1
    pages = (total + ps - 1) // ps
    num_pages = B * pages + 3
    k_cache = torch.randn((num_pages, hkv, ps, d), device=dev).to(torch.bfloat16)  # HND layout
    v_cache = torch.randn((num_pages, hkv, ps, d), device=dev).to(torch.bfloat16)
    block_table = torch.randperm(num_pages, device=dev)[:B * pages].to(torch.int32).reshape(B, pages)
    num_slots = B + 2
    slot_ids = torch.randperm(num_slots, device=dev)[:B].to(torch.int32)
    slots = torch.zeros((num_slots, 2), dtype=torch.int32, device=dev)
    slots[slot_ids.long(), 0] += 1  # new requests in these slots
    slots[slot_ids.long(), 1] = 1   # ready

    state = asmem.mac_state(str(dev), 1, num_slots, hq, d, W)
    cpu_state = asmem.mac_state("cpu", 1, num_slots, hq, d, W)

    def cpu(t):
        return t.cpu()

    kc_cpu, vc_cpu, bt_cpu = cpu(k_cache), cpu(v_cache), cpu(block_table)

    # Prefill: the last W prompt positions of every request into its rings.
    n = min(W, args.context)
    q = torch.randn((B, n, hq, d), device=dev).to(torch.bfloat16)
    q_pre = torch.randn((B, n, hq, d), device=dev).to(torch.bfloat16)
    positions = (torch.arange(n, device=dev, dtype=torch.int32) + (args.context - n)).expand(B, n).contiguous()
    seq_lens = torch.full((B,), args.context, dtype=torch.int32, device=dev)
    asmem.mac_fill(q, q_pre, positions, k_cache, v_cache, block_table, seq_lens, slot_ids, slots, state, 0,
                   **settings)
    asmem.mac_fill(cpu(q), cpu(q_pre), cpu(positions), kc_cpu, vc_cpu, bt_cpu, cpu(seq_lens), cpu(slot_ids),
                   cpu(slots), cpu_state, 0, **settings)
    recent = [q_pre[:, i] for i in range(n)]

    ok = True
    hits = misses = 0
    worst_cpu = worst_sdpa = 0.0
    for step in range(args.steps):
        T = args.context + step + 1
        seq_lens = torch.full((B,), T, dtype=torch.int32, device=dev)
        q = torch.randn((B, hq, d), device=dev).to(torch.bfloat16)
        q_pre = torch.randn((B, hq, d), device=dev).to(torch.bfloat16)
        # The first half of the heads repeat a query of 5 positions back (within the window).
        q_pre[:, : hq // 2] = recent[-5][:, : hq // 2]
        recent.append(q_pre)
        o, lse, hit = asmem.mac_decode(q, q_pre, k_cache, v_cache, block_table, seq_lens, slot_ids, slots,
                                       state, 0, None, None, **settings)
        o_c, lse_c, hit_c = asmem.mac_decode(cpu(q), cpu(q_pre), kc_cpu, vc_cpu, bt_cpu, cpu(seq_lens),
                                             cpu(slot_ids), cpu(slots), cpu_state, 0, None, None, **settings)
        if not torch.equal(hit.cpu(), hit_c):
            print(f"step {step}: hit decisions differ from the CPU op")
            ok = False
        rel = ((o.float().cpu() - o_c.float()).norm() / o_c.float().norm()).item()
        worst_cpu = max(worst_cpu, rel)
        hits += int((hit >= 0).sum())
        misses += int((hit < 0).sum())
        # Heads that missed: full attention over their T tokens.
        for b in range(B):
            pg = block_table[b, : (T + ps - 1) // ps].long()
            kb = k_cache[pg].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :T].float()
            vb = v_cache[pg].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :T].float()
            kb = kb.repeat_interleave(hq // hkv, 0)
            vb = vb.repeat_interleave(hq // hkv, 0)
            ref = F.scaled_dot_product_attention(q[b].float().unsqueeze(1), kb, vb).squeeze(1)
            missed = hit[b] < 0
            if missed.any():
                err = (o[b][missed].float() - ref[missed]).abs().max().item()
                worst_sdpa = max(worst_sdpa, err)
    ok = ok and worst_cpu <= 1e-2 and worst_sdpa <= 2e-2 and hits > 0 and misses > 0
    print(f"{args.steps} steps, B={B}, Hq={hq} Hkv={hkv} d={d}, context {args.context}..{args.context + args.steps}: "
          f"{hits} hit and {misses} missed head decisions (identical to the CPU op's: "
          f"{'yes' if ok else 'see above'}); worst relative L2 vs the CPU op {worst_cpu:.2e}; "
          f"missed heads vs torch SDPA (fp32): max |o| error {worst_sdpa:.2e}")

    # Latency at --time-context tokens (GPU only, fresh rings): all miss (tau 1), all hit (the
    # query of a filled position repeated), and the plain decode op over the same tokens.
    T = args.time_context
    pages = (T + ps - 1) // ps
    k_big = torch.randn((B * pages, hkv, ps, d), device=dev).to(torch.bfloat16)
    v_big = torch.randn((B * pages, hkv, ps, d), device=dev).to(torch.bfloat16)
    bt_big = torch.randperm(B * pages, device=dev).to(torch.int32).reshape(B, pages)
    sl_big = torch.full((B,), T, dtype=torch.int32, device=dev)
    big_state = asmem.mac_state(str(dev), 1, num_slots, hq, d, W)
    n = min(W, T - 1)
    q_fill = torch.randn((B, n, hq, d), device=dev).to(torch.bfloat16)
    qp_fill = torch.randn((B, n, hq, d), device=dev).to(torch.bfloat16)
    pos = (torch.arange(n, device=dev, dtype=torch.int32) + (T - 1 - n)).expand(B, n).contiguous()
    asmem.mac_fill(q_fill, qp_fill, pos, k_big, v_big, bt_big, sl_big, slot_ids, slots, big_state, 0, **settings)
    q = torch.randn((B, hq, d), device=dev).to(torch.bfloat16)
    q_new = torch.randn((B, hq, d), device=dev).to(torch.bfloat16)
    q_rep = qp_fill[:, n - 3].contiguous()
    asmem.create_runtime(str(dev), 1, hq, hkv, d)

    def mac(q_pre_, **over):
        return asmem.mac_decode(q, q_pre_, k_big, v_big, bt_big, sl_big, slot_ids, slots, big_state, 0, None, None,
                                **dict(settings, **over))

    _, _, h = mac(q_rep)
    all_hit = bool((h >= 0).all())
    _, _, h = mac(q_new, tau=1.0)
    all_miss = bool((h < 0).all())
    t_miss = median_us(lambda: mac(q_new, tau=1.0), args.iters)
    t_hit = median_us(lambda: mac(q_rep), args.iters)
    t_full = median_us(lambda: asmem.decode(q, None, k_big, v_big, bt_big, sl_big, None, 0), args.iters)
    print(f"latency (median of {args.iters}, B={B}, T={T}): decode without reuse {t_full:.1f} us, "
          f"mac_decode all-miss {t_miss:.1f} us ({t_full / t_miss:.2f}x), all-hit {t_hit:.1f} us "
          f"({t_full / t_hit:.2f}x); every head hit: {all_hit}, missed with tau 1: {all_miss}")
    ok = ok and all_hit and all_miss
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
