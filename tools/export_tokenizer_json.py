#!/usr/bin/env python3
"""Export a GGUF's byte-level BPE tokenizer as a Hugging Face tokenizer.json, and make the
tokenizer golden files with Hugging Face's `tokenizers` library.

The tokenizer tests compare asmem's tokenizer with an independent implementation:
Hugging Face `tokenizers` (Rust, Oniguruma regexes) run on a tokenizer.json built from
the same GGUF vocabulary and merges.

Subcommands
-----------
  export --gguf MODEL.gguf --out DIR [--no-added-tokens]
      Writes DIR/tokenizer.json and DIR/tokenizer_config.json:
        model          BPE, vocab = tokenizer.ggml.tokens (id order), merges =
                       tokenizer.ggml.merges ("a b" strings, rank order),
                       ignore_merges false, no byte fallback
        added_tokens   every token of type 3 (control) or 4 (user-defined), special = true
                       for control tokens (omitted with --no-added-tokens, which makes
                       the library tokenize special-token text as plain text)
        normalizer     null
        pre_tokenizer  from tokenizer.ggml.pre; "smollm" gives
                       Sequence[Digits(individual_digits=true),
                                ByteLevel(add_prefix_space=false, trim_offsets=true,
                                          use_regex=true)]
        decoder        ByteLevel
      tokenizer_config.json holds bos_token, eos_token, add_bos_token and chat_template.

  golden --gguf MODEL.gguf --out tests/golden/tokenizer
      Writes, from the library:
        hf_ids.json        {"generator", "model_sha256", "notes",
                            "cases": [{"text", "parse_special", "ids"}]}
                           ids of every CORPUS text, encoded without special tokens
                           added; parse_special true uses the export with added tokens,
                           false the export without them.
        hf_pretokens.json  {"generator", "notes",
                            "cases": [{"pre", "text", "pieces": [str]}]}
                           the pieces each of the four pre-tokenizers (gpt2, smollm,
                           llama3, qwen2, built as the tokenizer.json files of those
                           models declare them) splits every PRETOKEN_TEXTS text into.

How to run (not run by CI; the outputs are committed):
    /tmp/goldenv/bin/pip install tokenizers gguf
    /tmp/goldenv/bin/python tools/export_tokenizer_json.py golden \\
        --gguf ~/.cache/asmem/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out tests/golden/tokenizer
"""

import argparse
import hashlib
import json
import os
import sys
import tempfile

from atomic_write import write_atomic

TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

GPT2_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                   "use_regex": True}
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def split_then_byte_level(pattern):
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
         "use_regex": False}]}


# tokenizer.json pre_tokenizer of each supported pre-tokenizer.
PRE_TOKENIZERS = {
    "gpt2": GPT2_BYTE_LEVEL,
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, GPT2_BYTE_LEVEL]},
    "llama3": split_then_byte_level(LLAMA3_PATTERN),
    "qwen2": split_then_byte_level(QWEN2_PATTERN),
}
GGUF_PRE_NAMES = {"smollm": "smollm", "gpt2": "gpt2", "default": "gpt2",
                  "llama-bpe": "llama3", "llama3": "llama3", "qwen2": "qwen2"}

