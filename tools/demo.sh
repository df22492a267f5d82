#!/usr/bin/env bash
# Sets up everything missing (tools/setup.sh) and runs the main job on the bundled model
# and example: compile the example rulebook (examples/rulebook) into a dictionary, show
# the held-out fidelity report and the dictionary's contents, then answer a question with
# the rulebook served from the dictionary (its KV never computed), compared token by token
# with the full rulebook in context.
#
#   tools/demo.sh ["your question"]
#
# The dictionary is cached under $ASMEM_CACHE_DIR/dicts/, keyed by the inputs' hash (the
# model's path among them); a second run reuses it and prints the saved report.
# ASMEM_DEMO_ENTRIES sets K (1024).
set -euo pipefail
# Relative paths in these settings name places under the caller's directory; the tests run
# elsewhere (ctest's working directories), so make them absolute.
for v in ASMEM_CACHE_DIR ASMEM_MODEL ASMEM_BUILD_DIR XDG_CACHE_HOME; do
  if [ -n "${!v:-}" ]; then export "$v=$(realpath -m "${!v}")"; fi
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${ASMEM_BUILD_DIR:-$ROOT/build}"
"$ROOT/tools/setup.sh" asmem
ASMEM="$BUILD/tools/asmem"
CACHE="${ASMEM_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/asmem}"
EX="$ROOT/examples/rulebook"
K="${ASMEM_DEMO_ENTRIES:-1024}"

# The model every asmem command here uses (asmem's default: ASMEM_MODEL, else the bundled one).
MODEL="${ASMEM_MODEL:-$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
KEY="$(cat "$EX/handbook.md" "$EX/traces.jsonl" <(echo "K=$K model=$MODEL") "$ASMEM" "${BASH_SOURCE[0]}" |
  sha256sum | cut -c1-16)"
DICT="$CACHE/dicts/rulebook-$KEY.asmd"
mkdir -p "$CACHE/dicts"
# A cached dictionary counts only with its log (written last, by rename) and when it was
# compiled for this model (verify --model: the weights' fingerprint, whatever the path): a
# compile that stopped after the dictionary, or a model replaced at that path, compiles again.
if [ -f "$DICT" ] && [ -f "$DICT.log" ] && "$ASMEM" verify "$DICT" --model "$MODEL" >/dev/null 2>&1; then
  printf '\n== asmem compile: cached %s\n' "$DICT"
  cat "$DICT.log"
else
  printf '\n== asmem compile (examples/rulebook, K=%s)\n' "$K"
  trap 'rm -f "$DICT.log.tmp"' EXIT
  "$ASMEM" compile --prefix "$EX/handbook.md" --traces "$EX/traces.jsonl" --entries "$K" \
    --out "$DICT" --max-response-tokens 64 2>&1 | tee "$DICT.log.tmp"
  mv -f "$DICT.log.tmp" "$DICT.log"
  trap - EXIT
fi

printf '\n== asmem inspect\n'
"$ASMEM" inspect "$DICT"

PROMPT="${1:-My train was 75 minutes late. What compensation can I get, and how do I claim it?}"
printf '\n== asmem generate --dict (rulebook served from the dictionary)\n> %s\n\n' "$PROMPT"
"$ASMEM" generate --dict "$DICT" --prompt "$PROMPT" --max-new-tokens 160 \
  --compare --system-file "$EX/handbook.md"
