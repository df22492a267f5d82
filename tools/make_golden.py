#!/usr/bin/env python3
"""Generate golden test data for asmem from an independent implementation.

What it produces
----------------
Two JSON files, computed with llama.cpp (through the PyPI package
llama-cpp-python) from the SmolLM2-135M-Instruct Q4_1 GGUF model:

  tests/golden/tokenizer_golden.json
      {"generator", "model_sha256", "notes",
       "cases": [{"text": str, "parse_special": bool, "ids": [int]}]}
      Token ids from llm.tokenize(text.encode("utf-8"), add_bos=False,
      special=parse_special) for a varied set of UTF-8 texts (whitespace
      runs, numbers, contractions, code, URLs, CJK, emoji, RTL scripts,
      combining marks, a long paragraph, ChatML special tokens with
      parse_special true and false, ...).

  tests/golden/logits_golden.json
      {"generator", "model_sha256", "notes", "top_k": 20,
       "prompts": [{"name", "text", "ids",
                    "top_ids":    [[int] * 20 per position],
                    "top_logits": [[float] * 20 per position],
                    "greedy_continuation": [int] * 16,
                    "greedy_margins": [float] * 16}]}
      "ids" are the prompt tokens (special=True, add_bos=False).  top_ids /
      top_logits hold, for every prompt position i, the 20 highest logits
      (rounded to 4 decimals, sorted by descending logit, ties by ascending
      id) predicting token i+1, all from ONE llm.eval(ids) call with
      logits_all=True.  greedy_continuation is the argmax continuation of 16
      tokens (continued after the prompt with one token per llm.eval call; it
      does not stop at end-of-turn tokens, so a consumer that stops at EOS
      should compare only up to the first EOS).  greedy_margins[j] is the
      logit gap between the best and second-best token at continuation
      step j; a small margin means a near tie, where a different but correct
      implementation may legitimately pick another token.

Numerical caveat: for Q4_1 weights llama.cpp's CPU backend quantizes the
activations to Q8_1 before each matrix multiplication (vec_dot_q4_1_q8_1),
(and stores the KV cache as f16), so its logits differ from a reference
that dequantizes the weights and computes in fp32.  Measured against a
float64 forward pass over the dequantized weights, the 20 recorded logits per
position differ by 0.15 on average, 0.6 at the 99th percentile and up to
about 1.8; the top-1 token differs at about 1% of positions, all of them near
ties (top-1/top-2 gap below 0.5).  llama.cpp itself gives logits that differ
by up to about 1.7 between evaluating a prompt in one batch and one token per
call.  Tests should therefore compare with a generous tolerance, check top-1
only where the recorded gap is clear, and compare greedy continuations only
up to the first step whose greedy_margins entry is small.

How to run it (NOT run by CI; the outputs are committed)
--------------------------------------------------------
    python3 -m venv /tmp/goldenv
    CMAKE_ARGS="-DGGML_NATIVE=OFF" /tmp/goldenv/bin/pip install \\
        llama-cpp-python==0.3.36 gguf numpy
    /tmp/goldenv/bin/python tools/make_golden.py \\
        [--model /root/.cache/asmem/models/SmolLM2-135M-Instruct.Q4_1.gguf] \\
        [--out tests/golden] [--bench]

The files in the repository were generated with llama-cpp-python 0.3.36
(built from source, GGML_NATIVE=OFF, CPU only, n_threads=2, n_batch=512).

The script checks that the model file has sha256
b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
and refuses to run otherwise.  --bench additionally prints llama.cpp's
prefill / decode speed for a ~200-token chat prompt plus 64 generated tokens
(nothing is written for it).
"""

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np
import llama_cpp

from atomic_write import write_atomic

EXPECTED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL = "/root/.cache/asmem/models/SmolLM2-135M-Instruct.Q4_1.gguf"
N_CTX = 2048
N_THREADS = 2
N_BATCH = 512
SEED = 1234
TOP_K = 20
N_GREEDY = 16

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(messages, add_generation_prompt=True):
    """Format (role, content) pairs with the model's ChatML template."""
    out = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    if add_generation_prompt:
        out += "<|im_start|>assistant\n"
    return out


# --------------------------------------------------------------------------
# Tokenizer texts
# --------------------------------------------------------------------------

