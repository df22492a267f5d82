#!/usr/bin/env python3
"""tools/mac_timeline.py on a hand-made step whose summary is worked out below, and on bad
input (a one-line error, exit status 1)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import mac_timeline  # noqa: E402
from timeline_bad_input import check_bad_input  # noqa: E402

STEP = {
    "label": "hand-made",
    # start, match waited, end, at its wait; then the real pass's steps
    "plan": [1.0, 4.0, 6.0, 2.5],
    "plan_steps": [4.5, 5.0, 5.5, 5.8],
    "match": [[0.0, 3.0], [0.5, 4.0]],
    # start, attend waited, merged, end
    "combine": [[10.0, 20.0, 22.0, 24.0], [11.0, 21.0, 24.0, 25.0]],
    # first segment, SM, tiles, tokens, start, plan waited, descriptors read, first tile, loop
    # done, done, staged, weighed, stored
    "attend": [[0, 3, 4, 256, 5.0, 6.0, 7.0, 9.0, 15.0, 18.0, 16.0, 17.0, 17.5],
               [1, 4, 2, 128, 5.0, 6.0, 7.0, 9.5, 12.0, 14.0, 13.0, 13.5, 13.8]],
}

EXPECTED = [
    "== hand-made",
    "match: 2 CTAs, start 0.0-0.5, end p50 4.0, last 4.0",
    "plan: start 1.0, at its wait 2.5 (after the dry pass, if run), match waited 4.0, end 6.0",
    "plan after its wait: keys and ranges 4.5, totals 5.0, first batch placed 5.5, its segments written 5.8",
    "attend: 2 CTAs with segments, start 5.0-5.0, plan waited 6.0-6.0, end p50 18.0, last 18.0",
    # descriptors: 7 - 6 both; first tile: 9 - 7, 9.5 - 7; loop: 15 - 9, 12 - 9.5
    "descriptors 1.0 / 1.0 / 1.0; to first tile 2.0 / 2.5 / 2.5; tile loop 2.5 / 6.0 / 6.0",
    # stage 16 - 15, 13 - 12; weights 1, 0.5; stores 0.5, 0.3; whole CTA 18 - 6, 14 - 6
    "stage 1.0 / 1.0 / 1.0; weights 0.5 / 1.0 / 1.0; stores 0.3 / 0.5 / 0.5; whole CTA 8.0 / 12.0 / 12.0",
    # (15 - 9) / 3 and (12 - 9.5) / 1
    "us per tile after the first: 2 tiles (n = 1) 2.50, 4 tiles (n = 1) 2.00",
    "CTAs starting more than 5 us after the first: 0",
    # ends 18.0 and 14.0, latest first
    "last to end: first segment 0 on SM 3, 4 tiles / 256 tokens, first tile 9.0, last tile 15.0, end 18.0; "
    "first segment 1 on SM 4, 2 tiles / 128 tokens, first tile 9.5, last tile 12.0, end 14.0",
    # starts 10.0 and 11.0 (p50: the upper of two)
    "combine: 2 CTAs, start 10.0 / p50 11.0 / 11.0, attend waited p50 21.0, merge p50 3.0, then p50 2.0 to the end, "
    "last end 25.0",
]


def main():
    text = mac_timeline.summarize(STEP)
    missing = [e for e in EXPECTED if e not in text]
    if missing:
        print(text)
        sys.exit("missing from the summary: " + " | ".join(missing))
    # A line that is not JSON, and a step without "plan_steps" (an older build's, or not this kind).
    old = {k: v for k, v in STEP.items() if k != "plan_steps"}
    check_bad_input(os.path.join(ROOT, "tools", "mac_timeline.py"), STEP, old, "MAC timeline step")
    print("mac_timeline summary and bad-input checks passed")


if __name__ == "__main__":
    main()
