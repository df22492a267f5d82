"""The command line shared by tools/mac_timeline.py and tools/decode_timeline.py: read a file
of per-step JSON lines (a benchmark's --timeline output) and print each step's summary; a
file that cannot be read, a line that is not JSON or not a step of this kind stops with one
line naming the file and line."""
import argparse
import json
import sys


def quantile(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def run(doc, prog, producer, kind, summarize):
    """prog: the script's name in messages; producer: the benchmark that writes the file;
    kind: what a line is ("MAC timeline step"); summarize(step) -> text."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help=f"{producer} --timeline output")
    args = ap.parse_args()
    try:
        with open(args.file) as f:
            lines = [line for line in f if line.strip()]
    except OSError as e:
        sys.exit(f"{prog}: cannot read {args.file}: {e.strerror}")
    for n, line in enumerate(lines, 1):
        try:
            step = json.loads(line)
        except json.JSONDecodeError as e:
            sys.exit(f"{prog}: {args.file}:{n}: not a JSON line ({e.msg})")
        try:
            text = summarize(step)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            # e.g. a line from an older build, without stamps this summary reads
            sys.exit(f"{prog}: {args.file}:{n}: not a {kind} ({type(e).__name__}: {e})")
        print(text)