LONG_PARAGRAPH = (
    "The small town sat at the bend of a slow river, and every morning the fog "
    "rolled up from the water and settled over the rooftops like a grey wool "
    "blanket. Children walked to school through it, calling to each other so "
    "they would not get lost, while the baker on the corner had already been "
    "awake for hours, shaping loaves and pulling trays of rolls from an oven "
    "that had been in his family for three generations. Nobody in town could "
    "remember a time when the bakery had been closed, not even during the "
    "great flood of 1987, when the water rose to the second step of the church "
    "and the mayor rowed a canoe down Main Street to deliver sandbags. On that "
    "day the baker simply moved his flour upstairs and kept working by "
    "lantern light. People still tell the story at weddings and funerals, "
    "usually with some exaggeration: the canoe becomes a rowboat, the rowboat "
    "becomes a ferry, and the three sandbags become a hundred. What everyone "
    "agrees on is that the bread was warm and that nobody went hungry. In "
    "recent years the town has changed. A new road connects it to the city, "
    "and on weekends visitors arrive with cameras and cycling jerseys, looking "
    "for coffee and a place to sit by the water. Some of the older residents "
    "complain about the traffic and the noise, but most admit that the cafes "
    "and small shops would not survive without the extra customers. The old "
    "mill has been turned into apartments, the railway station is now a "
    "museum, and the school has a computer lab where the blackboards used to "
    "be. Still, certain things have not changed at all. The fog still comes "
    "up from the river in the morning. The church bell still rings at noon, "
    "a few seconds late, because nobody has managed to fix the clock since "
    "the storm of 2003. And the bakery on the corner still opens before "
    "dawn, although the baker's granddaughter now runs it and has added "
    "croissants, sourdough and a gluten-free loaf to the menu. When asked "
    "whether she ever thinks about leaving for the city, she laughs and says "
    "that somebody has to make sure the town wakes up to the smell of fresh "
    "bread. Then she goes back to the oven, because the first customers are "
    "already waiting at the door, stamping their feet against the cold and "
    "talking about the weather, the river, and the latest news from the "
    "council meeting. It is, by most measures, an ordinary place. But the "
    "people who live there would not trade it for anywhere else in the world, "
    "and the visitors who come for a single afternoon often find themselves "
    "returning, season after season, for reasons they cannot quite explain."
)

CHAT_TEXTS = [
    chatml([("user", "Hello!")], add_generation_prompt=False),
    chatml([("system", DEFAULT_SYSTEM), ("user", "What is 2+2?")]),
    "<|im_start|>assistant\nThe answer is 4.<|im_end|>\n<|endoftext|>",
    "text before<|im_start|>user\n  spaced   content \n<|im_end|>after",
    "<|im_start|><|im_end|><|im_start|> <|im_end|>\n\n<|endoftext|> <|endoftext|>",
]