# Texts encoded by the real tokenizer (hf_ids.json). Varied on purpose: whitespace runs,
# numbers, contractions, code, scripts, emoji, marks, controls, special tokens.
CORPUS = [
    "Hello world",
    "Hello  world",
    " Hello",
    "  leading spaces and trailing   ",
    "The quick brown fox jumps over the lazy dog. THE END!",
    "It's, I'm, you're, we've, they'll, he'd, don't, CAN'T, She'S, I'LL, 'tis",
    "'s 't 're 've 'm 'll 'd ' s '",
    "a\tb\t\tc \t d\t \te",
    "line1\nline2\n\nline3\n\n\n  indented\n    more\n",
    "windows\r\nline\r\n\r\nend\r",
    "trailing newline run\n\n\n",
    " \n \n\t\n x",
    "                                        forty spaces",
    "1234567890 12 345 6789 3.14159 -0.5e-10 1,000,000 0x1F 0b1010",
    "Year 2024, 366 days; 50% off; $19.99; v2.0.1-rc3",
    "Ⅻ ½ ² ٣٤٥ १२३ １２３ ⑦",
    "def f(x):\n    return [i ** 2 for i in range(x) if i % 3 == 0]\n",
    "#include <cstdio>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "{\"key\": [1, 2, {\"nested\": null}], \"ok\": true}",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "https://example.org/a/b?c=d&e=f#g mailto:someone@example.com",
    "<div class=\"x\">&nbsp;&lt;tag&gt;</div>",
    "!!!??? ... --- ___ *** ~~~ ``` ''' \"\"\"",
    "我爱自然语言处理。今天天气很好！",
    "日本語のテキスト、カタカナとひらがな。",
    "한국어 문장입니다. 안녕하세요!",
    "Ελληνικά και Русский текст вместе",
    "مرحبا بالعالم، كيف حالك؟",
    "नमस्ते दुनिया, यह हिंदी है।",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "emoji 😀😃😄 🍕 ❤️ 👍🏽",
    "family 👨‍👩‍👧‍👦 and flags 🇫🇷🇩🇪 and keycap 1️⃣",
    "combining: e\u0301 a\u0308 n\u0303 Z\u0351\u0300\u0310a\u0353lgo",
    "nbsp\u00a0space thin\u2009space ideographic\u3000space nel\u0085x ls\u2028ps\u2029end",
    "controls \x00 \x01 \x1b[31m \x1c\x1d\x1e\x1f \x7f end",
    "zero\u200bwidth joiner\u200dword bom\ufeffhere",
    "math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ ≈ π ≠ ∞",
    "ſtraße 'ſ 'S ß ﬁ ﬂ",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|endoftext|>",
    "before<|im_start|>middle<|im_end|>after <|im_start|> spaced <|im_end|>",
    "<|im_start|<|im_end <|im_start|><|im_start|>x",
    "<repo_name>asmem<file_sep>src/main.cc<jupyter_code>print(1)",
    "",
    " ",
    "\n",
]

# Texts split by each pre-tokenizer (hf_pretokens.json): the cases where the patterns'
# alternatives, backtracking and lookaheads decide the split.
PRETOKEN_TEXTS = [
    "Hello world",
    "Hello  world",
    "Hello   world",
    "a \tb",
    "a\t b",
    "a\t\tb",
    "  x",
    "x  ",
    "x \n",
    "x\n ",
    "a\nb",
    "a\n\nb",
    "a \n b",
    "a  \n  b",
    "a\n \n b",
    "a\r\nb",
    "a \r\n\r\n  b",
    "\n\n\n",
    "   ",
    " ",
    "end.\n",
    "end.\n\n",
    "end. \n",
    "(x)\n",
    " !!\n\nx",
    "it's",
    "It'S",
    "IT'S",
    "we'RE they'Ve I'M you'Ll he'D can'T",
    "'ll've'd",
    "''s",
    " 's",
    "x'ſ",
    "'",
    "a'b",
    "rock'n'roll",
    "12",
    "123",
    "1234",
    "1234567",
    " 123",
    "a123b",
    "a 1",
    "a  1",
    "1 2",
    "3.14",
    "x2y",
    "½Ⅻ²",
    "١٢٣٤",
    "abc123def",
    "(1)",
    "$100",
    "\t1",
    "\tword",
    "\u00a0word",
    "\u3000word",
    "-word",
    "--word",
    " -word",
    "word-",
    "word!",
    " !",
    "  !",
    "!\n",
    "!\r\n\r\n",
    "!  \n",
    "é",
    "e\u0301",
    " e\u0301x",
    "\u0301\u0301",
    " \u0301",
    "你好世界",
    "你好 世界",
    "😀",
    " 😀",
    "a😀b",
    "👨‍👩‍👧",
    "a\u200bb",
    "x\u0085y",
    "x \u0085 y",
    "x\u2028y",
    "x\x1cy",
    "x \x1f y",
    "x\x0by\x0cz",
    "tab\t",
    "mixed \t \n \t\n  space\t\t\n\n",
    "def f():\n    return 1\n",
    "    indented",
    "a.b,c;d:e",
    "<|im_start|>user",
    # Which characters are \s: "!" + c is one piece exactly when c is not whitespace.
    "!\u0085", "!\u00a0", "!\u1680", "!\u2000", "!\u200a", "!\u2028", "!\u2029", "!\u202f",
    "!\u205f", "!\u3000", "!\u180e", "!\u200b", "!\ufeff", "!\x1c", "!\x1f", "!\x0b", "!\x0c",
    "x\u0085\u0085y", "x\u00a0\ny", "x \u2029 \u2029 y",
    # Case-insensitive contractions (U+017F folds to "s") and CR in whitespace runs.
    "'\u017fx", "x'\u017ft", "'Sx", "'REx", "'lLx", "x\r\ry", "a\r\n\r  b", "x\r", "\r \r x",
    # Marks and scripts without spaces.
    "नमस्ते दुनिया", "ภาษาไทย ไม่มี", "\u0639\u064e\u0631\u064e\u0628\u0650\u064a",
]


def read_gguf_tokenizer(path):
    from gguf import GGUFReader
    r = GGUFReader(path)

    def get(key, default=None):
        f = r.fields.get(key)
        return default if f is None else f.contents()

    model = get("tokenizer.ggml.model")
    if model != "gpt2":
        sys.exit(f"{path}: tokenizer.ggml.model {model!r} is not byte-level BPE")
    pre = get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_NAMES:
        sys.exit(f"{path}: tokenizer.ggml.pre {pre!r} is not supported")
    return {
        "tokens": get("tokenizer.ggml.tokens"),
        "types": get("tokenizer.ggml.token_type"),
        "merges": get("tokenizer.ggml.merges"),
        "pre": GGUF_PRE_NAMES[pre],
        "bos": get("tokenizer.ggml.bos_token_id"),
        "eos": get("tokenizer.ggml.eos_token_id"),
        "add_bos": bool(get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": get("tokenizer.chat_template", ""),
    }


def tokenizer_json(tok, added_tokens=True):
    added = []
    if added_tokens:
        for i, (text, ty) in enumerate(zip(tok["tokens"], tok["types"])):
            if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
                added.append({"id": i, "content": text, "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False,
                              "special": ty == TOKEN_CONTROL})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[tok["pre"]],
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None,
            "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tok["tokens"])},
            "merges": list(tok["merges"]),
        },
    }


