#!/usr/bin/env python3
"""tools/decode_timeline.py on hand-made steps whose summaries are worked out below, and on
bad input (a one-line error, exit status 1)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import decode_timeline  # noqa: E402
from timeline_bad_input import check_bad_input  # noqa: E402

# A dictionary step: three lookup CTAs (two scan a block, the second raises the flag), three
# attention CTAs (the third has an empty split), two combine CTAs.
STEP = {
    "label": "hand-made",
    # start, ids read, loop done, end, SM, blocks, flag
    "lookup": [[0.0, 1.0, 20.0, 21.0, 5, 2, 0],
               [0.5, 1.5, 30.0, 31.0, 6, 1, 1],
               [1.0, 2.0, 2.5, 3.0, 7, 0, 0]],
    # start, first tile, loop done, end, SM, tokens, split
    "attention": [[2.0, 4.0, 24.0, 25.0, 5, 512, 0],
                  [2.0, 3.0, 13.0, 14.0, 9, 512, 1],
                  [15.0, None, None, 15.5, 9, 0, 2]],
    # start, flag seen, entry picked, attention waited, end, SM
    "combine": [[20.0, 31.5, 33.0, 34.0, 36.0, 1],
                [21.0, 31.6, 34.0, 34.5, 37.0, 2]],
    "combine_kind": "dictionary",
}

EXPECTED = [
    "== hand-made",
    # ids read 1.0 1.5 2.0; ends 21 31 3
    "lookup: 3 CTAs (2 scanned a block), start 0.0-1.0, ids read p50 1.5, last end 31.0",
    # loops done 20 and 30; ids read to loop done 19 and 28.5
    "working CTAs: loop done p10 / p50 / p90 20.0 / 30.0 / 30.0, last 30.0; ids read to loop done p50 28.5",
    "flag raised at 31.0",
    # ends 25, 14, 15.5
    "attention: 3 CTAs, start 2.0 / p50 2.0 / last 15.0, end p50 15.5, last 25.0",
    # first tile 2 and 1 after the start, loops 20 and 10, epilogues 1 and 1 (the empty split
    # has no tiles)
    "per CTA p10 / p50 / p90 us: to first tile 1.0 / 2.0 / 2.0; tile loop 10.0 / 20.0 / 20.0; "
    "epilogue 1.0 / 1.0 / 1.0; tokens 512.0 / 512.0 / 512.0",
    # SM 5 holds the first lookup CTA
    "tile loop on SMs of a working lookup CTA 20.0 / 20.0 / 20.0 (n = 1), elsewhere 10.0 / 10.0 / 10.0 (n = 1)",
    "attention CTAs starting after the last lookup CTA's start: 3",
    "last attention CTAs to end: split 0 on SM 5, 512 tokens, start 2.0, end 25.0; "
    "split 2 on SM 9, 0 tokens, start 15.0, end 15.5; split 1 on SM 9, 512 tokens, start 2.0, end 14.0",
    "combine (dictionary): 2 CTAs, start 20.0-21.0, flag seen p50 31.6, entry picked p50 34.0 / last 34.0, "
    "attention waited p50 34.5, end p50 37.0 / last 37.0",
    "step: first CTA start to last CTA end 37.0",
]

# A step without a dictionary, its splits merged by the split combine.
STEP2 = {
    "label": "no dictionary",
    "lookup": [],
    "attention": [[0.0, 1.0, 5.0, 6.0, 1, 1024, 0]],
    "combine": [[0.5, None, None, 6.5, 7.0, 2]],
    "combine_kind": "splits",
}

EXPECTED2 = [
    "== no dictionary",
    "attention: 1 CTAs, start 0.0 / p50 0.0 / last 0.0, end p50 6.0, last 6.0",
    "combine (splits): 1 CTAs, start 0.5-0.5, attention waited p50 6.5, end p50 7.0 / last 7.0",
    "step: first CTA start to last CTA end 7.0",
]

# A step with projected lookup keys: three whitening CTAs before the lookup (the third had no
# rows to project and returned before its stamps).
STEP3 = dict(STEP, label="projected keys",
             # start, key loaded, loop done, end, SM
             whiten=[[-6.0, -4.0, -1.0, -0.5, 3], [-5.0, -3.5, -2.5, -2.0, 4], [-5.5, None, None, None, 4]])

EXPECTED3 = [
    "== projected keys",
    # starts -6, -5.5, -5; the two that ran: key loaded -4 and -3.5, loops 3 and 1, ends -0.5
    # and -2 (the p50 of two values is the upper one: quantile rounds half up)
    "whitening: 3 CTAs on 2 SMs, start -6.0 / p50 -5.5 / last -5.0; key loaded p50 -3.5; "
    "loop 1.0 / 3.0 / 3.0; end p50 -0.5 / last -0.5",
    "lookup: 3 CTAs (2 scanned a block), start 0.0-1.0",
]

# The lookup CTAs' unit records (warp 1): the two working CTAs' stamps, the idle one's none.
STEP4 = dict(STEP, label="units",
             # view, first segment, members, keys landed, segments 1-3, scan done
             unit=[[2.0, 3.0, 3.5, 5.0, 9.0, None, None, 10.0],
                   [2.5, 4.5, 5.0, 6.0, 8.0, 12.0, None, 13.0],
                   [None] * 8])

EXPECTED4 = [
    # from ids read (1.0 and 1.5) or the stamp before: view 1 and 1, first segment 1 and 2,
    # members 0.5 and 0.5, keys 1.5 and 1, segment 1 4 and 2, segment 2 (the second CTA's
    # alone) 4, scan done 1 and 1 (after the last stamp reached)
    "warp 1 (n = 2), p50 us per stage from ids read: view 1.00, first segment 2.00, members 0.50, "
    "keys landed 1.50, segment 1 4.00, segment 2 4.00, scan done 1.00",
]

# A projecting lookup grid's records (thread 0 of each CTA): the first two CTAs projected, the
# third has none.
STEP5 = dict(STEP, label="projection",
             # entered, widths, x - mean, W landed, summed, counted, count seen, keys landed
             project=[[0.5, 1.5, 3.0, 3.5, 5.0, 5.5, 9.0, 10.0],
                      [1.0, 2.5, 4.0, 4.0, 7.0, 7.5, 9.5, 11.0],
                      [None] * 8])

EXPECTED5 = [
    # from the CTA's start (0.0 and 0.5) or the stamp before: entered 0.5 and 0.5, widths 1 and
    # 1.5, x - mean 1.5 and 1.5, W 0.5 and 0, summed 1.5 and 3, counted 0.5 and 0.5, count seen
    # 3.5 and 2, keys 1 and 1.5 (the p50 of two values is the upper one)
    "projection (n = 2), p50 us per stage from the CTA's start: entered 0.50, widths 1.50, "
    "x - mean 1.50, W landed 0.50, summed 3.00, counted 0.50, count seen 3.50, keys landed 1.50",
    # counted at 5.5 and 7.5, count seen at 9 and 9.5
    "counted p10 / p50 / p90 5.5 / 7.5 / 7.5, last 7.5; count seen p50 9.5",
]


def check(step, expected, absent):
    text = decode_timeline.summarize(step)
    missing = [e for e in expected if e not in text]
    present = [a for a in absent if a in text]
    if missing or present:
        print(text)
        sys.exit("missing from the summary: " + " | ".join(missing) + "; unexpected: " + " | ".join(present))


def main():
    check(STEP, EXPECTED, [])
    check(STEP2, EXPECTED2, ["lookup:", "flag", "working lookup CTA", "whitening"])
    check(STEP3, EXPECTED3, [])
    check(STEP4, EXPECTED4, ["segment 3"])
    check(STEP5, EXPECTED5, [])
    check(STEP, [], ["warp 1", "projection"])
    # A line that is not JSON, and a step without "combine" (an older build's, or not this kind).
    old = {k: v for k, v in STEP.items() if k != "combine"}
    check_bad_input(os.path.join(ROOT, "tools", "decode_timeline.py"), STEP, old, "decode timeline step")
    print("decode_timeline summary and bad-input checks passed")


if __name__ == "__main__":
    main()
