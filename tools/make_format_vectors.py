#!/usr/bin/env python3
"""Writes the committed test vectors for model-file loading (tests/golden/format/).

Not run by CI: its outputs are committed. Rerun it only when the vectors must change, and
review the diff.

Requires llama.cpp's gguf-py (`pip install gguf numpy`), which serves as the independent
reference for the GGUF layout and the ggml block formats.

Outputs:
  tests/golden/format/dequant_vectors.gguf
      A GGUF v3 file written by gguf-py's GGUFWriter with general.alignment = 64.
      Metadata: one key per GGUF value type (edge values), arrays of ints, floats, bools
      and strings, and a nested array (see META below; the C++ test checks the same
      values). Tensors: for each ggml type T in TYPES, "T.q" holds 2 rows x 256 elements
      stored as T, and "T.ref" holds the same values as F32 as dequantized by gguf-py.
      Row 0 comes from gguf-py's quantizer where it has one (Gaussian data); otherwise, and
      always for row 1, the blocks are random bytes with their fp16 scale fields set to
      finite values, so every bit pattern of the quantized fields is exercised. F16/BF16
      rows are random bit patterns including subnormals, infinities and NaNs.

  tests/golden/format/smollm2_samples.json
      Reference values from SmolLM2-135M-Instruct.Q4_1.gguf (path from --model), in the
      canonical (Hugging Face) layout: q/k rows un-permuted from llama.cpp's interleaved
      RoPE order. Per tensor: canonical name, ggml name, canonical shape, a few sampled
      rows (first 8 values) and three checksums over the whole tensor in float64:
      sum, sum of |v|, and sum of v * w(r, c) with w = ((131 r + 31 c) mod 97) - 48, which
      changes when rows or columns are permuted.

Usage:
  python tools/make_format_vectors.py --model ~/.cache/asmem/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

import argparse
import json
import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import quants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "tests", "golden", "format")

TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
         "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"]
QUANTIZABLE = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}
# Byte offsets of the fp16 scale fields inside one block of each type.
FP16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "Q2_K": [80, 82], "Q3_K": [108], "IQ4_NL": [0], "IQ4_XS": [0],
}
ROWS, COLS = 2, 256

# Metadata written to the vectors file: (key, GGUF value type, value[, array element type]).
V = gguf.GGUFValueType
META = [
    ("test.u8", V.UINT8, 255),
    ("test.i8", V.INT8, -128),
    ("test.u16", V.UINT16, 65535),
    ("test.i16", V.INT16, -32768),
    ("test.u32", V.UINT32, 4294967295),
    ("test.i32", V.INT32, -2147483648),
    ("test.u64", V.UINT64, 18446744073709551615),
    ("test.i64", V.INT64, -9223372036854775808),
    ("test.f32", V.FLOAT32, 0.1),
    ("test.f64", V.FLOAT64, -2.5e300),
    ("test.bool", V.BOOL, True),
    ("test.str", V.STRING, "h\u00e9llo \u2713"),
    ("test.arr_i32", V.ARRAY, [1, -2, 3], V.INT32),
    ("test.arr_f32", V.ARRAY, [0.5, -1.25], V.FLOAT32),
    ("test.arr_bool", V.ARRAY, [True, False, True], V.BOOL),
    ("test.arr_str", V.ARRAY, ["a", "", "xyz"], V.STRING),
    ("test.arr_nested", V.ARRAY, [[1, 2], [3]], V.ARRAY),
]


def random_fp16_scales(rng, n):
    mag = np.exp(rng.uniform(np.log(1e-3), np.log(2.0), n))
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(np.float16)


def random_blocks(rng, name):
    block, size = gguf.GGML_QUANT_SIZES[T[name]]
    n_blocks = COLS // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in FP16_FIELDS[name]:
        raw[:, off:off + 2] = random_fp16_scales(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


def make_row_pair(rng, name):
    """Returns the raw bytes [ROWS, bytes_per_row] for type `name`."""
    if name == "F32":
        vals = rng.standard_normal(ROWS * COLS).astype(np.float32)
        vals[:6] = [0.0, -0.0, np.inf, -np.inf, 1e-40, -3.4e38]
        return vals.view(np.uint8).reshape(ROWS, -1)
    if name in ("F16", "BF16"):
        bits = rng.integers(0, 1 << 16, size=ROWS * COLS, dtype=np.uint16)
        # Fixed specials: +-0, +-inf, NaNs, smallest/largest subnormal, largest finite.
        if name == "F16":
            bits[:10] = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFD01, 0x0001, 0x03FF, 0x7BFF, 0x3C00]
        else:
            bits[:10] = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFF81, 0x0001, 0x007F, 0x7F7F, 0x3F80]
        return bits.view(np.uint8).reshape(ROWS, -1)
    rows = []
    if name in QUANTIZABLE:
        x = (rng.standard_normal((1, COLS)) * 0.7).astype(np.float32)
        x[0, :32] = 0.0  # an all-zero block
        rows.append(quants.quantize(x, T[name]).reshape(-1))
    while len(rows) < ROWS:
        rows.append(random_blocks(rng, name))
    return np.stack(rows)


def write_vectors():
    rng = np.random.default_rng(20250207)
    path = os.path.join(OUT_DIR, "dequant_vectors.gguf")
    w = gguf.GGUFWriter(path, "asmem-format-test")
    w.add_custom_alignment(64)
    for entry in META:
        key, vtype, val = entry[:3]
        sub = entry[3] if len(entry) > 3 else None
        w.add_key_value(key, val, vtype, sub)
    for name in TYPES:
        raw = make_row_pair(rng, name)
        ref = quants.dequantize(raw, T[name]).astype(np.float32).reshape(ROWS, COLS)
        w.add_tensor(f"{name}.q", raw, raw_shape=raw.shape, raw_dtype=T[name])
        w.add_tensor(f"{name}.ref", ref)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", path, os.path.getsize(path), "bytes")


def unpermute(w, n_head):
    """Undoes llama.cpp's q/k row interleaving: GGUF row i*2+h of a head holds the Hugging
    Face row h*(d/2)+i."""
    out, inner = w.shape[0], w.shape[1:]
    d = out // n_head
    return w.reshape(n_head, d // 2, 2, *inner).swapaxes(1, 2).reshape(w.shape)


def checksums(x):
    x64 = x.astype(np.float64)
    if x64.ndim == 1:
        x64 = x64[None, :]
    r = np.arange(x64.shape[0], dtype=np.int64)[:, None]
    c = np.arange(x64.shape[1], dtype=np.int64)[None, :]
    wgt = ((131 * r + 31 * c) % 97 - 48).astype(np.float64)
    return {"sum": float(x64.sum()), "abs_sum": float(np.abs(x64).sum()),
            "weighted_sum": float((x64 * wgt).sum())}


def write_smollm2_samples(model):
    r = gguf.GGUFReader(model)
    n_head = int(r.fields["llama.attention.head_count"].contents())
    n_kv = int(r.fields["llama.attention.head_count_kv"].contents())
    tensors = {t.name: t for t in r.tensors}
    picks = [
        ("token_embd.weight", "model.embed_tokens.weight", None, [0, 1, 2, 49151]),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", n_head,
         [0, 1, 2, 31, 32, 33, 63, 64, 575]),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", n_kv, [0, 1, 32, 191]),
        ("blk.7.attn_k.weight", "model.layers.7.self_attn.k_proj.weight", n_kv, [5, 37]),
        ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight", None, [0, 1, 191]),
        ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight", None, [0, 575]),
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight", None, [0, 575]),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight", None, None),
        ("output_norm.weight", "model.norm.weight", None, None),
    ]
    out = {"model": os.path.basename(model), "tensors": []}
    for gname, cname, perm_heads, rows in picks:
        t = tensors[gname]
        x = quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        x = x.reshape([int(n) for n in reversed(t.shape.tolist())])
        if perm_heads is not None:
            x = unpermute(x, perm_heads)
        entry = {"name": cname, "ggml_name": gname, "type": t.tensor_type.name,
                 "shape": list(x.shape), "checksums": checksums(x)}
        if rows is None:
            entry["rows"] = [{"row": 0, "values": [float(v) for v in x[:8]]}]
        else:
            entry["rows"] = [{"row": i, "values": [float(v) for v in x[i, :8]]} for i in rows]
        out["tensors"].append(entry)
    path = os.path.join(OUT_DIR, "smollm2_samples.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("wrote", path, os.path.getsize(path), "bytes")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/asmem/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    args = ap.parse_args()
    os.makedirs(OUT_DIR, exist_ok=True)
    write_vectors()
    write_smollm2_samples(args.model)


if __name__ == "__main__":
    main()
