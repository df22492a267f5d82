#!/usr/bin/env python3
"""Decode latency of torch SDPA (flash and cuDNN backends) for asmem_bench_decode's shapes.

Full attention of one new token over P + T cached tokens: q [B, Hq, 1, d],
k/v [B, Hkv, P+T, d], bf16, enable_gqa=True. Each backend is forced with
torch.nn.attention.sdpa_kernel; a backend that refuses a shape is recorded with its error.
Timing: torch.cuda.Event around each call after warm-up, median of --iters calls; a
torch.cuda._sleep first keeps the host ahead of the GPU so launch time is not measured; when
a config's K/V fit in L2 several times, calls rotate over several K/V copies.

    python3 tools/bench_sdpa.py --out sdpa.json [--quick]

A cross-check from Python: asmem_bench_decode itself measures the same SDPA backends in its
own process through libtorch (when built against a CUDA torch) and takes the baseline from
there.
"""
import argparse
import datetime
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from atomic_write import write_atomic

SHAPES = {"llama-3.1-8b": (32, 8), "gqa-8": (32, 4)}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
L2_BYTES = 60e6


def time_backend(backend, qs, ks, vs, iters, warmup):
    with sdpa_kernel([backend]):
        n = len(qs)
        for i in range(warmup):
            F.scaled_dot_product_attention(qs[i % n], ks[i % n], vs[i % n], enable_gqa=True)
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        torch.cuda._sleep(50_000_000)  # host head start (~25 ms of GPU spin)
        for i in range(iters):
            ev[i][0].record()
            F.scaled_dot_product_attention(qs[i % n], ks[i % n], vs[i % n], enable_gqa=True)
            ev[i][1].record()
        torch.cuda.synchronize()
    us = [1e3 * a.elapsed_time(b) for a, b in ev]
    return statistics.median(us), sum(us) / len(us), min(us)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="B {1, 32}, P {32K}")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--batches", nargs="+", type=int, default=None)
    ap.add_argument("--prefixes", nargs="+", type=int, default=None)
    ap.add_argument("--rest-tokens", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    if args.iters < 30:
        sys.exit("--iters must be >= 30")
    batches = args.batches or ([1, 32] if args.quick else [1, 8, 32, 64])
    prefixes = args.prefixes or ([32768] if args.quick else [8192, 32768, 131072])
    T, d = args.rest_tokens, args.head_dim
    dev = torch.device("cuda")
    torch.manual_seed(0)
    results = []
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        sys.exit(f"bench_sdpa.py: error: unknown shape {unknown[0]!r} (known: {', '.join(SHAPES)})")
    for shape in args.shapes:
        hq, hkv = SHAPES[shape]
        for B in batches:
            for P in prefixes:
                L = P + T
                kv_bytes = 2 * B * hkv * L * d * 2
                rot = max(1, min(8, math.ceil(3 * L2_BYTES / kv_bytes)))
                qs = [torch.randn(B, hq, 1, d, device=dev, dtype=torch.bfloat16) for _ in range(rot)]
                ks = [torch.randn(B, hkv, L, d, device=dev, dtype=torch.bfloat16) for _ in range(rot)]
                vs = [torch.randn(B, hkv, L, d, device=dev, dtype=torch.bfloat16) for _ in range(rot)]
                for name, backend in BACKENDS.items():
                    r = {"shape": shape, "Hq": hq, "Hkv": hkv, "d": d, "B": B, "P": P, "T": T,
                         "backend": name, "rotations": rot, "bytes": kv_bytes}
                    try:
                        med, mean, mn = time_backend(backend, qs, ks, vs, args.iters, args.warmup)
                        r.update(ok=True, median_us=med, mean_us=mean, min_us=mn,
                                 roofline_fraction=kv_bytes / (med * 1e-6) / 4.3e12)
                        print(f"{shape:13s} B={B:3d} P={P // 1024:4d}K {name:6s} {med:9.1f} us "
                              f"({100 * r['roofline_fraction']:.0f}% of 4.3 TB/s)", flush=True)
                    except Exception as e:  # a backend that does not take this shape
                        r.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                        print(f"{shape:13s} B={B:3d} P={P // 1024:4d}K {name:6s} unavailable: {r['error']}", flush=True)
                    results.append(r)
                del qs, ks, vs
                torch.cuda.empty_cache()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": os.environ.get("ASMEM_COMMIT") or os.environ.get("GIT_COMMIT") or "",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "iters": args.iters, "warmup": args.warmup, "l2_flush": "none (rotated K/V views instead)",
           "results": results}
    write_atomic(args.out, json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
