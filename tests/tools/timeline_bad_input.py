"""Shared by the timeline summary tests: a summary script run on bad input stops with exit
status 1 and one line on stderr naming the problem."""
import json
import os
import subprocess
import sys
import tempfile


def check_bad_input(script, good_step, bad_step, kind):
    """A line that is not JSON, and a good step followed by `bad_step` (not a step of this
    kind): exit status 1, one stderr line naming the line ("1: not a JSON line", "2: not a
    <kind>")."""
    for content, what in (("{not json\n", "1: not a JSON line"),
                          (json.dumps(good_step) + "\n" + json.dumps(bad_step) + "\n", f"2: not a {kind}")):
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            f.write(content)
            bad = f.name
        try:
            r = subprocess.run([sys.executable, script, bad], capture_output=True, text=True)
        finally:
            os.unlink(bad)
        if r.returncode != 1 or what not in r.stderr or r.stderr.count("\n") != 1:
            sys.exit(f"bad input ({what}): status {r.returncode}, stderr {r.stderr!r}")
