#!/usr/bin/env bash
# Sets up everything missing (tools/setup.sh) and runs the main job on the bundled model:
# a chat turn with SmolLM2-135M-Instruct, streaming tokens and printing tokens/s.
#
#   tools/demo.sh ["your question"]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${ASMEM_BUILD_DIR:-$ROOT/build}"
"$ROOT/tools/setup.sh" asmem
PROMPT="${1:-What are three good habits for writing maintainable code? Answer briefly.}"
printf '\n== asmem generate\n> %s\n\n' "$PROMPT"
"$BUILD/tools/asmem" generate --prompt "$PROMPT" --max-new-tokens 200
