#!/usr/bin/env python3
"""Summarizes the per-CTA timestamps of decode-attention steps.

Input: the file `asmem_bench_decode --timeline FILE` writes in a build configured with
-DASMEM_DECODE_TIMELINE=ON, one JSON line per benchmark config (layout: DecodeTimelineDump
in kernels/include/asmem/decode.h). Times are microseconds from the first CTA's start (the
lookup's when the step has one); a stamp a CTA did not reach is null.

    tools/decode_timeline.py FILE
"""
import timeline_file
from timeline_file import quantile


def spread(values):
    """p10 / p50 / p90 of a list, or '-' when it is empty."""
    if not values:
        return "-"
    return f"{quantile(values, 0.1):.1f} / {quantile(values, 0.5):.1f} / {quantile(values, 0.9):.1f}"


def reached(rows, i):
    return [r[i] for r in rows if r[i] is not None]


def stage_p50s(rows, names):
    """'name p50, ...' of records whose item 0 is a start stamp and items 1.. the stamps named
    by `names`: each stamp reached less the latest stamp reached before it."""
    parts = []
    for k, name in enumerate(names, 1):
        d = [r[k] - max(x for x in r[:k] if x is not None) for r in rows if r[k] is not None]
        if d:
            parts.append(f"{name} {quantile(d, 0.5):.2f}")
    return ", ".join(parts)