def tokenizer_config(tok):
    name = lambda i: tok["tokens"][i] if i is not None else None
    return {"bos_token": name(tok["bos"]), "eos_token": name(tok["eos"]),
            "add_bos_token": tok["add_bos"], "chat_template": tok["chat_template"]}


def export(tok, out_dir, added_tokens=True):
    os.makedirs(out_dir, exist_ok=True)
    write_atomic(os.path.join(out_dir, "tokenizer.json"),
                 json.dumps(tokenizer_json(tok, added_tokens), ensure_ascii=False))
    write_atomic(os.path.join(out_dir, "tokenizer_config.json"),
                 json.dumps(tokenizer_config(tok), ensure_ascii=False, indent=1))


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_pre_tokenizer(name):
    from tokenizers import Regex, pre_tokenizers as pt
    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "gpt2":
        return byte_level
    if name == "smollm":
        return pt.Sequence([pt.Digits(individual_digits=True), byte_level])
    pattern = LLAMA3_PATTERN if name == "llama3" else QWEN2_PATTERN
    return pt.Split(Regex(pattern), behavior="isolated", invert=False)


def golden(gguf_path, out_dir):
    import tokenizers
    from tokenizers import Tokenizer
    tok = read_gguf_tokenizer(gguf_path)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        encoders = {}
        for parse_special in (True, False):
            d = os.path.join(tmp, "special" if parse_special else "plain")
            export(tok, d, added_tokens=parse_special)
            encoders[parse_special] = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        for text in CORPUS:
            for parse_special in (True, False):
                ids = encoders[parse_special].encode(text, add_special_tokens=False).ids
                cases.append({"text": text, "parse_special": parse_special, "ids": ids})
    generator = f"Hugging Face tokenizers {tokenizers.__version__} via " \
                f"tools/export_tokenizer_json.py"
    os.makedirs(out_dir, exist_ok=True)
    write_atomic(os.path.join(out_dir, "hf_ids.json"),
                 json.dumps({"generator": generator, "model_sha256": sha256(gguf_path),
                             "notes": "Tokenizer.encode(text, add_special_tokens=False) on the "
                                      "tokenizer.json exported from the GGUF; parse_special false "
                                      "uses the export without added_tokens.",
                             "cases": cases}, ensure_ascii=False, indent=1))

    pre_cases = []
    for name in ("gpt2", "smollm", "llama3", "qwen2"):
        pre = build_pre_tokenizer(name)
        for text in PRETOKEN_TEXTS:
            # Offsets count code points of the original text.
            pieces = [text[a:b] for _, (a, b) in pre.pre_tokenize_str(text)]
            assert "".join(pieces) == text, (name, text, pieces)
            pre_cases.append({"pre": name, "text": text, "pieces": pieces})
    write_atomic(os.path.join(out_dir, "hf_pretokens.json"),
                 json.dumps({"generator": generator,
                             "notes": "pre_tokenize_str pieces; gpt2 = ByteLevel(use_regex), smollm = "
                                      "Sequence[Digits(individual), ByteLevel(use_regex)], llama3 / "
                                      "qwen2 = Split(Regex(pattern), isolated).",
                             "cases": pre_cases}, ensure_ascii=False, indent=1))
    print(f"wrote {len(cases)} id cases and {len(pre_cases)} pre-token cases to {out_dir}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write tokenizer.json + tokenizer_config.json")
    e.add_argument("--gguf", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--no-added-tokens", action="store_true")
    g = sub.add_parser("golden", help="write hf_ids.json and hf_pretokens.json")
    g.add_argument("--gguf", required=True)
    g.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.cmd == "export":
        export(read_gguf_tokenizer(args.gguf), args.out, not args.no_added_tokens)
    else:
        golden(args.gguf, args.out)


if __name__ == "__main__":
    main()