TOKENIZER_TEXTS = [
    # plain English
    "Hello world",
    "Hello, world! How are you doing today?",
    "The quick brown fox jumps over the lazy dog.",
    # leading / trailing / runs of whitespace
    " Hello",
    "  leading two spaces",
    "trailing space ",
    "a  b",
    "a   b    c     d",
    "a\n\n\nb",
    "\t\tx",
    "   ",
    "end of line\n  ",
    "\n",
    "line one\r\nline two\r\n",
    "mixed \t \n \t\n  whitespace\t\t\n\n",
    # numbers
    "1234567",
    "3.14159",
    "1,000,000",
    "v2.0.1",
    "The year 2024 had 366 days; 0.5% of 1e10 is 5e7.",
    "-42 +17 0x1F 0b1010 007",
    # contractions
    "don't",
    "I'LL",
    "we've",
    "She's sure they'd've said it's John's, isn't it? Y'all WON'T.",
    # punctuation runs
    "Wait... what?!?! (really) [yes] {no} <maybe>",
    "!!!???...---___***&&&@@@###$$$%%%^^^",
    "\"quoted\" 'single' `backtick` -- em\u2014dash \u2018curly\u2019 \u201cquotes\u201d",
    # code
    "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n    return a + b\n\nprint(add(1, 2))\n",
    "#include <vector>\n\nint main() {\n  std::vector<int> v{1, 2, 3};\n  for (auto& x : v) x *= 2;\n  return v.size() > 2 ? 0 : 1;\n}\n",
    "{\"name\": \"asmem\", \"version\": [1, 2, 3], \"ok\": true, \"ptr\": null}",
    "for f in *.gguf; do sha256sum \"$f\" | tee -a sums.txt; done && echo $? >&2",
    # URLs / emails
    "https://example.com/path/to/page?query=1&lang=en#section-2",
    "Contact: first.last+tag@example.co.uk or admin@localhost",
    # CJK
    "\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff0c\u6211\u4eec\u53bb\u516c\u56ed\u6563\u6b65\u5427\u3002",
    "\u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059\u3002\u30ab\u30bf\u30ab\u30ca\u3082\u3042\u308a\u307e\u3059\u3002",
    "\uc548\ub155\ud558\uc138\uc694, \ub9cc\ub098\uc11c \ubc18\uac11\uc2b5\ub2c8\ub2e4.",
    # emoji (simple, ZWJ family, flags, skin tone, keycap)
    "I love pizza \U0001F355\U0001F355 and cats \U0001F431!",
    "family: \U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466 end",
    "flags: \U0001F1FA\U0001F1F8\U0001F1EF\U0001F1F5\U0001F1E9\U0001F1EA",
    "thumbs \U0001F44D\U0001F3FD keycap 1\uFE0F\u20E3 heart \u2764\uFE0F",
    # accented / combining characters
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe \u00e5ngstr\u00f6m",
    "cafe\u0301 e\u0301 a\u0308 n\u0303 Z\u0351\u0300\u0310a\u0353lgo",
    # Arabic / Hebrew / Cyrillic / Greek
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u041a\u0430\u043a \u0434\u0435\u043b\u0430?",
    "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5",
    # math symbols
    "\u2200x \u2208 \u211d: x\u00b2 \u2265 0, \u2211 \u222b\u2080^\u221e e^{-x} dx = 1 \u2260 \u03c0 \u2248 3.14",
    # empty string
    "",
    # long paragraph (~400 words)
    LONG_PARAGRAPH,
]


# --------------------------------------------------------------------------
# Logit prompts
# --------------------------------------------------------------------------

PASSAGE = (
    "Bread is one of the oldest prepared foods. Archaeologists have found "
    "traces of flatbreads baked more than fourteen thousand years ago, long "
    "before people began to farm grain in large quantities. Early bread was "
    "made by mixing crushed seeds with water and cooking the paste on hot "
    "stones. Over time, people learned that dough left to sit for a while "
    "would rise, because wild yeasts and bacteria from the air began to "
    "ferment the sugars in the flour. The gas produced by this fermentation "
    "is trapped in a network of gluten proteins, which gives leavened bread "
    "its light and airy texture. Ancient Egyptians are often credited with "
    "turning bread making into an organized craft. They built large bakeries, "
    "used molds to shape loaves, and paid workers partly in bread and beer. "
    "In Rome, public ovens served whole neighborhoods, and the state "
    "distributed free grain to citizens as a way to keep the peace. During "
    "the Middle Ages, bakers in many European cities formed guilds that set "
    "rules for the weight and quality of loaves, and a baker who sold bread "
    "that was too light could be fined or publicly shamed. The industrial "
    "revolution brought roller mills, which produced fine white flour cheaply, "
    "and later, commercial yeast and mechanical mixers made it possible to "
    "bake thousands of identical loaves a day. Today, bread comes in countless "
    "forms, from French baguettes and Indian naan to Mexican tortillas and "
    "Ethiopian injera. Yet the basic recipe has hardly changed: flour, water, "
    "salt, time, and heat."
)

LOGIT_PROMPTS = [
    ("chat_capital",
     chatml([("system", DEFAULT_SYSTEM),
             ("user", "What is the capital of France? Answer in one sentence and explain why it is important.")])),
    ("chat_poem",
     chatml([("system", "You are a creative writer."),
             ("user", "Write a short poem about the sea at night.")])),
    ("chat_multiturn",
     chatml([("system", DEFAULT_SYSTEM),
             ("user", "Give me a name for a pet goldfish."),
             ("assistant", "How about \"Bubbles\"?"),
             ("user", "Nice. Now suggest three more names and explain each one.")])),
    ("plain_english",
     "The quick brown fox jumps over the lazy dog. This sentence is famous because"),
    ("plain_counting",
     "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March,"),
    ("code_python",
     "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
     "    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b,"),
    ("passage_300", PASSAGE),
]