def summarize(step):
    out = [f"== {step['label']}"]
    lookup, attn, combine = step["lookup"], step["attention"], step["combine"]
    ends = []
    # Whitening CTAs (a step with projected lookup keys; they start before time zero): start,
    # key loaded, loop done, end, SM. A CTA with no rows to project returns before its stamps.
    whiten = step.get("whiten", [])
    if whiten:
        starts, done = reached(whiten, 0), [r for r in whiten if r[1] is not None and r[3] is not None]
        line = (f"  whitening: {len(whiten)} CTAs on {len({r[4] for r in whiten})} SMs, start {min(starts):.1f} / "
                f"p50 {quantile(starts, 0.5):.1f} / last {max(starts):.1f}")
        if done:
            line += (f"; key loaded p50 {quantile([r[1] for r in done], 0.5):.1f}; loop " +
                     spread([r[2] - r[1] for r in done if r[2] is not None]) +
                     f"; end p50 {quantile([r[3] for r in done], 0.5):.1f} / last {max(r[3] for r in done):.1f}")
        out.append(line)
    # Lookup CTAs: start, ids read, loop done, end, SM, blocks scanned, raised the flag.
    working_sms = set()
    if lookup:
        working = [r for r in lookup if r[5] > 0]
        working_sms = {r[4] for r in working}
        starts = reached(lookup, 0)
        out.append(f"  lookup: {len(lookup)} CTAs ({len(working)} scanned a block), start "
                   f"{min(starts):.1f}-{max(starts):.1f}, ids read p50 {quantile(reached(lookup, 1), 0.5):.1f}, "
                   f"last end {max(reached(lookup, 3)):.1f}")
        if working:
            out.append(f"    working CTAs: loop done p10 / p50 / p90 {spread(reached(working, 2))}, "
                       f"last {max(reached(working, 2)):.1f}; ids read to loop done p50 "
                       f"{quantile([r[2] - r[1] for r in working], 0.5):.1f}")
        # Warp 1's unit of each working CTA: view loaded, first segment found, members
        # listed, member keys and first chunks landed, three segments scanned, scan done; the
        # time from the CTA's ids read (or the stamp before) to each stamp reached.
        units = [[r[1]] + u for r, u in zip(lookup, step.get("unit", []))
                 if r[5] > 0 and r[1] is not None and u[0] is not None]
        if units:
            names = ["view", "first segment", "members", "keys landed", "segment 1", "segment 2",
                     "segment 3", "scan done"]
            out.append(f"    warp 1 (n = {len(units)}), p50 us per stage from ids read: " +
                       stage_p50s(units, names))
        # A projecting grid's CTAs (thread 0, the first unit): entered, widths known,
        # q_pre - mean staged, first W batch landed, rows summed, counted, the grid's count
        # seen, member keys landed; the time from the CTA's start to each stamp reached.
        proj = [[r[0]] + u for r, u in zip(lookup, step.get("project", [])) if u[0] is not None]
        if proj:
            names = ["entered", "widths", "x - mean", "W landed", "summed", "counted",
                     "count seen", "keys landed"]
            out.append(f"    projection (n = {len(proj)}), p50 us per stage from the CTA's start: " +
                       stage_p50s(proj, names))
            # A row: the CTA's start, then the eight stamps.
            counted = [row[6] for row in proj if row[6] is not None]
            seen = [row[7] for row in proj if row[7] is not None]
            if counted:
                out.append(f"    counted p10 / p50 / p90 {spread(counted)}, last {max(counted):.1f}" +
                           (f"; count seen p50 {quantile(seen, 0.5):.1f}" if seen else ""))
        flag = [r for r in lookup if r[6] == 1]
        if flag:
            out.append(f"    flag raised at {flag[0][3]:.1f}")
        ends += reached(lookup, 3)
    # Attention CTAs: start, first tile landed, tile loop done, end, SM, tokens, split, entry
    # picked (the CTAs that pick it themselves; null otherwise).
    if attn:
        starts = reached(attn, 0)
        out.append(f"  attention: {len(attn)} CTAs, start {min(starts):.1f} / p50 {quantile(starts, 0.5):.1f} / "
                   f"last {max(starts):.1f}, end p50 {quantile(reached(attn, 3), 0.5):.1f}, "
                   f"last {max(reached(attn, 3)):.1f}")
        busy = [r for r in attn if r[1] is not None and r[2] is not None]
        if busy:
            out.append("    per CTA p10 / p50 / p90 us: to first tile " +
                       spread([r[1] - r[0] for r in busy]) + "; tile loop " +
                       spread([r[2] - r[1] for r in busy]) + "; epilogue " +
                       spread([r[3] - r[2] for r in busy]) + "; tokens " +
                       spread([float(r[5]) for r in busy]))
            picked = [r for r in busy if len(r) > 7 and r[7] is not None]
            if picked:
                out.append("    entry picked, us after the tile loop's end (negative: inside it) " +
                           spread([r[7] - r[2] for r in picked]) + f" (n = {len(picked)})")
            if working_sms:
                beside = [r[2] - r[1] for r in busy if r[4] in working_sms]
                alone = [r[2] - r[1] for r in busy if r[4] not in working_sms]
                out.append(f"    tile loop on SMs of a working lookup CTA {spread(beside)} "
                           f"(n = {len(beside)}), elsewhere {spread(alone)} (n = {len(alone)})")
        if lookup:
            after = [s for s in starts if s > max(reached(lookup, 0))]
            out.append(f"    attention CTAs starting after the last lookup CTA's start: {len(after)}")
        # The CTAs' picks (step.pick, one record per attention CTA that picked its entry):
        # entered, view loaded, first parents' pieces known, lookup waited, then
        # (hierarchical) parent scores landed, parents selected, children's bests found, and
        # the entry chosen; the time from each stamp to the next one reached.
        picks = [r for r in step.get("pick", []) if r[0] is not None and r[7] is not None]
        if picks:
            names = ["view", "pieces", "wait", "scores landed", "selection", "children", "entry"]
            out.append(f"    pick (n = {len(picks)}), p50 us per stage: " + stage_p50s(picks, names) +
                       f"; entered to returned {quantile([r[7] - r[0] for r in picks], 0.5):.2f}")
        last = sorted(attn, key=lambda r: -r[3])[:3]
        out.append("  last attention CTAs to end: " + "; ".join(
            f"split {r[6]} on SM {r[4]}, {r[5]} tokens, start {r[0]:.1f}, end {r[3]:.1f}" for r in last))
        ends += reached(attn, 3)
    # Combine CTAs: start, flag seen, entry picked, attention waited, end, SM.
    if combine:
        starts = reached(combine, 0)
        line = (f"  combine ({step['combine_kind']}): {len(combine)} CTAs, start "
                f"{min(starts):.1f}-{max(starts):.1f}")
        if reached(combine, 1):
            line += (f", flag seen p50 {quantile(reached(combine, 1), 0.5):.1f}, entry picked p50 "
                     f"{quantile(reached(combine, 2), 0.5):.1f} / last {max(reached(combine, 2)):.1f}")
        line += (f", attention waited p50 {quantile(reached(combine, 3), 0.5):.1f}, end p50 "
                 f"{quantile(reached(combine, 4), 0.5):.1f} / last {max(reached(combine, 4)):.1f}")
        out.append(line)
        ends += reached(combine, 4)
    if ends:
        out.append(f"  step: first CTA start to last CTA end {max(ends):.1f}")
    return "\n".join(out)


def main():
    timeline_file.run(__doc__, "decode_timeline.py", "asmem_bench_decode", "decode timeline step", summarize)


if __name__ == "__main__":
    main()
