#!/usr/bin/env python3
"""Summarizes the per-CTA timestamps of a MAC step.

Input: the file `asmem_bench_mac --timeline FILE` writes in a build configured with
-DASMEM_MAC_TIMELINE=ON, one JSON line per benchmark config (layout: MacTimelineDump in
kernels/include/asmem/reuse.h). Times are microseconds from the first match CTA's start.

    tools/mac_timeline.py FILE
"""
import statistics

import timeline_file
from timeline_file import quantile


def summarize(step):
    out = [f"== {step['label']}"]
    match, plan, attend, combine = step["match"], step["plan"], step["attend"], step["combine"]
    if match:
        starts = [m[0] for m in match]
        ends = [m[1] for m in match]
        out.append(f"  match: {len(match)} CTAs, start {min(starts):.1f}-{max(starts):.1f}, "
                   f"end p50 {quantile(ends, 0.5):.1f}, last {max(ends):.1f}")
    out.append(f"  plan: start {plan[0]:.1f}, at its wait {plan[3]:.1f} (after the dry pass, if run), "
               f"match waited {plan[1]:.1f}, end {plan[2]:.1f}")
    ps = step["plan_steps"]
    out.append(f"  plan after its wait: keys and ranges {ps[0]:.1f}, totals {ps[1]:.1f}, "
               f"first batch placed {ps[2]:.1f}, its segments written {ps[3]:.1f}")
    if attend:
        col = lambda i: [a[i] for a in attend]  # noqa: E731
        start, waited, located, first, loop_end, end = (col(i) for i in range(4, 10))
        staged, weighed, stored = col(10), col(11), col(12)
        since = [max(a[5], a[4]) for a in attend]  # the CTA's own start: after the plan
        out.append(f"  attend: {len(attend)} CTAs with segments, start {min(start):.1f}-{max(start):.1f}, "
                   f"plan waited {min(waited):.1f}-{max(waited):.1f}, end p50 {quantile(end, 0.5):.1f}, "
                   f"last {max(end):.1f}")
        per = {
            "descriptors": [l - s for l, s in zip(located, since)],
            "to first tile": [f - l for f, l in zip(first, located)],
            "tile loop": [e - f for e, f in zip(loop_end, first)],
            "stage": [s - e for s, e in zip(staged, loop_end)],
            "weights": [w - s for w, s in zip(weighed, staged)],
            "stores": [t - w for t, w in zip(stored, weighed)],
            "whole CTA": [e - s for e, s in zip(end, since)],
        }
        out.append("  per CTA (stage, weights, stores: its last segment's), p10 / p50 / p90 us: " + "; ".join(
            f"{k} {quantile(v, 0.1):.1f} / {quantile(v, 0.5):.1f} / {quantile(v, 0.9):.1f}" for k, v in per.items()))
        by_tiles = {}
        for a in attend:
            if a[2] > 1:
                by_tiles.setdefault(a[2], []).append((a[8] - a[7]) / (a[2] - 1))
        common = sorted(sorted(by_tiles, key=lambda k: -len(by_tiles[k]))[:4])
        out.append("  us per tile after the first: " + ", ".join(
            f"{k} tiles (n = {len(by_tiles[k])}) {statistics.median(by_tiles[k]):.2f}" for k in common))
        late = [s for s in start if s > min(start) + 5]
        out.append(f"  CTAs starting more than 5 us after the first: {len(late)}")
        # The last CTAs to end: what the step waits for.
        last = sorted(attend, key=lambda a: -a[9])[:3]
        out.append("  last to end: " + "; ".join(
            f"first segment {a[0]} on SM {a[1]}, {a[2]} tiles / {a[3]} tokens, first tile {a[7]:.1f}, "
            f"last tile {a[8]:.1f}, end {a[9]:.1f}" for a in last))
    seg0 = step.get("seg0", [])
    if seg0:  # attend CTAs of several segments: their first segment's end
        verdict = [s[2] - s[1] for s in seg0]
        stored = [s[3] - s[2] for s in seg0]
        out.append(f"  first segments of {len(seg0)} CTAs of several: last tile {min(s[1] for s in seg0):.1f}-"
                   f"{max(s[1] for s in seg0):.1f}, to the verdict p50 {quantile(verdict, 0.5):.1f}, "
                   f"then to the partials stored p50 {quantile(stored, 0.5):.1f} (stored "
                   f"{min(s[3] for s in seg0):.1f}-{max(s[3] for s in seg0):.1f})")
        if len(seg0[0]) > 5:  # the epilogue's own stamps: staged, weights
            staged = [s[4] - s[2] for s in seg0]
            weights = [s[5] - s[4] for s in seg0]
            out.append(f"    of that: verdict to states staged p50 {quantile(staged, 0.5):.1f}, "
                       f"to weights p50 {quantile(weights, 0.5):.1f}")
    if combine:
        waited = [c[1] for c in combine]
        merged = [c[2] - c[1] for c in combine]
        ended = [c[3] - c[2] for c in combine]
        starts = [c[0] for c in combine]
        out.append(f"  combine: {len(combine)} CTAs, start {min(starts):.1f} / p50 {quantile(starts, 0.5):.1f} / "
                   f"{max(starts):.1f}, attend waited p50 {quantile(waited, 0.5):.1f}, "
                   f"merge p50 {quantile(merged, 0.5):.1f}, then p50 {quantile(ended, 0.5):.1f} to the end, "
                   f"last end {max(c[3] for c in combine):.1f}")
    return "\n".join(out)


def main():
    timeline_file.run(__doc__, "mac_timeline.py", "asmem_bench_mac", "MAC timeline step", summarize)


if __name__ == "__main__":
    main()