BENCH_USER = (
    "I am planning a three-day trip to a coastal city in early spring. I like "
    "walking, old architecture, local food markets and small museums, but I do "
    "not enjoy crowded tourist attractions or long bus rides. My budget is "
    "moderate, and I would prefer to stay in one neighborhood for the whole "
    "trip so I do not have to move my luggage. Could you suggest how to "
    "structure each day, what kinds of places to look for, what to pack for "
    "changeable weather, and a few tips for finding good inexpensive meals? "
    "Please also mention anything I should book in advance and how to avoid "
    "the busiest times at popular sights. I will arrive by train on a Friday "
    "morning and leave on Sunday evening, and I am travelling with a friend "
    "who is vegetarian and does not drink coffee. Keep the answer practical "
    "and organized, with short headings for each day."
)


# --------------------------------------------------------------------------

def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load(model_path, logits_all=True):
    return llama_cpp.Llama(
        model_path=model_path,
        n_ctx=N_CTX,
        n_batch=N_BATCH,
        n_threads=N_THREADS,
        n_threads_batch=N_THREADS,
        logits_all=logits_all,
        seed=SEED,
        verbose=False,
    )


def tokenize(llm, text, special):
    return [int(t) for t in llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)]


def top_k_of(row, k):
    # Sort by descending logit, ties broken by ascending token id.
    idx = np.lexsort((np.arange(row.shape[0]), -row))[:k]
    return [int(i) for i in idx], [round(float(row[i]), 4) for i in idx]


def system_info():
    try:
        return llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
    except Exception:  # pragma: no cover - informational only
        return "unavailable"


def notes_text():
    return (
        f"Computed on CPU by llama.cpp through llama-cpp-python {llama_cpp.__version__} "
        f"(built with GGML_NATIVE=OFF), n_ctx={N_CTX}, n_threads={N_THREADS}, "
        f"n_batch={N_BATCH}, seed={SEED}. ggml system info: {system_info()}. "
        "Tokenization: llm.tokenize(text.encode('utf-8'), add_bos=False, special=parse_special); "
        "the GGUF declares tokenizer.ggml.model=gpt2, tokenizer.ggml.pre=smollm, add_bos_token=false. "
        "For Q4_1 weights llama.cpp quantizes activations to Q8_1 before each matmul (and keeps "
        "the KV cache in f16), so logits differ from an fp32-dequantized reference (typically "
        "0.1-0.6, up to ~2 logits; top-1 flips only at near ties); compare with a tolerance."
    )


def write_tokenizer(llm, out_dir, generator, sha):
    cases = []
    for text in TOKENIZER_TEXTS:
        cases.append({"text": text, "parse_special": False, "ids": tokenize(llm, text, False)})
    for text in CHAT_TEXTS:
        for special in (True, False):
            cases.append({"text": text, "parse_special": special, "ids": tokenize(llm, text, special)})
    doc = {"generator": generator, "model_sha256": sha, "notes": notes_text()}
    lines = ["{"]
    for key, val in doc.items():
        lines.append(f"  {json.dumps(key)}: {json.dumps(val, ensure_ascii=False)},")
    lines.append('  "cases": [')
    for i, c in enumerate(cases):
        sep = "," if i + 1 < len(cases) else ""
        lines.append("    " + json.dumps(c, ensure_ascii=False, separators=(", ", ": ")) + sep)
    lines.append("  ]")
    lines.append("}")
    path = os.path.join(out_dir, "tokenizer_golden.json")
    write_atomic(path, "\n".join(lines) + "\n")
    return path, cases


def greedy(llm, ids, n):
    """Argmax continuation, one token per eval after the prompt."""
    llm.reset()
    llm.eval(ids)
    out, margins = [], []
    for _ in range(n):
        row = llm.scores[llm.n_tokens - 1]
        top2 = np.argpartition(-row, 2)[:2]
        top2 = top2[np.argsort(-row[top2], kind="stable")]
        best = int(np.argmax(row))
        out.append(best)
        margins.append(round(float(row[top2[0]] - row[top2[1]]), 4))
        llm.eval([best])
    return out, margins


def write_logits(llm, out_dir, generator, sha):
    prompts = []
    for name, text in LOGIT_PROMPTS:
        ids = tokenize(llm, text, True)
        llm.reset()
        llm.eval(ids)
        scores = np.array(llm.scores[: len(ids)], dtype=np.float32, copy=True)
        top_ids, top_logits = [], []
        for row in scores:
            i, v = top_k_of(row, TOP_K)
            top_ids.append(i)
            top_logits.append(v)
        cont, margins = greedy(llm, ids, N_GREEDY)
        prompts.append({"name": name, "text": text, "ids": ids, "top_ids": top_ids,
                        "top_logits": top_logits, "greedy_continuation": cont,
                        "greedy_margins": margins})
    j = lambda v: json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    lines = ["{"]
    lines.append(f'  "generator": {j(generator)},')
    lines.append(f'  "model_sha256": {j(sha)},')
    lines.append(f'  "notes": {j(notes_text() + " Logits are rounded to 4 decimals; top_ids/top_logits[i] predict token i+1 and come from a single llm.eval(ids) with logits_all=True. greedy_continuation continues with one token per eval and does not stop at end-of-turn tokens.")},')
    lines.append(f'  "top_k": {TOP_K},')
    lines.append('  "prompts": [')
    for pi, p in enumerate(prompts):
        lines.append("    {")
        lines.append(f'      "name": {j(p["name"])},')
        lines.append(f'      "text": {j(p["text"])},')
        lines.append(f'      "ids": {j(p["ids"])},')
        lines.append(f'      "greedy_continuation": {j(p["greedy_continuation"])},')
        lines.append(f'      "greedy_margins": {j(p["greedy_margins"])},')
        for key in ("top_ids", "top_logits"):
            lines.append(f'      "{key}": [')
            rows = p[key]
            for ri, r in enumerate(rows):
                lines.append("        " + j(r) + ("," if ri + 1 < len(rows) else ""))
            lines.append("      ]" + ("," if key == "top_ids" else ""))
        lines.append("    }" + ("," if pi + 1 < len(prompts) else ""))
    lines.append("  ]")
    lines.append("}")
    path = os.path.join(out_dir, "logits_golden.json")
    write_atomic(path, "\n".join(lines) + "\n")
    return path, prompts


def bench(llm, n_gen=64, reps=3):
    ids = tokenize(llm, chatml([("system", DEFAULT_SYSTEM), ("user", BENCH_USER)]), True)
    results = []
    for _ in range(reps):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        for _ in range(n_gen):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t2 = time.perf_counter()
        results.append((len(ids) / (t1 - t0), n_gen / (t2 - t1)))
    return len(ids), results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden"))
    ap.add_argument("--bench", action="store_true", help="also print prefill/decode tokens/s")
    args = ap.parse_args()

    sha = sha256_of(args.model)
    if sha != EXPECTED_SHA256:
        sys.exit(f"model sha256 mismatch: got {sha}, expected {EXPECTED_SHA256}")
    generator = f"llama-cpp-python {llama_cpp.__version__}"
    os.makedirs(args.out, exist_ok=True)

    llm = load(args.model, logits_all=True)
    assert llm.n_vocab() == 49152, llm.n_vocab()

    tpath, cases = write_tokenizer(llm, args.out, generator, sha)
    print(f"wrote {tpath}: {len(cases)} cases")
    lpath, prompts = write_logits(llm, args.out, generator, sha)
    print(f"wrote {lpath}: {len(prompts)} prompts, "
          f"{sum(len(p['ids']) for p in prompts)} positions")
    for p in prompts:
        cont = llm.detokenize(p["greedy_continuation"], special=True).decode("utf-8", "replace")
        print(f"  {p['name']:16s} {len(p['ids']):4d} tokens, greedy: {cont!r}")

    if args.bench:
        del llm
        llm = load(args.model, logits_all=False)
        n, res = bench(llm)
        for pf, dc in res:
            print(f"bench: prompt {n} tokens, prefill {pf:.1f} tok/s, decode {dc:.1f} tok/s")


if __name__ == "__main__":
    main()
