// MAC reuse device code (contracts: asmem/reuse.h; ranges and plan: reuse_common.h).
//
// A step is four kernels:
//  * Match, one CTA per (request, query head, ring split): the pre-RoPE query quantized to
//    8 bits (16 dims per lane, then the whole row gathered into every lane), one candidate
//    row per thread (two or four in flight): the row's 32-dim blocks of the query ring's two
//    nibble planes (a warp load reads one block of 32 consecutive rows: reuse.h's layout)
//    beside its scale and tag, the dot product by dp4a with no shuffles, the distance by
//    QueryDistance (reuse_common.h, the CPU reference's sequence), the best candidate by the
//    tie rule folded into a per-head u64 with one atomicMin (CandidateKey), after which the
//    CTA ends. Where a full scan reads at least kMatchFilterBytes, a row's low plane is read
//    only when the bound from its high plane (QueryDistanceBound) is under the threshold.
//  * Plan, one CTA launched with programmatic dependent launch after the match (resident
//    while the match's last CTAs run, in which, where B Hq >= kPlanWarmHeads, it runs its
//    code once without effect to cache it; griddepcontrol.wait): turns the keys into per-head
//    decisions (resetting them), lets the attend grid launch (its CTAs wait for the plan),
//    and plans the KV work: per-group ranges, then the groups' costs laid end to end and
//    cut into one portion per attention CTA (at most kTargetChunks: one wave of two CTAs
//    per SM), each portion one or more segments of one group's work (reuse_common.h), one
//    descriptor per segment and each CTA's first segment. Until 6157657 the match's last
//    CTA ran it (a done count in the layer state): every match CTA then waited for its key
//    atomic, a fence and the count's round trip before it ended. The plan kernel, one
//    machine session, two runs each, us, 32K unless said: LLaMA-8B B = 1 all-hit 28.2 ->
//    27.0-27.1, all-miss 66.0-66.2 -> 64.9-65.1, B = 32 99% per group 96.7-96.8 -> 95.1-95.2
//    (128K 133.5-133.6 -> 131.8-132.0), all-hit 76.9-77.1 -> 75.0, B = 64 99% 150.9-151.3 ->
//    148.5-148.8; GQA-8 B = 32 99% 80.5-80.7 -> 78.4-78.6, B = 64 99% 126.0-126.1 ->
//    122.6-122.8.
//  * Attend, one CTA per portion (kTargetChunks CTAs; those past the plan's portions exit at
//    once): its segments streamed back to back through one pipeline (AttendSegments), each
//    a run of one group's work tokens (its sink, then its band and tail), streamed once for
//    the G heads exactly as decode attention streams a split (decode_kernels.cuh
//    AttentionBlock: 64-token K/V tiles at d = 128, a 3-stage cp.async pipeline, Q K^T and
//    P V on tensor cores with the G heads as the mma N dimension, two CTAs per SM), with
//    the page ids coming into shared memory by cp.async with the copies of the tile two
//    before, and each segment's descriptor, query rows and band starts in rings ahead of
//    its tiles (110 KB of shared memory at d = 128, G = 8). Two online-softmax states per
//    lane: the band (each head from its own band start: the new entry) and the sink and
//    tail (the output); a 16-token piece of a warp updates only the states it touches. Two
//    normalized partial states per segment and head.
//  * Combine, one CTA per (request, query head): band partials + the reused entry -> the
//    new entry; sink and tail partials + the new entry + the prefix state -> the output;
//    then the ring writes (query, entry, tag). Every merge is state.cuh's. Grids of at most
//    two CTAs per SM copy a head's partial rows into shared memory in one round trip
//    (kCombineStageRows; session 51: B = 1 all-miss 0.5-1.3 us faster).
// With programmatic launch (MacDecodeConfig::programmatic_launch, on by default since
// session 14), attend and combine start while their predecessor drains and wait
// (griddepcontrol.wait) before reading anything it wrote; the combine loads its other
// inputs before that wait. A combine grid past one wave waits instead for its group's count
// of written segments (LaunchArgs::group_wait, CombineGroupWait; since session 22).
//
// Measured (H200, bf16, asmem_bench_mac; tools/results/bench_mac_h200.json) with the
// earlier attend kernel (CUDA cores, 32-token tiles, four CTAs per SM, about eight chunks
// per SM, sink, band and tail chunked apart), and why so:
//  * A grid of resident CTAs looping over the chunks (c += gridDim.x) was slower than one
//    CTA per chunk: all-miss LLaMA-8B B=64 32K 4316 vs 2806 us. Static round-robin gives
//    some CTAs several long chunks; the hardware's dynamic CTA dispatch balances them.
//    (Session 18's CTAs take static portions of equal cost instead: see its bullet.)
//  * Programmatic dependent launch made the B=1 all-hit step slower (43.2 vs 38.9 us) and
//    did not change B=32 (140 vs 138 us): early-launched CTAs sit on SMs waiting. With the
//    tensor-core attend (a752665) it changed nothing either: 32.2 vs 31.9 us at B = 1 and
//    128.5 vs 128.7 us at B = 32 (99% clustered hits, 32K). With the plan in its own kernel
//    (afa17de; asmem_bench_mac --pdl against --no-pdl, one machine session, two runs each,
//    clustered, us): B = 1 all-hit LLaMA-8B 27.0-27.2 -> 26.0-26.1, GQA-8 27.9-28.1 ->
//    26.3-26.5 (128K: LLaMA-8B 26.5-26.6 -> 25.8-25.9), B = 16 0.3-1 us faster, B = 32 and
//    all-miss within 0.7 us (LLaMA-8B B = 32 99% 95.7-96.0 vs 95.8-96.1), B = 64 99% at 128K
//    212.0-212.9 vs 211.0 and 218.9. Still off by default: the committed grids ran without it.
//  * All-hit cost: ~38 us at B=1 (three dependent kernels of little work each) plus ~4 us
//    per request at W = 512 for ~7 MB read (the 4 MB query ring scan of 32 heads and
//    ~2.7 MB of band and tail KV): ~1.7 TB/s, well under HBM speed.
//  * The group's finish in the attention kernel instead of the combine kernel (branch
//    mac-fuse, session 6): the CTA that finished a group's last chunk (a per-group count)
//    merged the group's partials and wrote the output and ring entries, one warp per head.
//    LLaMA-8B heads gained (B = 1 all-hit 32.2 -> 28.7 us, B = 32 107.7 -> 95.1 us, B = 32
//    99% clustered 32K 128.3 -> 121.2 us) but a group of many chunks then has one CTA read
//    all its partials: GQA-8 (8 heads per group) B = 1 all-miss 32K 59.0 -> 81.0 us, B = 16
//    99% clustered 32K 85.6 -> 117.8 us, B = 1 all-hit 32.4 -> 34.6 us. Not merged; a tree of
//    partial merges spread over the chunks' CTAs would be needed for large groups (branch
//    mac-fuse2 merges blocks of 8 chunks first; it passed the GPU tests but made every
//    B = 1 cell about 10 us slower than mac-fuse, also those without a block merge, for a
//    reason not found: LLaMA-8B all-hit 38.0 vs 28.9 us, GQA-8 48.9 vs 34.9 us). The
//    fused attend also needed no static shared memory: a 16-byte __shared__ flag beside the
//    dynamic tiles made it 4.5 us slower at B = 32 (36.5 vs 41.0 us, ncu); __syncthreads_or
//    replaced it.
//  * The ring rows through shared memory in 8 KB tiles with cp.async, two tiles ahead (16
//    KB in flight per CTA, 8 CTAs per SM): match 53.9-55.2 us against 54.4-55.0 us for
//    the register loads (B = 32 all-hit, 32K, ncu). About 11 us of it is not the scan: with
//    min_context above T (no row read) that variant took 10.8 us at B = 32, 7.2 us at B = 1
//    (its launch, query loads, count and plan are this kernel's).
//  * The query ring in 8 bits (session 7): the match at B = 32 all-hit 32K went from 54.3 to
//    31.4 us (ncu), the step from 107.6 to 87.9 us, B = 32 99% clustered from 134.5 to
//    114.5 us. Then tried on it: 8-row batches at B = 32 (kMatchWideCtas 4x): all-hit 88.0
//    -> 93.3 us; two ring splits per head at B = 32 (kMatchTargetCtas 2048): 88.0 -> 90.2 us.
//  * More attention chunks per step (kTargetChunks 528 / 1056 instead of 264): B = 32 99%
//    clustered 32K 113.3 -> 113.6 / 129.9 us, B = 1 all-miss 32K 71.2 -> 79.8 / 96.2 us
//    (the combine then merges up to 128 partials per head).
//  * Three attention CTAs per SM with two stages and a plan target of 3 x 132 (branch
//    mac-attend3, session 8; one session, LLaMA-8B 32K, us): B = 32 99% clustered 104.8 ->
//    97.6, but all-hit 78.0 -> 89.2, all-miss 1032 -> 1335 (a long chunk needs three stages),
//    B = 64 99% 162.0 -> 170.6; GQA-8 B = 64 99% 135.5 -> 129.6. Not merged.
//  * Per-CTA %globaltimer stamps (branch wip/timeline, session 8; LLaMA-8B 32K, us from the
//    step's first CTA): B = 1 all-hit: match 0-5.3, plan (last CTA) 5.4-8.4, attend 9.1-17.1
//    (44 chunks of up to 128 tokens), combine 17.9-25.9. B = 32 all-hit: match 0-28, plan 4.7 us,
//    attend 34-66 (256 chunks of 512 tokens, 27 us each), combine 66.4-74.3. B = 32 99%
//    clustered: match 0-29.6, plan 29.6-36.1, attend 37.0-91.5 (349 chunks; the last start
//    at 65.7), combine 92.6-104.3. A 512-token hit chunk takes about 27 us, while decode
//    attention's CTA of 1088 tokens takes 36 us at the same B: per CTA the attend streams
//    about 9.5 GB/s against about 15.
//  * Session 9 (one machine session, two runs each, 32K, clustered, us; not merged): a plan
//    step that keeps a thread's two groups in registers and puts their loads and key
//    exchanges in flight together (branch mac-plan2): LLaMA-8B B = 32 99% 105.1 -> 104.0-104.6,
//    GQA-8 B = 32 99% 94.6-94.8 -> 96.0-96.5 and B = 1 all-hit 31.5 -> 32.8-32.9. 16-row combine
//    batches for grids of at most 2 x 132 CTAs (branch mac-combine16, 177 registers): B = 1
//    all-hit 32.1-32.2 -> 40.9-41.2 (LLaMA-8B), 31.5 -> 40.3-40.4 (GQA-8); GQA-8 B = 1
//    all-miss 57.6-57.7 -> 64.0-64.1.
//  * Session 11 (32K, 99% hits per group unless said, us, each A/B in one machine session,
//    two runs each). Timeline before: LLaMA-8B B = 1 all-miss match 0-5.4, plan 5.7-9.2,
//    attend 9.9-54.2, combine 54.9-64.6; GQA-8 attend 10.6-39.1, combine 39.9-53.5 (the
//    pairwise merges of 128 partial rows per head). The N-way combine (MergePartials,
//    01925aa): LLaMA-8B B = 1 all-miss / all-hit 70.8 / 31.9 -> 67.0 / 29.2, B = 32 99% 102.6
//    -> 98.4, B = 64 99% 162.3 -> 157.0; GQA-8 B = 1 all-miss 57.9 -> 51.0, B = 32 99% 93.8 ->
//    84.5; all-miss B >= 32 unchanged. Not merged:
//    - Every attention CTA planning the step from the match keys (no plan CTA, the combine
//      resetting the keys): with 48 bytes of static shared memory in the attend kernel,
//      LLaMA-8B B = 32 all-miss 1012 -> 1296 (as with the earlier 16-byte flag); without
//      it, B = 1 all-hit 29.1 -> 30.0, B = 64 all-hit 133 -> 151, GQA-8 B = 64 99% 130 -> 140.
//    - The match reading the second half of a ring row only where a Cauchy-Schwarz bound on
//      its part of the dot product cannot keep the distance at or above the threshold (same
//      decisions): B = 16 -2.5, B = 64 -1.5, B = 32 +0.5 to +1 (so the match at B = 32 is not
//      bound by ring bytes), B = 1 +1.5 (the second half's round trip).
//    - The whole step as one cooperative launch (match, grid barrier, per-CTA plan and
//      attend, grid barrier, combine; GPU tests passed both ways): B = 1 all-hit 29.2 -> 38.9,
//      B = 8 41.1 -> 53.4, B = 16 57.1 -> 81.5. Two barriers over 264 CTAs cost more than two
//      kernel boundaries in a graph.
//    - kTargetChunks 528: B = 32 all-hit 78.2 -> 83.4, B = 1 all-miss 67.7 -> 72.8;
//      kMinChunk 64: GQA-8 B = 1 all-hit 29.2 -> 27.9, LLaMA-8B 29.0 -> 28.5, the rest
//      within noise; programmatic launch: within 1 us either way.
//    - The heads' band starts in the chunk descriptor (64 bytes; no load of the decisions
//      after it): B = 1 unchanged, B = 32 99% 97.8 -> 104.2, all-hit 78.0 -> 84.0, B = 64
//      all-hit 135 -> 146 (the plan step writes twice the bytes and holds more registers).
//  * Session 12 (32K, clustered, us, one machine session, two runs each): the match over
//    the blocked ring layout, one row per thread (before: row-major rows, d / 16 lanes per
//    row and three shuffles per row). LLaMA-8B B = 16 99% / all-hit 71.8-72.1 / 56.7-56.9
//    -> 68.7-68.9 / 53.4-53.7, B = 1 all-hit 29.1-29.3 -> 28.5-28.8, B = 64 99% 155.8-156.5
//    -> 153.0-153.2; GQA-8 B = 16 99% 59.6 -> 56.1-56.4, B = 64 all-hit 107.7-108.0 ->
//    104.7-105.4; B = 32 within 0.5. ncu, LLaMA-8B B = 32 99% (the build with one row in
//    flight at B = 32): match 33.9 -> 31.9 us with about a third of the issued
//    instructions, the SMs active 68% of it either way (the plan in the last CTA, 6.3-6.6
//    us in the timeline below, runs alone). With one row per thread (84
//    registers, 5 CTAs per SM) for grids past 528 CTAs: B = 64 2-3 us slower; bounded to 6
//    CTAs per SM (80 registers, 24 bytes spilled): slower still. Not merged: the plan
//    numbering groups by chunk length in four passes, longest first (instead of two: at
//    least half a base chunk, then the rest): GQA-8 B = 32 99% 83.5-83.7 -> 81.5-81.6 and
//    LLaMA-8B B = 16 99% per head 86.5-86.9 -> 83.1-83.2, but B = 1 all-hit 28.5-28.7 ->
//    30.0-30.1, LLaMA-8B B = 32 all-hit 77.2-77.4 -> 81.1-81.2, B = 64 99% 153.3 -> 159.3-159.6
//    (the two extra passes' scans and unit reads in the plan CTA). Also not merged: 264
//    resident attention CTAs taking the chunks from a queue (an atomic counter in the
//    workspace), thread 0 claiming the next chunk and loading its descriptor while the
//    current one streams (GPU tests passed): LLaMA-8B B = 32 99% 100.8-100.9 -> 109.0-109.9,
//    per head 126.8-127.1 -> 130.6-131.2, B = 16 99% 63.2-63.6 -> 66.3-66.4; GQA-8 B = 32 99%
//    83.7-84.0 -> 90.6-91.8, B = 64 128K 99% 161.9-164.7 -> 176.8-179.2; B = 1 and all-miss
//    unchanged. One CTA per chunk, placed by the hardware, stayed (until session 18's
//    streamed segments, below, whose CTAs take static portions). Per-CTA timeline at
//    b816f72 (%globaltimer stamps, LLaMA-8B, 32K, us from the first match CTA): B = 32 99%
//    per group: match CTAs 0-29.4 in two waves (121 registers: 4 CTAs per SM; 13.5 us each
//    for two round trips of 32 KB per CTA), plan 29.5-35.7, attend 36.7-90.4 (349 chunks,
//    28.3 us each at the median, the last starting at 65.1), combine 91.4-98.9; all-hit:
//    attend 34.1-65.6 (256 chunks in one wave, 28 us each for about 512 tokens: about 9 GB/s
//    per CTA against about 16 for decode attention's long splits in the same two-per-SM
//    layout). B = 64 99%: match 0-47.8 (four waves), plan 47.8-58.3, attend 59.3-138.1 (592
//    chunks), combine 139-152. B = 1 all-miss: match 0-4.9, plan 4.9-8.4, attend 9.1-54.5
//    (256 chunks), combine 55.2-61.1. Also not merged: the plan split per request (the
//    last match CTA of each request decides its heads and ranges, the last request's
//    finisher only numbers the chunks; a counter per slot; GPU tests passed): B = 32 and
//    LLaMA-8B B = 64 unchanged (100.2-100.7 -> 100.6-100.8, 152.7-152.9 -> 153.3), GQA-8
//    B = 64 99% 126.3-126.5 -> 124.1-124.4, but B = 1 all-hit 28.3-28.6 -> 29.0-29.2 and
//    B = 16 99% 63.1-63.4 -> 64.0-64.8. Nor is the short chunks' fixed cost a matter of
//    tiles in flight: every stage filled before the first tile (the first three tiles' page
//    ids in one round trip) and each stage refilled right after its tile is scored, so three
//    tiles are in flight instead of two (GPU tests passed): LLaMA-8B B = 32 99% 100.5-101.0
//    -> 100.8-101.0, all-hit 77.7-78.0 -> 78.6-78.8, B = 1 all-miss 67.0 -> 67.6; the
//    SmolLM2 trace at B = 1 25.5-25.8 -> 25.0-25.5. Where a 512-token chunk's 28 us go is
//    still to be profiled (ncu source counters of the attend kernel).
//  * Session 13 (ncu stall sampling, `--page source`, LLaMA-8B 32K). The attend kernel at
//    B = 32 all-hit (31.9 us alone, 59% of DRAM bandwidth): a fifth of the warps' samples
//    waited at the first use of a page id (loaded into registers one step ahead, queued
//    behind the tile copies), 13% at the barrier of the tile loop. With the ids through
//    shared memory (4043831; each tile's ids in the copy group of the tile two before):
//    30.2 us, the largest stall then the wait for the tile's data (14%). bench_mac, two
//    runs each: B = 32 all-hit 77.7 -> 77.1-77.2, 128K 99% 135.4-136.0 -> 133.5-133.8,
//    B = 64 99% 152.9-153.0 -> 150.9-151.3, GQA-8 B = 16 all-hit 47.3-47.4 -> 45.9-46.1, B = 1
//    all-miss 66.7-66.8 -> 65.7-66.0. The same ids in decode attention's three-stage
//    splits (no lookup) lost: LLaMA-8B B = 32 at 32K 979.7 -> 999.9-1000.7, B = 64 1945-1946 ->
//    1971-1976, GQA-8 B = 32 at 8K 147.0 -> 149.2 (those splits stream near the bandwidth bound;
//    not merged). The match at B = 32 99% (31.9 us, 49% of DRAM bandwidth): half its samples
//    wait for ring rows (two batches of 32 KB per CTA in turn), 9% at the barrier behind
//    thread 0's key and count atomics.
//  * Session 14 (one machine session, bench_mac, clustered, two runs each, us; base =
//    90c88d9 with --no-pdl / --pdl): the combine's loads of everything but the partials
//    before its wait for the attend grid, a head's partial rows (at most kWarps x BATCH) in
//    the same round trip as their lse, and programmatic launch by default. LLaMA-8B B = 1
//    all-hit 32K 26.7-27.2 / 26.1-26.3 -> 24.8-25.0, 128K 25.8-26.7 / 25.2-26.0 -> 24.0-25.0;
//    GQA-8 26.1-27.7 / 25.3-26.7 -> 24.2-25.4; B = 1 all-miss LLaMA-8B 64.9-65.5 / 64.7-65.8
//    -> 63.5-64.4, GQA-8 49.4-49.8 / 50.0-50.1 -> 48.2-48.4; B = 16 all-hit 1-2 us faster
//    (LLaMA-8B 51.3-52.3 -> 49.3-50.0); B >= 32 within about 1 us. Then kMinChunk 64
//    (reuse_common.h): B = 1 all-hit 24.1-25.0 in every cell. Then (another machine
//    session, three runs each, against 52b30d4): the plan kernel lets the attend grid
//    launch once the match grid is done (GridLaunchDependents after its wait), so the
//    attend CTAs come resident while the plan is made: B = 1 all-hit LLaMA-8B 24.3-24.7 ->
//    23.7-23.9, GQA-8 24.5-24.8 -> 24.0-24.4, B = 1 all-miss 0.3-1.3 faster, B >= 16 up to
//    1 us faster, none slower beyond the spread. Not merged: (1) the next batch of ring rows
//    prefetched into L2 (prefetch.global.L2) in the match: 0.5-1.5 us slower at B >= 32
//    (LLaMA-8B B = 32 all-hit 73.8-74.1 -> 74.7-75.0); (2) the misses' chunks sized to the
//    multi-chunk work alone when the one-chunk groups (hits) fill the first wave, so that
//    they follow the hits in short chunks instead of leaving hits to a second wave (99% per
//    group at B = 32: about 256 chunks of 320 tokens instead of 87 of 960): slower in every
//    cell, LLaMA-8B B = 32 99% per group 98.6-98.9 -> 101.9-102.4, GQA-8 B = 16 99% per head
//    66.6-66.8 -> 81.2-81.8, and B = 1 all-hit 0.7-1.5 slower from the plan's extra pass
//    and reduction. (3) A streaming match for B Hq > 528 (one machine session, three runs,
//    against efd12e1 and against itself switched off; GPU tests passed): 396 resident
//    CTAs (three per SM, 72 KB of stages) took units of 256 candidates of a head in turn,
//    each unit's ring rows, scales and tags copied into shared memory by cp.async while
//    the unit before was scored. Slower in every cell it served: LLaMA-8B B = 32 all-hit
//    72.9-73.2 -> 83.6-84.3, 99% per group 96.2-96.6 -> 106.7-107.1, B = 64 99% 146.4-146.8
//    -> 165.3-165.6; GQA-8 B = 32 all-miss 32K 529.7-532.5 -> 541.7-543.1. Each unit's fixed
//    work (query quantization and gather, the CTA reduction, the key atomic, two barriers)
//    runs in series within a CTA, where MacMatchKernel's four CTAs per SM overlap theirs;
//    with (1), this suggests the match is not bound by the bytes it has in flight. (4) A
//    group of one chunk finished in its attention CTA (the merges with the reused entry
//    and the prefix state, the output and the ring writes, one warp per head; the head's
//    combine CTA exits at once; one machine session, two runs each, 32K, against 60b4802;
//    GPU tests passed): LLaMA-8B all-hit B = 32 73.0-73.5 -> 69.1-69.2, B = 64
//    124.9-125.4 -> 118.5-118.7, but B = 32 99% per group 100.6-100.7 -> 102.2-102.4, per
//    head 121.3 -> 124.6-124.7, B = 16 all-hit 48.6-48.7 -> 51.7-52.0; GQA-8 (two heads per
//    warp) B = 32 all-hit 63.2-63.5 -> 71.9, 99% per group 82.8-83.1 -> 87.7-88.2; B = 1
//    0.3-0.8 slower.
//  * Session 15 (one machine session per item, two runs each, 32K, clustered, us; not
//    merged). The benchmark now empties the L2 by reading a buffer (asmem_bench_mac
//    --flush): the memset before each timed step left every L2 line dirty, and the step's
//    first reads paid for its write-back (LLaMA-8B B = 32 99% per group 98.7-98.9 ->
//    90.0-90.6, all-hit 73.5-73.7 -> 65.6-65.7, B = 1 all-miss 63.7-64.0 -> 54.4-54.7; full
//    attention B = 32 about 1% faster, B = 1 53.1 -> 44.5, so B = 1's all-miss ratio drops).
//    (1) The match with the copy engine (cp.async.bulk) bringing a head's whole ring (rows,
//    scales, tags; 72 KB at W = 512, d = 128, two halves on two mbarriers) into shared
//    memory at the CTA's start, the query quantized meanwhile (64 registers, three CTAs per
//    SM): slower in every cell of B >= 16, LLaMA-8B B = 32 99% per group 90.0-90.6 ->
//    95.7-96.4, all-hit 65.6-65.7 -> 70.4-70.6, B = 64 99% 139.7-140.1 -> 149.6-150.2, GQA-8
//    B = 16 all-hit 37.6-38.0 -> 41.8-42.0; B = 1 within 0.5. ncu, B = 32 99% per group, each
//    kernel alone: the register match 24.8 us at 62% of the DRAM bandwidth (1.94 waves of
//    four CTAs per SM), the bulk match 28.3 us at 54% (2.59 waves of three). (2) The KV of
//    each group's sink and tail (needed whatever the match decides) prefetched into L2 by
//    one match CTA of the group (prefetch.global.L2, up to a byte budget; with the ring rows
//    read evict-first, and with evict-last prefetches): slower everywhere, LLaMA-8B B = 32
//    99% 90.1-90.4 -> 92.7-93.0 (16 MB) / 95.6-96.1 (32 MB) / 96.1-97.0 (32 MB, both hints),
//    all-hit 65.0-65.1 -> 67.3-67.9 / 71.0; B = 1 0.3-1 slower; the evict-first ring loads
//    alone changed nothing. (3) The first batch of ring rows issued before the query is
//    quantized (128 registers, 8 bytes spilled): B = 1 hits 0.2-0.6 faster, B = 64 about 1
//    slower, the rest within the spread (LLaMA-8B B = 32 99% 90.6-90.8 -> 90.5-90.7). (4) The
//    KV pool: B = 32 cells with a pool for B = 32 at 32K against one for B = 64 at 128K (the
//    grid's) are within 1 us (99% per group 86.1 vs 86.3-86.4): the scattered pages' TLB
//    reach does not hold the short chunks back. Neither more bytes in flight (1) nor data
//    already in L2 (2) made a kernel faster; what is left is each kernel's ramp and drain
//    (the match's second wave, the attend's partial second wave) between the step's four
//    grid-wide dependencies.
//  * Session 17 (one machine session, bench_mac, clustered, two runs each, us, off -> on;
//    not merged): an early tail. Every group's sink and tail (the tokens every decision
//    needs) attended by CTAs of their own, the attend grid's first B Hkv CTAs, which skip
//    the wait for the plan; the plan kernel lets the attend grid launch before its own
//    wait, and its chunks cover only the bands; the combine merges one more pair of
//    partial rows per group (GPU tests passed, with the early tail forced on the common
//    sweep and at the most partial rows per head). The tails could not run beside the
//    match: a match CTA (121 registers) does not fit beside two attend CTAs (197), so
//    they took the SMs only as the match's last CTAs left, and then held 256 of the 264
//    slots the bands needed. LLaMA-8B B = 32 32K 99% per group 87.3, 87.2 -> 87.1, 86.8,
//    all-hit 65.7, 65.1 -> 68.2, 68.4, 128K 99% 122.3, 121.9 -> 122.7, 122.9, B = 16
//    all-hit 42.0, 42.3 -> 47.7, 47.4, B = 64 99% 139.0 -> 140.1, 140.8; GQA-8 B = 32 99%
//    74.8, 75.1 -> 70.4, 71.2 and B = 64 114.3, 114.2 -> 111.4, 111.8, but all-hit B = 32
//    54.1, 54.3 -> 60.7, 61.2 and B = 16 99% 45.9, 46.1 -> 53.2, 53.6; all-miss 0.2-4%
//    slower. A hit group then costs two CTAs, two pipeline fills and two partial pairs
//    instead of one.
//    Per-CTA timeline at 19b8783 (%globaltimer stamps, a diagnostic build; LLaMA-8B 32K,
//    us from the first match CTA's start; the stamps tick every 0.26 us). B = 32 all-hit
//    (65.9 us step): match CTAs 0-21.0 (two waves: the first ends at 12.3), plan resident
//    at 14.1, its wait over at 21.2, done at 26.6; attend CTAs resident at 22.0-22.3, past
//    their wait at 27.1, chunk descriptor read +1.0, page ids and first tile +3.3, then
//    1.7-1.9 us per 64-token tile (about 11 tiles: the loop streams near the HBM rate),
//    epilogue 3.1 (staging the states 1.0-1.3, the weights 1.3, the stores 0.3), last end
//    55.0; combine past its wait at 55.5 (median), merged +3.1, done +1.8 (max 60.9). B =
//    32 99% per group (89.0): the same up to the plan (done at 28.4); 349 chunks, 87 of
//    them starting as first-wave chunks end (the last at 55.3), last end 78.8, combine
//    done at 86.0. B = 1 all-hit (23.3): match 0-3.8, plan done 7.4, attend waited 7.9,
//    one or two tiles, done 13.3-14.8, combine done 19.2. So a chunk's fixed cost (about
//    4 us before its first tile, 3 after its last) and the second wave of short chunks,
//    not the streaming, are what the 99% step adds to the all-hit one. Merged after it,
//    each with its own A/B in its commit message (B >= 32 cells -2.7% .. +1.2%): padded
//    staging rows and a quad-lane lse merge in the epilogue (c45ee39), a plan CTA with a
//    thread per group and its inputs loaded before the wait, the bounded combine's inputs
//    before its wait (f496333), that combine's eager merge of one- and two-chunk groups
//    (c838cbd), and match CTAs of 64 threads past one wave of 128-thread CTAs, so that
//    B = 32's 1024 heads run in one wave (83c20d1).
//  * Session 18: the streamed segments (AttendSegments and the portion plan; before, each
//    planned chunk had its own CTA and paid the pipeline's fill and its epilogue alone,
//    and at 99% per group 87 of 349 chunks ran in a second wave). bench_mac, clustered
//    unless said, two runs each, us, base -> new, from two of the session's A/B calls
//    (machines differing by up to 6% in full attention): the form before its plan was
//    written by all threads in 32-bit arithmetic, then the committed form. LLaMA-8B B = 32 99%
//    per group 32K 82.4, 82.3 -> 76.4, 76.7 and 83.2, 83.0 -> 76.8, 77.5; 128K 117.3,
//    117.3 -> 113.1, 113.4 and 119.6, 120.2 -> 115.8, 115.3; per head 32K 108.0, 108.1 ->
//    101.6, 101.4; GQA-8 B = 32 99% per group 70.0, 70.3 -> 61.6, 62.4 and 65.2, 65.2 ->
//    63.1, 63.1; B = 64 99% 1-6% faster, all-miss at B >= 32 -1.4% .. +0.5%. Slower: B = 1
//    all-hit 22.0-22.9 -> 23.1-24.3 (the plan and one more round trip per CTA: its range,
//    then its descriptors), B = 16 all-hit 3-13%, B = 32 all-hit up to 12% (LLaMA-8B B = 32
//    62.1, 62.2 -> 63.0, 63.7 and 63.8, 63.5 -> 64.0, 64.3; GQA-8 B = 32 50.9 -> 54.9-55.3),
//    GQA-8 B = 16 99% per group 3-9%, B = 1 all-miss 2-15% (LLaMA-8B 32K 53.7 -> 58.3 and
//    54.7, 54.4 -> 60.6; in the timeline one
//    CTA ends 5-7 us after the median, against 2 us before, for a reason not found). The
//    plan CTA takes 4-6 us after the match against 3-5 before (timeline); with each
//    group's segments written by its own thread it held the attention grid back by up to
//    20 us at 128K (a hundred segments in turn), by the lanes of the group's warp 1-2 us
//    at B = 1. Register counts at d = 128: 206-221 (no spills).
//  * Session 19 (bench_mac, two runs each, us, base -> new, each A/B in one machine session).
//    Each attention CTA's first descriptor written by the plan beside its range (one round
//    trip less per CTA; GPU tests passed): 0.5-2% slower in most cells (LLaMA-8B B = 32 99%
//    per group 76.4, 75.9 -> 76.7, 76.5, B = 1 all-hit 23.1, 23.2 -> 23.3, 23.5); not merged.
//    Without the L2 flush the plan CTA still takes 5.6 us after its wait at B = 32 99% per
//    group (timeline; 4-6 us with the flush in session 18's). Its code run once without effect while the match ends (MacPlanKernel, merged;
//    reuse_common.h kPlanWarmHeads has its timeline and A/B). A segment's fixed cost of 2 or
//    3 blocks instead of 1 (reuse_common.h kSegmentFixedBlocks; the first try left the bounds
//    of portions of one block unwritten, now covered by PlaceGroup and the CPU tests): with
//    the plan's dry pass, 2 against 1 within 2% either way (LLaMA-8B B = 16 99% 48.2 -> 47.6,
//    B = 64 99% 128K 187.3 -> 190.6); not taken. The KV of every group's tail (its last r
//    tokens, needed whatever the decision) prefetched into L2 by the attention CTAs while the
//    plan is made (prefetch.global.L2 of K and V rows, up to 24 or 48 MB; GPU tests passed):
//    LLaMA-8B B = 32 99% per group 75.6, 75.5 -> 74.8, 74.7, the rest within 1.5% either way
//    (GQA-8 B = 32 99% per head 93.3, 93.4 -> 94.8, 94.7); not merged.
//  * Session 20 (bench_mac, two runs each, us, base -> new, each A/B in one machine session;
//    branch wip/early-tails, not merged): early tails. When every request holds at least
//    F + r tokens, each group's sink and tail (E = F + r tokens, needed whatever the match
//    decides) lie end to end on a line cut into one portion per attention CTA; the plan
//    kernel lets the attend grid launch at its start, each CTA streams its portion's pieces
//    first (sink-and-tail rows k + u of a second row region) and then the plan's segments,
//    which cover the bands only; the combine takes a group's band rows and its early rows.
//    GPU tests 6/6 in each of the three forms below; the CPU rules are in that branch's
//    MacPlan test.
//    (1) The wait for the plan when the page-id cursor (four tiles ahead) reaches the
//    plan's segments: at B = 32 right after the first early tile. LLaMA-8B B = 32 99% per
//    group 32K 76.4, 76.5 -> 79.8, 79.3, all-hit 62.6, 63.0 -> 68.5, 68.5, B = 1 all-hit
//    22.6, 22.8 -> 28.9, 29.0, B = 64 99% 132.8, 132.9 -> 128.8, 129.6; GQA-8 B = 32 99%
//    60.2, 60.5 -> 66.2, 66.7. (2) The cursors stopped at the plan's segments and the wait
//    at the last early tile: slower still (LLaMA-8B B = 32 99% 76.0, 76.1 -> 85.5, 85.4,
//    all-hit 62.3, 62.2 -> 74.1, 74.2, B = 1 all-hit 23.0, 23.1 -> 30.4, 30.6). Timeline of (2),
//    LLaMA-8B 32K, us from the first match CTA (base in brackets): the attend CTAs come
//    resident at 18.4-20.0 (21.5-21.8), as the match's last CTAs end at 20.5, not earlier (a
//    match CTA holds the registers an attend CTA needs); the plan ends at 28.2 (25.9); at
//    B = 32 all-hit a tile takes 3.7 us after the first (1.9), at 99% 2.8-3.2 (1.7-1.9), and
//    the CTAs' wait for the plan returns at 32.5-33.5, after their four early tiles; at B = 1
//    a CTA's band tile after its one early tile ends 12.5 us after the early tile (the base's
//    CTAs: 1.0 us of tiles). With programmatic launch off (no grid beside another), (2) was
//    still slower (LLaMA-8B B = 32 99% 76.9, 76.8 -> 94.6, 94.9, B = 1 all-hit 25.3, 25.3 ->
//    35.5, 34.3): its early tiles took 3.1 us each with nothing running beside them, so the
//    slow tiles come from the form itself. (3) Its attend kernel has 137 KB of text at d = 128,
//    G = 4 against 72 KB; with one issue_tile call site in the loop (103 KB): LLaMA-8B B = 32
//    99% 76.2, 76.4 -> 79.6, 79.5, all-hit 62.8, 63.2 -> 69.1, 69.3, B = 1 all-hit 22.6, 22.8 ->
//    28.9, 29.0; GQA-8 B = 64 within 1%; early tiles still about 3 us each (timeline). So code
//    size is not the whole cause either; what makes those tiles slow was not found. In every
//    form no early tile ran beside the match, and the plan ran slower beside the streaming
//    CTAs (B = 32 99%: it ended at 26.9, 28.2, 28.9 us in (1), (2), (3); 25.9 in (2)'s base).
//  * Session 21 (bench_mac, clustered, two runs each, us, 6d1a577 -> the filtered match with
//    LaunchMatch's rules, one machine session; reuse GPU tests 6/6, with two cases added for
//    the filtered match's two CTA sizes): the query ring in two nibble planes, and where a
//    full scan reads at least kMatchFilterBytes the high plane first (reuse.h). A diagnostic
//    that read half of each ring row ended the match at 12.3-13.6 us instead of 19.7-20.7
//    (LLaMA-8B B = 32 32K, timeline): the match there is bound by ring bytes, unlike session 11's
//    reading at two waves. LLaMA-8B B = 32 99% per group 32K 75.8, 76.3 -> 69.3, 69.0, 128K
//    115.6, 115.9 -> 109.0, 109.3, all-hit 63.7, 63.8 -> 57.0, 56.8; B = 16 99% 48.4, 48.2 ->
//    46.2, 46.0; B = 64 99% 133.5, 133.7 -> 121.3, 121.2; GQA-8 B = 32 99% 60.0, 60.1 -> 56.3,
//    56.0, B = 64 99% 103.4, 103.4 -> 92.9, 92.7; B = 1 all-hit 22.8, 22.9 -> 23.2, 23.2 (the
//    unfiltered match puts the bytes back together: ByteDot). SmolLM2 query trace (Hq 9,
//    d = 64, no cell filtered): B = 1 32K 21.6, 21.6 -> 22.1, 21.9, B = 32 128K 51.3, 51.3 ->
//    52.1, 52.7, B = 64 128K 57.9, 57.7 -> 56.9, 58.6. Timeline at 701cd73 (32K, us from
//    the first match CTA): all-miss, the attend CTAs end unevenly (GQA-8 B = 16 p50 253.7,
//    last 264.4; B = 32 490.5, 503.8; LLaMA-8B B = 16 484.6, 501.8) after starting at 14.8,
//    18.9, 14.8; at B = 16 the plan's dry pass outlasts the filtered match (GQA-8: match last
//    end 8.7, plan at its wait 10.8); GQA-8 B = 1 all-miss: plan done 9.2, attend last 31.7,
//    combine (64 partial rows per head) last 39.2; GQA-8 B = 32 99% per group: attend p50
//    38.1, last 43.8, combine last 52.0 (step 55.7).
//  * Session 22 (bench_mac, 32K, clustered, two runs each, us, one build): every MAC kernel
//    at the largest shared-memory carveout (an environment knob, not merged). GQA-8 B = 1
//    all-miss 45.2, 44.9 -> 43.7, 43.3, LLaMA-8B 57.5, 56.8 -> 56.6, 56.2; but B = 32 slower
//    with hits: LLaMA-8B 99% per group 69.1, 69.6 -> 71.4, 71.4, all-hit 56.1, 55.8 -> 58.4,
//    57.9; GQA-8 99% 54.2, 54.1 -> 56.3, 56.2, all-hit 48.4, 48.3 -> 51.5, 50.9; all-miss at
//    B >= 16 within 0.5%.
//  * Session 23 (bench_mac, 32K, clustered, two runs each, us; not merged; the tables are in
//    tools/results/decode_h200_diagnostics.md). The all-miss portions prefetched into L2 by
//    each attend CTA before its wait for the plan, where every group streamed its whole
//    range the step before: at most 0.8 faster than the same binary with it off (LLaMA-8B
//    B = 1 all-miss 69.0, 68.9 -> 68.0, 68.3). But that prefetch's inlined code, about 23 KB
//    of SASS ahead of this kernel's 72 KB and never executed with it off, made every step
//    slower: LLaMA-8B B = 1 all-miss 58.4, 60.0 -> 68.8, 68.6, all-hit 23.0, 23.1 -> 27.2,
//    27.6, B = 32 all-hit 57.5, 57.4 -> 63.3, 63.5; without the call, as the base.
//  * Session 24 told place from size (one machine session, the same four builds against the
//    base). The same 23 KB of never-run code ahead of the body: B = 1 all-miss 58.6, 58.3 ->
//    67.4, 67.6, all-hit 23.2, 23.2 -> 27.7, 27.6, GQA-8 B = 32 all-hit 49.1, 49.6 -> 53.9,
//    54.3; at the kernel's end instead: every cell within 2.2%. The prologue's loops not
//    unrolled (72 -> 56 KB) or also the query-row copy (50 KB): within 1.7% either way. So
//    it is the place: code that a step may skip must not sit at the kernel's entry, ahead of
//    all the code it runs (at the kernel's end the same code cost nothing measured; a
//    __noinline__ form was only measured called, session 23). Skipped blocks between the
//    pieces a step runs were not seen to cost: at B = 1 all-hit this kernel jumps over about
//    33 KB of code that other steps run (ncu), and removing the prologue's unrolled copies
//    among them (the 50 KB build) did not change that cell.
//  * Session 25 (branch wip/spec-cache, one machine session against 033a61d): one static
//    __shared__ word added to the speculating attend kernel moved its dynamic shared memory
//    from byte 1024 to 1040 (ptxas). Each 64-token tile then took 2.11 instead of 1.81 us
//    (timeline), and LLaMA-8B B = 8 all-miss went 269 -> 307 us; with the word read through
//    barriers instead, the loss went away. The likely cause is the tiles' alignment (not
//    checked further): keep this kernel's static shared memory at 1024 bytes.
//  * Session 26 (FindSpecPortion; one machine session per form against 033a61d, two runs
//    each): the attend CTAs finding their own all-miss portions gained only in the form
//    merged, whose search is short and writes the descriptors itself. With thread 0 making
//    each descriptor as the tile loop reached it (code inside the loop), every B <= 8 cell
//    was slower, all-hit too (LLaMA-8B B = 1 all-hit 23.4, 23.4 -> 27.4, 27.4) and a tile took
//    2.07 us instead of 1.84; with the search also unrolled at the entry, 23.0, 23.2 -> 28.2,
//    28.3. A form with the planned path and the speculating one as two inlined copies, the
//    second marked unlikely, compiled with the speculating copy first and the planned one
//    116 KB into the kernel (not run).
//  * Session 70 (not merged; tools/results/decode_h200_diagnostics.md): the match and plan
//    inside the attend grid (no match or plan kernel; the plan in the CTA that completed the
//    last match piece) and the order match, attend, plan, combine (the attend CTAs waiting
//    for the plan's words) both passed the GPU tests and were slower at every B <= 8 measured
//    (LLaMA-8B B = 1 all-miss / all-hit, H100: 61-63 -> 64-70 / 22 -> 30-41 us): made in an
//    attend CTA, the plan ran 12-13 us (cold code, dependent round trips); launched after
//    the attend grid, its CTA came resident 8-15 us into the step. 64-thread match CTAs
//    wherever the step may speculate were slower too (H200, up to 2.1 us).
//  * Session 71 (not merged, branch wip/two-kernel-real; diagnostics file as above): the step
//    as two kernels where it may speculate (the attend grid streaming the all-miss line
//    first, the combine scanning its head's ring before its wait and attending a hit head's
//    band itself) passed the GPU tests and, where nothing hits, was no faster than these four
//    (H100, B = 1 32K: LLaMA-8B 62.1 vs 62.8 us, GQA-8 43.4 vs 40.8). Choosing the
//    sequence per step through a conditional graph node costs about 10 us a step
//    (asmem_bench_mac --launch graph-if).
//  * Session 72 (not merged; diagnostics file as above; H100). The two-kernel step in kernels
//    of its own (v3, 845c57d) is no faster either: B = 1 32K all-miss LLaMA-8B 63.1 vs 62.8
//    us, GQA-8 44.2 vs 40.5; 0.5-8.1 us faster at B = 2-8 but GQA-8 B = 2 32K (and at
//    LLaMA-8B B = 1 128K, 0.7).
//    Speculating past kSpecMaxHeads with the attend grid launched after the plan's wait
//    (branch wip/late-spec; GPU tests passed) was 1.0-6.5 us slower where nothing hits
//    (LLaMA-8B B = 32 1431.7 -> 1437.0, GQA-8 B = 64 1449.7 -> 1456.2) and 0-1.0 with hits.
//  * Session 73 (not merged; diagnostics file as above; H100). A filtered match that reads
//    the high nibbles of each row's first half first (branch wip/match-half) was 0.8-3.0 us
//    slower where nothing hits at B = 16-64, in all but one cell (nearly every warp still
//    makes the second round trip for a kept row). The plan CTA making the all-miss plan
//    before its wait for the match and ending right after the keys where no head hit
//    (branch wip/plan-pre, on that match) was 1.6-8.0 us faster than that match alone
//    where nothing hits and 0.8-2.5 us slower with hits; gated by the layer's guess
//    (wip/plan-pre-gated, on main), see session 74.
//  * Session 74 (not merged; diagnostics file as above; H100). The guess-gated all-miss
//    plan (wip/plan-pre-gated, with each combine CTA resetting its head's match key) was
//    0.5-8.0 us faster than main where nothing hits at B = 16-64, 32K and 64K (at most
//    0.45%), and 0.1-0.8 us slower with hits in 20 of 24 cells (LLaMA-8B B = 16 99% 50.4 ->
//    51.0, all-hit 43.2 -> 43.8), though those steps plan as main does.
// MacFill reuses Attend (one CTA per static split of (request, position, KV head)) and a
// fill combine that writes the entries.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "asmem/cuda_check.cuh"
#include "asmem/reuse.h"
#include "asmem/state.cuh"
#include "decode_kernels.cuh"  // shared device helpers: Pack<DType>, CpAsync16/Commit/Wait
#include "reuse_common.h"
#include "reuse_launch.cuh"

namespace asmem {
namespace mac {

using decode::CpAsync16;
using decode::CpAsync4;
using decode::CpAsyncCommit;
using decode::CpAsyncWait;
using decode::LoadRow;
using decode::Pack;
using decode::StoreOut;
using decode::StoreRow;

constexpr float kLn2 = 0.6931471805599453f;

#ifdef ASMEM_MAC_TIMELINE
// Diagnostic builds (CMake -DASMEM_MAC_TIMELINE=ON; MacTimelineDump in reuse.h): each CTA of
// the first kTlCtas of a grid records %globaltimer stamps of its last step (the timer ticks
// about every 0.26 us on an H200). Off by default: no stamp is compiled in.
constexpr int kTlCtas = 8192;
__device__ __forceinline__ unsigned long long TlNow() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ int TlSm() {
  int s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
// Attend CTA: start, plan waited, first descriptors landed, first tile landed, last tile
// done, CTA done, then its last segment's states staged, merge weights written, partials
// stored; chunk: its first segment; tiles, tokens: all of its segments'.
struct TlAttend {
  unsigned long long t[9];
  int sm, chunk, tiles, tokens;
};
__device__ TlAttend g_tl_attend[kTlCtas];
// Attend CTA of more than one segment: its first segment's last tile consumed, its verdict
// read (speculating CTAs), its partials stored, then its epilogue's states staged and merge
// weights written (0: not stamped this step).
__device__ unsigned long long g_tl_seg0[kTlCtas][5];
__device__ unsigned long long g_tl_match[kTlCtas][2];    // start, end
__device__ unsigned long long g_tl_plan[4];              // start, match waited, end, at its wait
// The real plan pass, thread 0: keys read and reset with the ranges set, totals (S), its
// batch placed (scans, PlaceGroup), the batch's segments written.
__device__ unsigned long long g_tl_plan_steps[4];
__device__ unsigned long long g_tl_combine[kTlCtas][4];  // start, attend waited, end, merged
__device__ int g_tl_grid[3];                             // match, attend, combine CTAs
__device__ __forceinline__ bool TlCta() { return blockIdx.x < kTlCtas; }
#define TL(stmt) stmt
#else
#define TL(stmt)
#endif

// (d1, p1) beats (d2, p2): a candidate at all, smaller distance, ties to the earlier position.
__device__ __forceinline__ bool Better(float d1, int32_t p1, float d2, int32_t p2) {
  if (p1 < 0 || isnan(d1)) return false;  // a NaN distance is no candidate (as on the CPU)
  if (p2 < 0) return true;
  return d1 < d2 || (d1 == d2 && p1 < p2);
}

// A count published across grids: the add releases this CTA's writes ordered before it
// (its barrier), the load acquires them (gpu scope).
__device__ __forceinline__ void ReleaseAdd(int32_t* p, int32_t v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int32_t AcquireLoad(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// The speculative plan's words (LaunchArgs::spec): plain reads and writes at gpu scope (no
// ordering of other accesses).
__device__ __forceinline__ void RelaxedStore(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t RelaxedLoad(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int32_t SlotOfDev(const int32_t* slot_ids, int b) {
  return slot_ids ? slot_ids[b] : b;
}

// ---------------------------------------------------------------------------------------
// Plan (MacPlanKernel, one CTA after the match grid)
// ---------------------------------------------------------------------------------------

// Exclusive scan of one int per thread over a CTA of WARPS warps; *total gets the sum. Ends
// synced.
template <int WARPS = kWarps, typename T = int32_t>
__device__ __forceinline__ T BlockExclusiveScan(T x, T* total, T* sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T incl = decode::WarpInclusiveSum(x);
  if (lane == 31) sm[warp] = incl;
  __syncthreads();
  T before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    if (w < warp) before += sm[w];
    all += sm[w];
  }
  __syncthreads();
  *total = all;
  return before + incl - x;
}

// Programmatic dependent launch (decode_kernels.cuh): no-ops without the launch attribute.
using decode::GridDependencyWait;
using decode::GridLaunchDependents;

// The plan's inputs for group u that the match does not write: its request's T and slot.
struct PlanInputs {
  int32_t T = 0, slot = 0;
};
__device__ __forceinline__ PlanInputs LoadPlanInputs(const LaunchArgs& a, int u) {
  PlanInputs in;
  if (u < a.batch * a.hkv) {
    const int b = u / a.hkv;
    in.T = a.p.seq_lens[b];
    in.slot = a.p.slot_ids ? a.p.slot_ids[b] : b;
  }
  return in;
}

// What the plan's line is cut from (PortionBlocks, AlignedPortionBlocks), tallied over a
// lane's groups and then over the warp: the groups' costs (reuse_common.h SegmentCost), the
// most work blocks of a group, and the smallest cost of a group with work and their count.
// PlanStep and FindSpecPortion tally the same line.
struct LineTally {
  long long total = 0;
  int32_t most = 0;
  int32_t least = INT_MAX, nw = 0;
  __device__ __forceinline__ void Add(int32_t cost, int32_t work_blocks) {
    total += cost;
    most = max(most, work_blocks);
    if (cost > 0) {
      least = min(least, cost);
      ++nw;
    }
  }
  // Every lane ends with the warp's tally (the last two in one instruction each: after a
  // loop, shuffles compile to divergence-safe sequences).
  __device__ __forceinline__ void WarpAll() {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      total += __shfl_xor_sync(0xffffffffu, total, o);
      most = max(most, __shfl_xor_sync(0xffffffffu, most, o));
    }
    least = int32_t(__reduce_min_sync(0xffffffffu, uint32_t(least)));
    nw = int32_t(__reduce_add_sync(0xffffffffu, uint32_t(nw)));
  }
};

// NT threads (MacPlanKernel's block): group u of the first NT is thread u's, and its inputs
// (`first`) were loaded before the wait for the match. Modes (one code path):
//  * kPlanReal: the step's plan from the match's keys (reset for the next step) and, with
//    kSpec (LaunchArgs::spec), the step's words in step_spec: whether it speculated
//    (`spec_live`), the verdict and the next step's guess;
//  * kPlanDry: every head a miss, no key load and no global write, run before the wait for
//    the match so that the real pass finds its instructions cached.
constexpr int kPlanDry = 0, kPlanReal = 2;
template <int NT, bool kSpec>
__device__ inline void PlanStep(const LaunchArgs& a, const PlanInputs& first, int mode, bool spec_live) {
  const bool dry = mode == kPlanDry;       // no global write
  const bool keys_on = mode == kPlanReal;  // the match's keys (else every head misses)
  HeadDecision* const o_heads = a.heads;
  UnitPlan* const o_units = a.units;
  ChunkDesc* const o_chunks = a.chunks;
  int32_t* const o_cta_first = a.cta_first;
  constexpr int kPlanWarps = NT / 32;
  const MacParams& p = a.p;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int G = a.group;
  const int nu = a.batch * a.hkv;
  __shared__ long long sm_tok[kPlanWarps];
  __shared__ long long sm_scan64[kPlanWarps];
  __shared__ int32_t sm_most[kPlanWarps], sm_least[kPlanWarps], sm_nw[kPlanWarps];
  __shared__ int32_t sm_scan[kPlanWarps];
  // Per group of a batch of NT: its segments' inclusive end within the batch, its first
  // portion (| 0x10000: the portion starts in its range), its first work block's offset in
  // that portion, its work tokens and ranges (28 B per thread).
  __shared__ struct {
    int32_t incl[NT], pf[NT], q0[NT], work[NT], sink_end[NT], band_lo[NT], band_end[NT];
  } sm_seg;
  // Per group: its heads' decisions (the keys are reset for the next step), its ranges.
  // The first group of each thread stays in registers for the passes below (B * Hkv <= NT:
  // no global round trip between them).
  LineTally line;
  bool all_miss = true;  // every head of this thread's groups
  UnitPlan mine{};
  for (int u = tid; u < nu; u += NT) {
    const int b = u / a.hkv, h = u % a.hkv;
    const PlanInputs in = u == tid ? first : LoadPlanInputs(a, u);
    const int32_t T = in.T;
    const int32_t slot = in.slot;
    int32_t lo = T;
    // The group's keys are loaded all at once (G <= 8 loads in flight, not one round trip
    // each: this CTA runs alone between the match and the attention), then reset by plain
    // stores for the next step (the match grid is complete; the next step's match runs after
    // this step's kernels). With atomicExch for both (until session 19; one machine session,
    // two runs each, clustered, us): B = 1 all-hit LLaMA-8B 23.6, 23.9 -> 23.0, 23.1, GQA-8
    // 24.1, 24.3 -> 23.2, 22.6 (128K 24.1, 24.2 -> 22.8, 22.8); B = 16 1.0-3.4% faster, B = 32
    // -1.5% .. +0.9%, B = 64 -0.3% .. +1.5% (LLaMA-8B 128K 99% 191.3, 193.1 -> 192.4, 197.7).
    unsigned long long keys[8];
#pragma unroll
    for (int g = 0; g < 8; ++g) {
      keys[g] = g < G && keys_on ? __ldcg(p.state.match_best + int64_t(slot) * a.hq + h * G + g) : kNoCandidate;
    }
#pragma unroll
    for (int g = 0; g < 8; ++g) {
      if (g < G && keys_on) p.state.match_best[int64_t(slot) * a.hq + h * G + g] = kNoCandidate;
    }
    bool group_miss = true;
#pragma unroll
    for (int g = 0; g < 8; ++g) {
      if (g >= G) break;
      const int hq = h * G + g;
      const unsigned long long key = keys[g];
      const int32_t pos = key == kNoCandidate ? -1 : int32_t(uint32_t(key & 0xffffffffull));
      const float dist = __uint_as_float(uint32_t(key >> 32));
      HeadDecision hd;
      hd.hit_pos = (T > 0 && pos >= 0 && dist < a.threshold) ? pos : -1;
      hd.band_start = T > 0 ? BandStart(a.front_sink, a.band, T - 1, hd.hit_pos) : 0;
      if (!dry) o_heads[b * a.hq + hq] = hd;
      lo = min(lo, hd.band_start);
      group_miss &= hd.hit_pos < 0;
    }
    all_miss &= group_miss;
    UnitPlan up{};
    if (T > 0) {
      const UnitRanges R = GroupRanges(a.front_sink, a.band, T, lo);
      up.sink_end = R.sink_end;
      up.band_lo = R.band_lo;
      up.band_end = R.band_end;
      up.end = R.end;
      const int32_t work = UnitWork(up);
      line.Add(int32_t(SegmentCost(work)), int32_t(WorkBlocks(work)));
    }
    if (!dry) {
      o_units[u] = up;  // ranges now, segments below (read back by this thread only)
      if (keys_on && a.group_wait) a.group_done[u] = 0;  // counted up by the attend CTAs (the
                                                         // previous step's combine is done)
    }
    if (u == tid) mine = up;
  }
  TL(if (tid == 0 && keys_on) g_tl_plan_steps[0] = TlNow());
  line.WarpAll();
  if (lane == 0) {
    sm_tok[warp] = line.total;
    sm_most[warp] = line.most;
    sm_least[warp] = line.least;
    sm_nw[warp] = line.nw;
  }
  // The verdict, as soon as the decisions are known, on every step a speculating attend CTA
  // may have streamed (they poll this word; it is final once this grid is done): 1 where
  // every head missed, so the all-miss plan is the step's own, 2 where not.
  if constexpr (kSpec) {
    if (__syncthreads_and(all_miss) == 0) all_miss = false;
    if (keys_on && tid == 0) {
      RelaxedStore(a.step_spec + 1, all_miss ? 1u : 2u);
      RelaxedStore(a.step_spec + 2, all_miss ? 1u : 0u);  // the next step's guess
      RelaxedStore(a.step_spec, spec_live ? 1u : 0u);
    }
  } else {
    __syncthreads();
  }
  long long total = 0;
  int32_t most = 0, least = line.least, nw = 0;
#pragma unroll
  for (int w = 0; w < kPlanWarps; ++w) {
    total += sm_tok[w];
    most = max(most, sm_most[w]);
    least = min(least, sm_least[w]);
    nw += sm_nw[w];
  }
  long long S = PortionBlocks(total, most);
  // The aligned line where the groups are long and of one cost (reuse_common.h): each
  // group with work then costs `aligned_cost`.
  const int32_t sa = AlignedPortionBlocks(S, least, most + kSegmentFixedBlocks, nw);
  int32_t aligned_cost = 0;
  if (sa > 0) {
    aligned_cost = AlignedCost(least, sa);
    total = static_cast<long long>(aligned_cost) * nw;
    S = sa;
  }
  TL(if (tid == 0 && keys_on) g_tl_plan_steps[1] = TlNow());
  const long long n_cta = (total + S - 1) / S;  // <= kTargetChunks
  // Divisions on the line in 32 bits where it fits (a 64-bit division is a long
  // subroutine; the plan CTA's time is on the step's critical path).
  const bool small = total < (1ll << 31);
  auto div_s = [&](long long x) -> long long {
    return small ? static_cast<long long>(static_cast<uint32_t>(x) / static_cast<uint32_t>(S)) : x / S;
  };

  // The groups' costs laid end to end in group order, [F_u, F_u + cost_u) with the work
  // blocks after the fixed cost; CTA k's portion [k S, (k + 1) S) of that line is one or
  // more segments, each the part of one group's work in it (reuse_common.h). A group's
  // segments are numbered in order, so its partial rows stay consecutive for the combine.
  // The segments are written by all threads together (a missing group at 128K can have a
  // hundred segments: one thread writing them in turn kept the attention grid waiting for
  // 20 us; the lanes of the group's warp, 1-2 us at B = 1, where all groups are in warp 0).
  long long carry_cost = 0;
  int32_t carry_seg = 0;
  for (int first = 0; first < nu; first += NT) {
    const int u = first + tid;
    UnitPlan up{};
    int32_t work = 0;
    long long cost = 0;
    if (u < nu) {
      up = first == 0 ? mine : dry ? UnitPlan{} : o_units[u];
      work = UnitWork(up);
      cost = SegmentCost(work);
      if (sa > 0 && cost > 0) cost = aligned_cost;
    }
    long long cost_all = 0, F = carry_cost;
    if (small) {
      int32_t all32 = 0;
      F += BlockExclusiveScan<kPlanWarps>(int32_t(cost), &all32, sm_scan);
      cost_all = all32;
    } else {
      F += BlockExclusiveScan<kPlanWarps, long long>(cost, &cost_all, sm_scan64);
    }
    // Portions are at most kTargetChunks: p_first fits 32 bits, and so does the offset of
    // the group's first work block in its portion (q0 < S).
    const GroupLine gl = PlaceGroup(F, work, S, div_s);
    const int32_t nseg = gl.nseg;
    int32_t seg_all = 0;
    const int32_t first_chunk = carry_seg + BlockExclusiveScan<kPlanWarps>(nseg, &seg_all, sm_scan);
    if (nseg > 0 && !dry) {
      up.first_chunk = first_chunk;
      up.n_chunks = nseg;
      o_units[u] = up;
      // Portions within the group's fixed cost (shorter than it) hold no segment; their
      // CTAs' bound is the group's first segment.
      for (int32_t e = gl.empty0; e < gl.empty1; ++e) o_cta_first[e] = first_chunk;
    }
    // The batch's segments, one per thread in turn: segment i is segment j of the group of
    // thread L, the last whose segments start at or before i (a binary search over the
    // groups' segment counts in shared memory).
    sm_seg.incl[tid] = first_chunk - carry_seg + nseg;
    sm_seg.pf[tid] = gl.p_first | (gl.starts_here ? 0x10000 : 0);
    sm_seg.q0[tid] = gl.q0;
    sm_seg.work[tid] = work;
    sm_seg.sink_end[tid] = up.sink_end;
    sm_seg.band_lo[tid] = up.band_lo;
    sm_seg.band_end[tid] = up.band_end;
    __syncthreads();
    TL(if (tid == 0 && keys_on && first == 0) g_tl_plan_steps[2] = TlNow());
    for (int32_t i = tid; i < seg_all; i += NT) {
      int L = 0;
#pragma unroll
      for (int step = NT / 2; step > 0; step >>= 1) {
        if (sm_seg.incl[L + step - 1] <= i) L += step;
      }
      const int32_t j = i - (L > 0 ? sm_seg.incl[L - 1] : 0);
      const int32_t c = carry_seg + i;
      const int32_t lpf = sm_seg.pf[L], lq0 = sm_seg.q0[L], lwork = sm_seg.work[L];
      ChunkDesc d;
      d.u = first + L;
      SegmentTokens(j, S, lq0, lwork, &d.w0, &d.w1);
      d.sink_end = sm_seg.sink_end[L];
      d.band_lo = sm_seg.band_lo[L];
      d.band_end = sm_seg.band_end[L];
      d.b = d.u / a.hkv;
      d.h = d.u - d.b * a.hkv;
      if (!dry) {
        o_chunks[c] = d;
        if (j > 0 || (lpf >> 16)) o_cta_first[(lpf & 0xffff) + j] = c;
      }
    }
    __syncthreads();  // the batch's arrays are read before the next batch writes them
    TL(if (tid == 0 && keys_on && first == 0) g_tl_plan_steps[3] = TlNow());
    carry_cost += cost_all;
    carry_seg += seg_all;
  }
  if (dry) return;
  for (int k = int(n_cta) + tid; k <= kTargetChunks; k += NT) o_cta_first[k] = carry_seg;
  if (keys_on && tid == 0) {
    a.plan_info[0] = uint32_t(min(S * kChunkAlign, 0xffffffffll));
    a.plan_info[1] = uint32_t(carry_seg);
  }
}

// ---------------------------------------------------------------------------------------
// Match
// ---------------------------------------------------------------------------------------

// The 8-bit copy of this lane's kVec query values (reuse.h), the row spread over groups of
// LANES consecutive lanes (every group of the warp holds the same row): packed values
// (4 per word), the scale and the row's sum of squared values.
template <int LANES, int kVec>
struct LaneQuery8 {
  uint32_t v[(kVec + 3) / 4];
  float scale;
  int32_t sum_sq;
  __device__ __forceinline__ explicit LaneQuery8(const float (&x)[kVec]) {
    float amax = 0.f;
    bool finite = true;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      finite = finite && isfinite(x[i]);
      amax = fmaxf(amax, fabsf(x[i]));
    }
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      finite = __shfl_xor_sync(0xffffffffu, int(finite), o) != 0 && finite;
    }
    const QueryQuant qq = QueryQuantOf(amax, finite);
    scale = qq.scale;
    int32_t ss = 0;
#pragma unroll
    for (int w = 0; w < (kVec + 3) / 4; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int k = 0; k < 4 && 4 * w + k < kVec; ++k) {
        const int32_t r = QueryValue(x[4 * w + k], qq.inv);
        ss += r * r;
        word |= (uint32_t(r) & 0xffu) << (8 * k);
      }
      v[w] = word;
    }
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    sum_sq = ss;
  }
};

// Warp-wide: the 8-bit copy of a query row, kPer values per lane (lane l holds values
// l kPer ..), into ring row w of `ring` (the rows of the row's (slot, head): reuse.h's two
// nibble planes, W rows per 32-dim block), its scale and sum at `qs`. The lanes that hold dims
// 32 k + j (j < 16) write the bytes they share with dims 32 k + 16 + j, taken from the lane
// 16 / kPer above.
template <int kPer>
__device__ __forceinline__ void StoreRingQuery(int8_t* ring, int32_t W, int32_t w, MacQueryScale* qs,
                                               const float (&x)[kPer]) {
  static_assert(kPer == 2 || kPer == 4, "head dims 64 and 128");
  constexpr int kBlocks = 32 * kPer / kMacRingBlockDims;  // blocks per plane
  const int lane = threadIdx.x & 31;
  const LaneQuery8<32, kPer> q8(x);
  const uint32_t u = q8.v[0] ^ 0x80808080u;  // r + 128 per byte
  const uint32_t up = __shfl_down_sync(0xffffffffu, u, kMacRingBlock / kPer);
  const int c0 = lane * kPer, j = c0 % kMacRingBlockDims;
  if (j < kMacRingBlock) {
    const uint32_t hi = ((u >> 4) & 0x0f0f0f0fu) | (up & 0xf0f0f0f0u);
    const uint32_t lo = (u & 0x0f0f0f0fu) | ((up & 0x0f0f0f0fu) << 4);
    int8_t* dst = ring + (int64_t(c0 / kMacRingBlockDims) * W + w) * kMacRingBlock + j;
    int8_t* dst_lo = dst + int64_t(kBlocks) * W * kMacRingBlock;
    if (kPer == 4) {
      *reinterpret_cast<uint32_t*>(dst) = hi;
      *reinterpret_cast<uint32_t*>(dst_lo) = lo;
    } else {
      *reinterpret_cast<uint16_t*>(dst) = uint16_t(hi);
      *reinterpret_cast<uint16_t*>(dst_lo) = uint16_t(lo);
    }
  }
  if (lane == 0) *reinterpret_cast<int2*>(qs) = make_int2(__float_as_int(q8.scale), q8.sum_sq);
}

// sum over one 32-dim block of q_i n_i, n_i the nibbles of a plane's 16-byte block row `b`:
// its words' low nibbles are dims 0-15 of the block (query words qa), the high ones dims
// 16-31 (qb). Nibbles are 0 .. 15, so dp4a may take them as signed bytes.
__device__ __forceinline__ int32_t NibbleDot(const uint4 b, const uint32_t (&qa)[4], const uint32_t (&qb)[4],
                                             int32_t c) {
  const uint32_t w[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    c = __dp4a(int(w[t] & 0x0f0f0f0fu), int(qa[t]), c);
    c = __dp4a(int((w[t] >> 4) & 0x0f0f0f0fu), int(qb[t]), c);
  }
  return c;
}

// The same for both planes of a block row at once (the unfiltered match): the bytes u_i =
// 16 h_i + l_i put back together, so sum q_i u_i by dp4a of unsigned by signed bytes.
__device__ __forceinline__ int32_t Dp4aUS(uint32_t u, uint32_t q, int32_t c) {
  int32_t d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(u), "r"(q), "r"(c));
  return d;
}
__device__ __forceinline__ int32_t ByteDot(const uint4 h, const uint4 l, const uint32_t (&qa)[4],
                                           const uint32_t (&qb)[4], int32_t c) {
  const uint32_t wh[4] = {h.x, h.y, h.z, h.w}, wl[4] = {l.x, l.y, l.z, l.w};
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    c = Dp4aUS(((wh[t] & 0x0f0f0f0fu) << 4) | (wl[t] & 0x0f0f0f0fu), qa[t], c);
    c = Dp4aUS((wh[t] & 0xf0f0f0f0u) | ((wl[t] >> 4) & 0x0f0f0f0fu), qb[t], c);
  }
  return c;
}

// One candidate row per thread: the thread reads the row's 16-byte blocks of both nibble
// planes (a warp load covers one block of 32 consecutive rows: reuse.h's ring layout), its
// scale and tag, and sums the dot product with the whole 8-bit query (every lane holds it)
// by dp4a; no shuffles per row. UNROLL: rows per thread in flight. FILTER (rings of at least
// kMatchFilterBytes, where their bytes set the pace): the high plane first, and the low plane
// only of rows whose distance bound is under the threshold (reuse.h).
template <typename DType, int HEAD_DIM, int UNROLL, int MT, bool FILTER>
__global__ void __launch_bounds__(MT, MT == 64 ? 8 : 4) MacMatchKernel(const LaunchArgs a) {
  constexpr int kMatchWarps = MT / 32;
  constexpr int kVec = 16;                      // query values each lane quantizes
  constexpr int kQBlocks = HEAD_DIM / kVec;     // 16-dim query blocks: 8 or 4
  constexpr int kBlocks = HEAD_DIM / kMacRingBlockDims;  // ring blocks per plane: 4 or 2
  constexpr int kLanes = kQBlocks;              // lanes that quantize one copy of the query
  static_assert(kVec == kMacRingBlock, "a lane's query values are half a ring block");
  using P = Pack<DType>;
  TL(const unsigned long long tl0 = TlNow());
  GridLaunchDependents();  // the plan CTA may launch once every match CTA runs
  const MacParams& p = a.p;
  const int S = a.match_splits;
  const int cta = int(blockIdx.x);
  const int s = cta % S;
  const int bhq = cta / S;
  const int b = bhq / a.hq, hq = bhq % a.hq;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane % kLanes;
  __shared__ float sm_d[kMatchWarps];
  __shared__ int32_t sm_p[kMatchWarps];

  float bd = INFINITY;
  int32_t bp = -1;
  // The loads that depend on nothing go out together: T, the slot, the query.
  const int32_t T = p.seq_lens[b];
  const int32_t slot = SlotOfDev(p.slot_ids, b);
  const uint4* qsrc = reinterpret_cast<const uint4*>(static_cast<const DType*>(p.q_pre) + b * p.q_pre_stride_b +
                                                     hq * p.q_pre_stride_h + sub * kVec);
  const uint4 qa = __ldg(qsrc), qb = __ldg(qsrc + 1);
  if (a.enable && T > 0 && T >= a.min_context) {
    float qf[kVec];
    P::ToFloat(qa, qf);
    P::ToFloat(qb, qf + 8);
    const LaneQuery8<kLanes, kVec> q8(qf);  // every group of kLanes lanes holds the row
    uint32_t qw[kQBlocks][4];               // the whole row in every lane: block k from lane k
#pragma unroll
    for (int k = 0; k < kQBlocks; ++k) {
#pragma unroll
      for (int i = 0; i < 4; ++i) qw[k][i] = __shfl_sync(0xffffffffu, q8.v[i], k);
    }
    // sum q_i (the 128 of u = r + 128) and, for FILTER, the most the low nibbles can add:
    // 15 sum_{q_i > 0} q_i.
    int32_t q_sum = 0, q_pos = 0;
#pragma unroll
    for (int k = 0; k < kQBlocks; ++k) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        q_sum = __dp4a(int(qw[k][i]), 0x01010101, q_sum);
        if (FILTER) q_pos = __dp4a(int(__vmaxs4(qw[k][i], 0u)), 0x01010101, q_pos);
      }
    }
    const int32_t q_bias = 128 * q_sum;
    // The slot's epoch and ready flag are loaded alongside the first batch of ring rows (the
    // ring of any slot is readable); a slot that is not ready stops after that batch.
    const MacSlot st = p.slots[slot];
    const int32_t m = T - 1, W = a.window;
    const int32_t lo = max(0, m - W), n = m - lo;
    const int32_t x0 = lo + int32_t(int64_t(n) * s / S), x1 = lo + int32_t(int64_t(n) * (s + 1) / S);
    const int64_t sh = int64_t(slot) * a.hq + hq;
    // block k of plane l (0: high nibbles), row w: + (l kBlocks + k) W + w
    const uint4* ring = reinterpret_cast<const uint4*>(p.state.ring_q) + sh * 2 * kBlocks * W;
    const uint4* ring_lo = ring + int64_t(kBlocks) * W;
    const int2* scales = reinterpret_cast<const int2*>(p.state.ring_qs + sh * W);
    const MacTag* tags = p.state.ring_tag + int64_t(slot) * W;
    for (int32_t xb = x0 + tid; xb - tid < x1; xb += MT * UNROLL) {  // uniform over the CTA
      uint4 uh[UNROLL][kBlocks], ul[UNROLL][kBlocks];
      int2 sc[UNROLL];
      MacTag tg[UNROLL];
#pragma unroll
      for (int j = 0; j < UNROLL; ++j) {
        const int32_t x = xb + j * MT;
        if (x < x1) {
          const int32_t w = x % W;
#pragma unroll
          for (int k = 0; k < kBlocks; ++k) {
            uh[j][k] = __ldg(ring + int64_t(k) * W + w);
            if (!FILTER) ul[j][k] = __ldg(ring_lo + int64_t(k) * W + w);
          }
          sc[j] = __ldg(scales + w);
          tg[j] = tags[w];
        } else {
#pragma unroll
          for (int k = 0; k < kBlocks; ++k) uh[j][k] = ul[j][k] = make_uint4(0, 0, 0, 0);
          sc[j] = make_int2(0, 0);
          tg[j] = MacTag{-1, -1};
        }
      }
      if (!st.ready) break;  // uniform over the CTA
      int32_t ch[UNROLL];
      bool valid[UNROLL];
#pragma unroll
      for (int j = 0; j < UNROLL; ++j) {
        int32_t c = 0;
        if (FILTER) {
#pragma unroll
          for (int k = 0; k < kBlocks; ++k) c = NibbleDot(uh[j][k], qw[2 * k], qw[2 * k + 1], c);
          ch[j] = 16 * c - q_bias;
        } else {
#pragma unroll
          for (int k = 0; k < kBlocks; ++k) c = ByteDot(uh[j][k], ul[j][k], qw[2 * k], qw[2 * k + 1], c);
          ch[j] = c - q_bias;  // the whole dot product
        }
        const int32_t x = xb + j * MT;
        valid[j] = x < x1 && tg[j].position == x && tg[j].epoch == st.epoch;
        if (FILTER) {
          // No distance of the row is below the bound (reuse_common.h).
          const float bound = QueryDistanceBound(q8.scale, q8.sum_sq, __int_as_float(sc[j].x), sc[j].y, ch[j], q_pos);
          valid[j] = valid[j] && !(bound >= a.threshold);
          if (valid[j]) {
            const int32_t w = x % W;
#pragma unroll
            for (int k = 0; k < kBlocks; ++k) uh[j][k] = __ldg(ring_lo + int64_t(k) * W + w);  // in the high plane's place
          }
        }
      }
#pragma unroll
      for (int j = 0; j < UNROLL; ++j) {
        if (FILTER && !valid[j]) continue;
        int32_t c = ch[j];
        if (FILTER) {
#pragma unroll
          for (int k = 0; k < kBlocks; ++k) c = NibbleDot(uh[j][k], qw[2 * k], qw[2 * k + 1], c);
        }
        const float dist = QueryDistance(q8.scale, q8.sum_sq, __int_as_float(sc[j].x), sc[j].y, c);
        const int32_t x = xb + j * MT;
        if (valid[j] && Better(dist, x, bd, bp)) {
          bd = dist;
          bp = x;
        }
      }
    }
  }
  // Best over the warp's lanes, then over the warps.
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float d2 = __shfl_xor_sync(0xffffffffu, bd, o);
    const int32_t p2 = __shfl_xor_sync(0xffffffffu, bp, o);
    if (Better(d2, p2, bd, bp)) {
      bd = d2;
      bp = p2;
    }
  }
  if (lane == 0) {
    sm_d[warp] = bd;
    sm_p[warp] = bp;
  }
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < kMatchWarps; ++w) {
      if (Better(sm_d[w], sm_p[w], bd, bp)) {
        bd = sm_d[w];
        bp = sm_p[w];
      }
    }
    // No result needed: the plan kernel reads the keys once this grid is complete.
    if (bp >= 0) atomicMin(p.state.match_best + int64_t(slot) * a.hq + hq, CandidateKey(__float_as_uint(bd), bp));
    TL(if (TlCta()) { g_tl_match[blockIdx.x][0] = tl0; g_tl_match[blockIdx.x][1] = TlNow(); }
       if (blockIdx.x == 0) g_tl_grid[0] = gridDim.x);
  }
}

// The plan of the step, one CTA of NT threads (the smallest of 128, 256, 512, 1024 that
// holds a thread per group, LaunchMatch) launched with programmatic dependent launch after
// the match grid: resident while the match's last CTAs run, it loads its groups' T and
// slots, and starts planning once the grid is complete and its keys are visible
// (griddepcontrol.wait).
// kSpec: launched where LaunchArgs::spec is set (the speculative all-miss plan).
template <typename DType, int NT, bool kSpec>
__global__ void __launch_bounds__(NT) MacPlanKernel(const LaunchArgs a) {
  TL(if (threadIdx.x == 0) g_tl_plan[0] = TlNow());
  const int tid = int(threadIdx.x);
  const PlanInputs first = LoadPlanInputs(a, tid);  // inputs: before the wait
  // Where every head of the layer's last step missed (a guess: the batch may have changed),
  // the attend grid launches at once: its CTAs find their portions of the all-miss plan
  // themselves (FindSpecPortion) and stream them beside the match.
  const bool spec = kSpec && __ldcg(a.step_spec + 2) == 1u;
  if (spec) GridLaunchDependents();
  // Pass 0 (dry) while the match's last CTAs run where it takes long enough
  // (kPlanWarmHeads), then pass 1 after the wait. One loop body, not unrolled: the passes run
  // the same instructions.
#pragma unroll 1
  for (int pass = a.plan_dry ? 0 : 1; pass < 2; ++pass) {
    if (pass == 1) {
      TL(if (threadIdx.x == 0) g_tl_plan[3] = TlNow());
      GridDependencyWait();
      TL(if (threadIdx.x == 0) g_tl_plan[1] = TlNow());
      // The attend grid (a programmatic dependent with MacDecodeConfig::programmatic_launch)
      // may launch now: its CTAs come resident while the plan is made, once the match grid,
      // which they would crowd, is done; they wait for this grid before reading the plan.
      if (!spec) GridLaunchDependents();
    }
    PlanStep<NT, kSpec>(a, first, pass == 1 ? kPlanReal : kPlanDry, spec);
    __syncthreads();
  }
  TL(if (threadIdx.x == 0) g_tl_plan[2] = TlNow());
}

// ---------------------------------------------------------------------------------------
// Attend: a CTA's segments of its groups' KV for their G heads, on tensor cores
// ---------------------------------------------------------------------------------------

// Where a segment (MacFill: a chunk) is: request, KV head, work tokens [w0, w1) of its group (work index w is
// token w < sink_end ? w : w + gap), which tokens go to which state, the q offset
// (elements) of the group's first head, and the partial rows of head 0 of the two states
// (-1: not written).
//   band state (-> entry): head g's tokens in [band_start_g, band_end) (band_start_g >= band_lo);
//   output state:          tokens < sink_end or >= band_end (sink and tail), every head.
struct ChunkPos {
  int32_t b = 0, h = 0, w0 = 0, w1 = 0;
  int32_t sink_end = 0, gap = 0, band_lo = 0, band_end = 0;
  int64_t q_off = 0;
  int64_t row_band = -1, row_out = -1;
};

// Decode segment c of the plan, described by d. The plan makes every segment non-empty
// (w1 > w0: the MacPlan CPU tests); a CTA's cursors assume it.
__device__ __forceinline__ ChunkPos LocateDecodeChunk(const LaunchArgs& a, int c, const ChunkDesc& d, int group) {
  ChunkPos cp;
  cp.b = d.b;
  cp.h = d.h;
  cp.w0 = d.w0;
  cp.w1 = d.w1;
  cp.sink_end = d.sink_end;
  cp.gap = d.band_lo - d.sink_end;
  cp.band_lo = d.band_lo;
  cp.band_end = d.band_end;
  cp.q_off = cp.b * a.p.q_stride_b + int64_t(cp.h) * group * a.q_stride_h;
  cp.row_band = int64_t(c) * 2 * group;
  cp.row_out = cp.row_band + group;
  return cp;
}

// Fill chunk c: split c % S of (request, position, KV head) c / S; false if there is none.
// Every token of the chunk goes to the band state (the entry), for every head.
__device__ __forceinline__ bool LocateFillChunk(const LaunchArgs& a, int c, int group, ChunkPos* cp) {
  const MacFillParams& f = a.f;
  const int S = a.fill_splits, N = a.fill_n;
  const int unit = c / S, s = c % S;
  const int h = unit % a.hkv, bn = unit / a.hkv;
  const int n = bn % N, b = bn / N;
  const int32_t x = f.positions[int64_t(b) * N + n];
  if (x < 0 || x >= f.seq_lens[b]) return false;
  const int32_t lo = SinkEnd(a.front_sink, x), hi = EntryEnd(a.front_sink, a.band, x);
  const int32_t per = FillChunkTokens(hi - lo, S);
  const int32_t t0 = lo + s * per;
  if (t0 >= hi) return false;
  cp->b = b;
  cp->h = h;
  cp->w0 = t0;
  cp->w1 = min(hi, t0 + per);
  cp->sink_end = 0;
  cp->gap = 0;
  cp->band_lo = t0;
  cp->band_end = hi;
  cp->q_off = b * f.q_stride_b + n * f.q_stride_n + int64_t(h) * group * a.q_stride_h;
  cp->row_band = int64_t(c) * group;
  cp->row_out = -1;
  return true;
}

// Online-softmax state of one lane: heads 2 t4, 2 t4 + 1 (running max in base 2, partial
// sum over its tokens) and O^T[dims 16j + g (+8)][heads] in acc[j][0, 1] ([2, 3]).
template <int KSTEPS>
struct TcState {
  float m0, m1, l0, l1;
  float acc[KSTEPS][4];
  __device__ __forceinline__ void init() {
    m0 = m1 = -INFINITY;
    l0 = l1 = 0.f;
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
    }
  }
};

// Shared memory of an attention CTA (bytes from the start): the K/V tile stages, the page-id
// slots (AttnTile), then rings that carry a segment's inputs ahead of its tiles: its
// descriptor (kDescSlots), its heads' band starts and its G query rows (kQSlots; rows
// padded by 8 elements so that the lanes' fragment reads fall on distinct banks).
template <int HEAD_DIM, int GROUP>
struct SegSmem {
  using Cfg = decode::AttnTile<HEAD_DIM>;
  static constexpr int kDescSlots = 8;
  static constexpr int kQSlots = 6;
  static constexpr int kQStride = HEAD_DIM + 8;  // 16-bit elements per query row
  static constexpr size_t kDescs = Cfg::kBytes + Cfg::kPageBytes;
  static constexpr size_t kStarts = kDescs + kDescSlots * sizeof(ChunkDesc);
  static constexpr size_t kQ = kStarts + size_t(kQSlots) * 8 * sizeof(int32_t);
  static constexpr size_t kBytes = kQ + size_t(kQSlots) * GROUP * kQStride * 2;
  // Two CTAs per SM (1 KB reserved per CTA of the H200's 228 KB).
  static_assert(2 * (kBytes + 1024) <= 228 * 1024, "two attention CTAs per SM");
};

// The two normalized states of a finished segment into its partial rows: per-warp states
// staged in shared memory, one lse merge across the warps per (state, head), then the
// weighted sums. The staged rows go to a free tile stage (`stage`); the lse, the merge
// weights and the rows past the stage (G = 8 at d = 128: 2 of 64) to `spare`, the segment's
// query slot, whose values are in registers since the segment's first tile. A head's row
// is padded by 4 floats: a lane stores dims 16 j + g (+8) of heads 2 t4 and 2 t4 + 1, so
// unpadded rows put the four t4 of a store on one bank (2-way bank conflicts at G = 4,
// 4-way at G = 8; with the pad, rows 2 t4 start 8 t4 banks apart). Ends with both areas
// still being read: the caller's next barrier frees them.
template <int HEAD_DIM, int GROUP>
__device__ __forceinline__ void StoreSegmentStates(const LaunchArgs& a, int64_t row_band, int64_t row_out,
                                                   TcState<HEAD_DIM / 16>& sb, TcState<HEAD_DIM / 16>& so,
                                                   float* stage, float* spare) {
  constexpr int kKSteps = HEAD_DIM / 16;
  constexpr int kOStride = HEAD_DIM + 4;
  constexpr int kStageRows = int(size_t(2) * decode::AttnTile<HEAD_DIM>::kBlockN * HEAD_DIM * 2 / (kOStride * 4));
  constexpr int kRows = 2 * kWarps * GROUP;
  constexpr int kOver = kRows > kStageRows ? kRows - kStageRows : 0;
  static_assert((4 * kWarps * GROUP + kOver * kOStride) * 4 <= GROUP * SegSmem<HEAD_DIM, GROUP>::kQStride * 2,
                "the query slot holds the lse, the weights and the rows past the stage");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int hd0 = 2 * t4, hd1 = 2 * t4 + 1;
  float* sm_l = spare;                         // [2][kWarps][GROUP]
  float* sm_w = spare + 2 * kWarps * GROUP;    // [2][GROUP][kWarps]
  float* over = spare + 4 * kWarps * GROUP;    // rows kStageRows ..
  auto orow = [&](int k, int w, int hh) -> float* {
    const int r = (k * kWarps + w) * GROUP + hh;
    return r < kStageRows ? stage + r * kOStride : over + (r - kStageRows) * kOStride;
  };
  auto row_of = [&](int k) { return k == 0 ? row_band : row_out; };
  auto stage_state = [&](TcState<kKSteps>& st, int k) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      st.l0 += __shfl_xor_sync(0xffffffffu, st.l0, o);
      st.l1 += __shfl_xor_sync(0xffffffffu, st.l1, o);
    }
    const float inv0 = st.l0 > 0.f ? state_div(1.f, st.l0) : 0.f, inv1 = st.l1 > 0.f ? state_div(1.f, st.l1) : 0.f;
    const float lse0 = st.l0 > 0.f ? (st.m0 + decode::Log2Approx(st.l0)) * kLn2 : -INFINITY;
    const float lse1 = st.l1 > 0.f ? (st.m1 + decode::Log2Approx(st.l1)) * kLn2 : -INFINITY;
    float* r0 = orow(k, warp, hd0 < GROUP ? hd0 : 0);
    float* r1 = orow(k, warp, hd1 < GROUP ? hd1 : 0);
#pragma unroll
    for (int j = 0; j < kKSteps; ++j) {
      const int d0 = 16 * j + g;
      if (hd0 < GROUP) {
        r0[d0] = st.acc[j][0] * inv0;
        r0[d0 + 8] = st.acc[j][2] * inv0;
      }
      if (hd1 < GROUP) {
        r1[d0] = st.acc[j][1] * inv1;
        r1[d0 + 8] = st.acc[j][3] * inv1;
      }
    }
    if (g == 0) {
      if (hd0 < GROUP) sm_l[(k * kWarps + warp) * GROUP + hd0] = lse0;
      if (hd1 < GROUP) sm_l[(k * kWarps + warp) * GROUP + hd1] = lse1;
    }
  };
  if (row_band >= 0) stage_state(sb, 0);
  if (row_out >= 0) stage_state(so, 1);
  __syncthreads();
  TL(if (tid == 0 && !a.fill && TlCta()) g_tl_attend[blockIdx.x].t[6] = TlNow());
  // Thread k G kWarps + hh kWarps + w: state k, head hh, warp w's lse; a quad of lanes per
  // (state, head) merges them (decode::QuadLseSum), in warps 0 and 1 (G = 8: 64 entries).
  constexpr int kEntries = 2 * GROUP * kWarps;
  static_assert(kWarps == 4, "one quad of lanes per (state, head)");
  if (tid < (kEntries + 31) / 32 * 32) {
    const bool mine = tid < kEntries;
    const int k = mine ? tid / (GROUP * kWarps) : 0, hh = (tid / kWarps) % GROUP, w = tid % kWarps;
    const int64_t row = mine ? row_of(k) : -1;
    const float l = row >= 0 ? sm_l[(k * kWarps + w) * GROUP + hh] : -INFINITY;
    const LseSum sum = decode::QuadLseSum(lse_sum_add(lse_sum_empty(), l));
    if (row >= 0) {
      sm_w[(k * GROUP + hh) * kWarps + w] = lse_sum_weight(sum, l);
      if (w == 0) a.part_lse[row + hh] = lse_sum_lse(sum);
    }
  }
  __syncthreads();
  TL(if (tid == 0 && !a.fill && TlCta()) g_tl_attend[blockIdx.x].t[7] = TlNow());
  for (int e = tid * 4; e < 2 * GROUP * HEAD_DIM; e += kThreads * 4) {
    const int k = e / (GROUP * HEAD_DIM), hh = (e / HEAD_DIM) % GROUP, c = e % HEAD_DIM;
    const int64_t row = row_of(k);
    if (row < 0) continue;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = sm_w[(k * GROUP + hh) * kWarps + w];
      const float4 x = *reinterpret_cast<const float4*>(orow(k, w, hh) + c);
      o.x = fmaf(wt, x.x, o.x);
      o.y = fmaf(wt, x.y, o.y);
      o.z = fmaf(wt, x.z, o.z);
      o.w = fmaf(wt, x.w, o.w);
    }
    *reinterpret_cast<float4*>(&a.part_o[(row + hh) * HEAD_DIM + c]) = o;
  }
  TL(if (tid == 0 && !a.fill && TlCta()) g_tl_attend[blockIdx.x].t[8] = TlNow());
}

// The speculative all-miss plan, found by each attend CTA for itself (LaunchArgs::spec):
// the plan kernel's line (reuse_common.h) with every head a miss, so group u's work is its
// request's T tokens, [0, T), and its cost SegmentCost(T). PlanStep lays out the same line
// when the step misses everywhere, so the segments, their numbers (the partial rows) and
// the groups' first segments are the step's own.
//
// Warp 0 finds CTA k's portion: the groups' costs (a lane per group, 32 at a time), the
// portion size S and whether the line is aligned (reuse_common.h AlignedPortionBlocks), the
// groups' places and segment counts by warp scans, and CTA k's segments: those of the
// groups whose portions span k, consecutive in the numbering. The lane of each such group
// writes its segment's descriptor straight into the CTA's descriptor ring (`descs`,
// kSpecMaxSegs slots, none reused: AttendSegments then requests none), and the CTA's
// threads get the first segment's number and the count through shared memory (`scratch`:
// three words the CTA does not use before its pipeline's first barrier). The costs are
// summed at every step of the kSpec kernel, beside the load of the guess (step_spec[2]);
// the rest runs only where it is 1. The code is kept short (loops not unrolled, 32-bit
// divisions): code at the kernel's entry that a step jumps over costs it (session 23 bullet
// at the top of this file), and a step that does not speculate waits for the plan, which
// takes longer.
// Returns whether to speculate: the guess is 1, the line's cost fits 31 bits and the
// portion holds at most kSpecMaxSegs segments.
constexpr int kSpecMaxSegs = 8;  // SegSmem::kDescSlots
struct SpecPortion {
  int32_t c_begin = 0, n_seg = 0;
};
__device__ __forceinline__ bool FindSpecPortion(const LaunchArgs& a, int k, int32_t* scratch, ChunkDesc* descs,
                                                SpecPortion* out) {
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid < 32) {
    const uint32_t guess = lane == 0 ? __ldcg(a.step_spec + 2) : 0u;
    const int nu = a.batch * a.hkv;
    LineTally line;
#pragma unroll 1
    for (int u = lane; u < nu; u += 32) {
      const int32_t T = a.p.seq_lens[u / a.hkv];
      line.Add(int32_t(SegmentCost(T)), int32_t(WorkBlocks(T)));
    }
    line.WarpAll();
    long long total = line.total;
    const int32_t most = line.most, least = line.least, nw = line.nw;
    // PlanStep's line: aligned where the groups are long and of one cost.
    const int32_t sa = AlignedPortionBlocks(PortionBlocks(total, most), least, most + kSegmentFixedBlocks, nw);
    const int32_t aligned_cost = sa > 0 ? AlignedCost(least, sa) : 0;
    if (sa > 0) total = static_cast<long long>(aligned_cost) * nw;
    const bool fits = total < (1ll << 31);
    const bool speculate = __shfl_sync(0xffffffffu, guess, 0) == 1u;
    const uint32_t S = sa > 0 ? uint32_t(sa) : uint32_t(PortionBlocks(total, most));
    auto div_s = [&](long long x) -> long long { return static_cast<uint32_t>(x) / S; };
    uint32_t carry = 0;
    int32_t seg_carry = 0, c_begin = 0, n_seg = 0;
#pragma unroll 1
    for (int base = 0; fits && speculate && base < nu; base += 32) {
      const int u = base + lane;
      const int32_t T = u < nu ? a.p.seq_lens[u / a.hkv] : 0;
      uint32_t cost = uint32_t(SegmentCost(T));
      if (sa > 0 && cost > 0) cost = uint32_t(aligned_cost);
      const uint32_t incl = decode::WarpInclusiveSum(cost);
      const GroupLine gl = PlaceGroup(carry + incl - cost, T, S, div_s);
      const int32_t sincl = decode::WarpInclusiveSum(gl.nseg);
      const bool in = gl.nseg > 0 && gl.p_first <= k && k < gl.p_first + gl.nseg;
      const unsigned m = __ballot_sync(0xffffffffu, in);
      const int idx = n_seg + __popc(m & ((1u << lane) - 1u));
      if (in && idx < kSpecMaxSegs) {
        ChunkDesc d;
        d.u = u;
        SegmentTokens(k - gl.p_first, S, gl.q0, T, &d.w0, &d.w1);
        d.sink_end = SinkEnd(a.front_sink, T - 1);
        d.band_lo = d.sink_end;
        d.band_end = EntryEnd(a.front_sink, a.band, T - 1);
        d.b = u / a.hkv;
        d.h = u - d.b * a.hkv;
        descs[idx] = d;
        if (idx == 0) c_begin = seg_carry + sincl - gl.nseg + k - gl.p_first;
      }
      n_seg += __popc(m);
      carry += __shfl_sync(0xffffffffu, incl, 31);
      seg_carry += __shfl_sync(0xffffffffu, sincl, 31);
    }
    c_begin = __reduce_max_sync(0xffffffffu, c_begin);  // the one lane that set it (0 elsewhere)
    if (lane == 0) {
      scratch[0] = c_begin;
      scratch[1] = n_seg;
      scratch[2] = fits && speculate && n_seg <= kSpecMaxSegs;
    }
  }
  __syncthreads();
  out->c_begin = scratch[0];
  out->n_seg = scratch[1];
  return scratch[2] != 0;
}

// Exact attention of the group's heads over a CTA's segments, streamed back to back: decode
// attention's tensor-core CTA (decode_kernels.cuh AttentionBlock: 64- (d 128) or 128-token
// (d 64) K/V tiles through a 3-stage cp.async pipeline with swizzled rows, S^T = K Q^T and
// O^T += V^T P^T with mma m16n8k16, P as hi + lo 16-bit terms) with two states per lane:
// each 16-token piece of a warp updates the band state and / or the output state, masking
// per head the tokens that are not theirs (a piece that lies wholly in one state skips the
// other). Each segment ends with both normalized states written to its partial rows.
//
// The tiles of all segments form one sequence through the pipeline: while a segment's last
// tiles are scored and its states written, the next segment's page ids and first tiles are
// already in flight, so a CTA pays the pipeline's fill once, not once per segment. Three
// cursors walk the sequence: the consumer (tile f), the data copies (f + 2) and the page-id
// copies (f + 4). When the page-id cursor enters segment s, it requests s's band starts and
// query rows and the descriptor of segment s + 2; each lands, in the copy group of that
// step, two steps before its first use (the ring sizes keep every slot until its last
// reader is past a barrier).
//
// kFill: one segment, `fill_cp`, no band starts (every head's band starts at band_lo).
// Otherwise segments c0 .. c0 + n_seg - 1 of the plan (ChunkDesc, LocateDecodeChunk) in
// `chunks`, their heads' band starts in `heads`.
// spec: the segments are the speculative all-miss plan's (LaunchArgs::spec); with `gen`
// their descriptors are in the ring already (FindSpecPortion) and their heads' band starts
// are band_lo. The plan CTA's verdict is polled every kSpecPollTiles tiles (thread 0 loads
// it, the tile barrier that many tiles on shares it: a load from L2 while every CTA streams
// can take longer than a tile, and a poll read at the next tile held each tile back:
// all-miss 7-25% slower), and before the first partial write this CTA waits for the plan
// grid and reads it once more. A poll may see an earlier step's word or a test's marker
// (neither 1 nor 2); after the wait the word is this step's. The earlier word is the one
// written with the guess the CTA read, except where the CTA read a guess this step's plan
// had just written (its plan did not speculate, the step missed everywhere): a poll may
// then see the earlier 2 and drop work the step would have kept, which costs time only.
// On 2 at a poll, or any verdict but 1 after the wait, it drains its copies and returns
// true, having written nothing; on 1 it lets its dependents launch and goes on as with the
// step's own plan (the same plan).
constexpr int kSpecPollTiles = 8;
template <typename DType, int HEAD_DIM, int GROUP, bool kFill>
__device__ __forceinline__ bool AttendSegments(const LaunchArgs& a, const ChunkDesc* chunks, const HeadDecision* heads,
                                               int c0, int n_seg, const ChunkPos& fill_cp, char* smem, bool spec,
                                               bool gen = false) {
  using Cfg = decode::AttnTile<HEAD_DIM>;
  using Sm = SegSmem<HEAD_DIM, GROUP>;
  using P = Pack<DType>;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kStages = Cfg::kStages;
  constexpr int kRowChunks = HEAD_DIM / 8;  // 16-byte chunks per token row
  constexpr int kKSteps = HEAD_DIM / 16;    // QK k-steps = PV dim tiles
  constexpr int kWarpTokens = kBlockN / kWarps;
  constexpr int kSub = kWarpTokens / 16;
  constexpr int kTile = kBlockN * HEAD_DIM;  // elements of one K (or V) stage tile
  constexpr int kLoads = kBlockN * kRowChunks / kThreads;
  constexpr int kPageSlots = Cfg::kPageSlots;
  static_assert(kLoads * kThreads == kBlockN * kRowChunks, "tile chunks must split evenly");
  static_assert(GROUP >= 1 && GROUP <= 8, "group size");
  const uint64_t kv_pol = decode::KvCopyPolicy(a.kv_evict_first);
  static_assert(kBlockN <= kThreads, "one thread per row copies the tile's page ids");
  static_assert(kStages == 3 && kPageSlots == 4, "the cursors' distances below");

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int hd0 = 2 * t4, hd1 = 2 * t4 + 1;
  DType* tiles = reinterpret_cast<DType*>(smem);
  int32_t* pg = reinterpret_cast<int32_t*>(smem + Cfg::kBytes);
  ChunkDesc* descs = reinterpret_cast<ChunkDesc*>(smem + Sm::kDescs);
  int32_t* starts = reinterpret_cast<int32_t*>(smem + Sm::kStarts);  // [kQSlots][8]
  DType* qs = reinterpret_cast<DType*>(smem + Sm::kQ);               // [kQSlots][GROUP][kQStride]
  const int shift = a.page_shift;
  const int slot_mask = (1 << shift) - 1;
  // This thread's KV copies (issue_tile below), placed and addressed as the decode
  // attention's (decode::KvTileCopy).
  using Copy = decode::KvTileCopy<DType, HEAD_DIM>;
  constexpr int kRowStep = Copy::kRowStep;  // tokens between a thread's rows
  static_assert(Copy::kLoads == kLoads, "the decode attention's tile");
  const int row0 = int(unsigned(tid) / kRowChunks);
  const uint32_t piece_off = (unsigned(tid) % kRowChunks) * 8;
  const int sw0 = Copy::Place0(row0, int(piece_off >> 3));
  const uint32_t kv_sp = uint32_t(a.kv_stride_page), kv_st = uint32_t(a.kv_stride_token);

  auto pos_of = [&](int s) -> ChunkPos {
    if constexpr (kFill) {
      return fill_cp;
    } else {
      return LocateDecodeChunk(a, c0 + s, descs[s % Sm::kDescSlots], GROUP);
    }
  };
  auto tiles_of = [&](const ChunkPos& cp) { return (cp.w1 - cp.w0 + kBlockN - 1) / kBlockN; };
  auto request_desc = [&](int s) {
    if constexpr (!kFill) {
      if (gen) return;  // every descriptor is in the ring (FindSpecPortion)
      if (s < n_seg && tid < 2) {
        CpAsync16(reinterpret_cast<int4*>(descs + s % Sm::kDescSlots) + tid,
                  reinterpret_cast<const int4*>(chunks + c0 + s) + tid, true);
      }
    }
  };
  // Segment s's query rows (4-byte copies: a row's offset is only known to be even) and its
  // heads' band starts, into slot s % kQSlots.
  auto request_inputs = [&](int s, const ChunkPos& cp) {
    constexpr int kWords = HEAD_DIM / 2;
    DType* qd = qs + (s % Sm::kQSlots) * GROUP * Sm::kQStride;
    const DType* qsrc = static_cast<const DType*>(a.q) + cp.q_off;
    for (int i = tid; i < GROUP * kWords; i += kThreads) {
      const int hh = i / kWords, wd = i % kWords;
      CpAsync4(qd + hh * Sm::kQStride + 2 * wd, qsrc + int64_t(hh) * a.q_stride_h + 2 * wd);
    }
    if constexpr (!kFill) {
      if (tid < GROUP) {
        if (gen) {  // every head a miss: its band starts at the sink's end
          starts[(s % Sm::kQSlots) * 8 + tid] = cp.band_lo;
        } else {
          CpAsync4(starts + (s % Sm::kQSlots) * 8 + tid, &heads[cp.b * a.hq + cp.h * GROUP + tid].band_start);
        }
      }
    }
  };

  // What a copy cursor needs of its segment, set when it enters one (a descriptor read and
  // a few products once per segment, not per tile).
  struct Src {
    const int32_t* bt;  // the request's block-table row
    int64_t kv;         // the KV head's offset in the caches
    int32_t w0, w1, sink_end, gap, n;
  };
  auto src_of = [&](int s) {
    const ChunkPos cp = pos_of(s);
    Src r;
    r.bt = a.block_table + cp.b * a.bt_stride;
    r.kv = cp.h * a.kv_stride_head;
    r.w0 = cp.w0;
    r.w1 = cp.w1;
    r.sink_end = cp.sink_end;
    r.gap = cp.gap;
    r.n = tiles_of(cp);
    return r;
  };
  // Page-id cursor: tile pf of the sequence, tile pt of segment ps. When it enters a segment
  // it requests the segment's inputs and the descriptor two segments on.
  int pf = 0, ps = 0, pt = 0;
  Src psrc{};
  auto fetch_pages = [&]() {
    if (ps >= n_seg) return;
    if (pt == 0) {
      psrc = src_of(ps);
      request_inputs(ps, pos_of(ps));
      request_desc(ps + 2);
    }
    if (tid < kBlockN) {
      const int w = psrc.w0 + pt * kBlockN + tid;
      if (w < psrc.w1) {
        const int32_t t = w < psrc.sink_end ? w : w + psrc.gap;
        CpAsync4(pg + (pf % kPageSlots) * kBlockN + tid, psrc.bt + (t >> shift));
      }
    }
    ++pf;
    if (++pt == psrc.n) {
      ++ps;
      pt = 0;
    }
  };
  // Data cursor: tile df of the sequence, tile dt of segment ds. A tile's page ids came in
  // the copy group of the tile kStages - 1 before it: the wait for that tile covers them,
  // and no global load sits between a barrier and a tile's copies. (ncu, B = 32 all-hit:
  // with the ids loaded into registers one step ahead, a fifth of the warps' stall samples
  // waited for them there.)
  int df = 0, ds = 0, dt = 0;
  Src dsrc{};
  auto issue_tile = [&]() {
    if (ds < n_seg) {
      if (dt == 0) dsrc = src_of(ds);
      DType* kt = tiles + (df % kStages) * 2 * kTile;
      DType* vt = kt + kTile;
      const int32_t* tp = pg + (df % kPageSlots) * kBlockN;
      const DType* kb = static_cast<const DType*>(a.k) + dsrc.kv;
      const DType* vb = static_cast<const DType*>(a.v) + dsrc.kv;
      // Thread x copies piece x % kRowChunks of rows r0 + i kRowStep (r0 = x / kRowChunks):
      // one swizzle phase for all of them, so a row's place is sw0 plus a constant. Offsets
      // from 32-bit products (CheckKv bounds the strides), without a branch: a row past the
      // segment takes page 0 and its copy reads nothing.
      const int wr = dsrc.w0 + dt * kBlockN + row0;
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int w = wr + i * kRowStep;
        const bool valid = w < dsrc.w1;
        const int32_t t = w < dsrc.sink_end ? w : w + dsrc.gap;
        const uint32_t page = valid ? uint32_t(tp[row0 + i * kRowStep]) : 0u;
        const uint64_t off = Copy::Offset(page, uint32_t(t & slot_mask), kv_sp, kv_st, piece_off);
        const int sw = sw0 + i * kRowStep * HEAD_DIM;
        decode::CpAsync16Policy(kt + sw, kb + off, valid, kv_pol);
        decode::CpAsync16Policy(vt + sw, vb + off, valid, kv_pol);
      }
      ++df;
      if (++dt == dsrc.n) {
        ++ds;
        dt = 0;
      }
    }
    fetch_pages();
    CpAsyncCommit();  // one group per step, empty ones too, so the wait count is uniform
  };
  // One 16-token piece's scores (rows g, g + 8; heads hd0, hd1) into state st.
  auto update = [&](TcState<kKSteps>& st, const float (&s)[4], const DType* vt, int r0) {
    float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
    }
    const float mn0 = fmaxf(st.m0, mx0), mn1 = fmaxf(st.m1, mx1);
    const float ms0 = mn0 == -INFINITY ? 0.f : mn0;  // nothing seen yet: all weights 0
    const float ms1 = mn1 == -INFINITY ? 0.f : mn1;
    const float c0f = decode::Exp2Approx(st.m0 - ms0), c1f = decode::Exp2Approx(st.m1 - ms1);
    st.m0 = mn0;
    st.m1 = mn1;
    const float p0 = decode::Exp2Approx(s[0] - ms0), p1 = decode::Exp2Approx(s[1] - ms1);
    const float p2 = decode::Exp2Approx(s[2] - ms0), p3 = decode::Exp2Approx(s[3] - ms1);
    st.l0 = st.l0 * c0f + p0 + p2;
    st.l1 = st.l1 * c1f + p1 + p3;
#pragma unroll
    for (int j = 0; j < kKSteps; ++j) {
      st.acc[j][0] *= c0f;
      st.acc[j][1] *= c1f;
      st.acc[j][2] *= c0f;
      st.acc[j][3] *= c1f;
    }
    // P^T for the PV product: (token g, heads 2t4, 2t4+1) -> transpose -> (head g, tokens).
    const uint32_t h01 = P::FromFloat2(p0, p1), h23 = P::FromFloat2(p2, p3);
    float f0, f1, f2, f3;
    P::ToFloat2(h01, f0, f1);
    P::ToFloat2(h23, f2, f3);
    const uint32_t lo01 = P::FromFloat2(p0 - f0, p1 - f1), lo23 = P::FromFloat2(p2 - f2, p3 - f3);
    const uint32_t bh0 = decode::MovTrans(h01), bh1 = decode::MovTrans(h23);
    const uint32_t bl0 = decode::MovTrans(lo01), bl1 = decode::MovTrans(lo23);
#pragma unroll
    for (int j = 0; j < kKSteps; ++j) {
      const int row = r0 + (lane & 7) + ((lane >> 4) << 3);
      const int chunk = 2 * j + ((lane >> 3) & 1);
      uint32_t vf[4];
      decode::Ldsm4T(vf, vt + row * HEAD_DIM + ((chunk ^ (row & 7)) << 3));
      decode::Mma16816<DType>(st.acc[j], vf, bh0, bh1);
      decode::Mma16816<DType>(st.acc[j], vf, bl0, bl1);
    }
  };

  // Prologue: the first two descriptors, then the first kStages - 1 tiles' page ids (and
  // the inputs of the segments they enter) in a group of their own, then their tiles.
  request_desc(0);
  request_desc(1);
  CpAsyncCommit();
  CpAsyncWait<0>();
  __syncthreads();
  TL(if (tid == 0 && !a.fill && TlCta()) g_tl_attend[blockIdx.x].t[2] = TlNow());
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) fetch_pages();
  CpAsyncCommit();
  CpAsyncWait<0>();
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue_tile();

  // Consumer: tile ct of cn of segment cs, the sequence's tile f.
  TcState<kKSteps> sb, so;  // band state, output state
  uint32_t qf[kKSteps][2];  // Q^T as the B operand: column g = query head h*G + g (zero past the group)
  int32_t w0 = 0, w1 = 0, sink_end = 0, gap = 0, band_lo = 0, band_end = 0, lo0 = 0, lo1 = 0;
  int f = 0, cs = 0, ct = 0, cn = 0;
  uint32_t verdict = 0;  // thread 0's last poll (spec)
  TL(int tl_tokens = 0);
  while (cs < n_seg) {
    CpAsyncWait<kStages - 2>();  // this thread's copies of tile f have landed
    if (!spec || f % kSpecPollTiles != 0) {
      __syncthreads();  // everyone's have; the stage of tile f - 1 is free again
    } else {
      if (__syncthreads_or(tid == 0 && verdict == 2u)) {  // the same barrier, and the poll
        CpAsyncWait<0>();
        __syncthreads();
        return true;
      }
      if (tid == 0) verdict = RelaxedLoad(a.step_spec + 1);  // read kSpecPollTiles tiles on
    }
    TL(if (f == 0 && tid == 0 && !a.fill && TlCta()) g_tl_attend[blockIdx.x].t[3] = TlNow());
    issue_tile();
    if (ct == 0) {  // the segment's ranges, query fragments and band starts; fresh states
      const ChunkPos cp = pos_of(cs);
      cn = tiles_of(cp);
      w0 = cp.w0;
      w1 = cp.w1;
      sink_end = cp.sink_end;
      gap = cp.gap;
      band_lo = cp.band_lo;
      band_end = cp.band_end;
      TL(tl_tokens += w1 - w0);
      const int slot = cs % Sm::kQSlots;
      const uint32_t* qrow =
          reinterpret_cast<const uint32_t*>(qs + (slot * GROUP + (g < GROUP ? g : 0)) * Sm::kQStride) + t4;
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        qf[ks][0] = g < GROUP ? qrow[8 * ks] : 0u;
        qf[ks][1] = g < GROUP ? qrow[8 * ks + 4] : 0u;
      }
      // Band starts of this lane's heads (heads past the group take no band tokens).
      if constexpr (kFill) {
        lo0 = hd0 < GROUP ? band_lo : band_end;
        lo1 = hd1 < GROUP ? band_lo : band_end;
      } else {
        lo0 = hd0 < GROUP ? starts[slot * 8 + hd0] : band_end;
        lo1 = hd1 < GROUP ? starts[slot * 8 + hd1] : band_end;
      }
      sb.init();
      so.init();
    }
    auto token = [&](int w) { return w < sink_end ? w : w + gap; };
    const DType* kt = tiles + (f % kStages) * 2 * kTile;
    const DType* vt = kt + kTile;
#pragma unroll
    for (int sub = 0; sub < kSub; ++sub) {
      const int r0 = warp * kWarpTokens + sub * 16;
      const int ws = w0 + ct * kBlockN + r0;  // the piece's first work index (warp-uniform)
      if (ws >= w1) continue;
      // Which states the piece can touch (warp-uniform; token() is increasing).
      const int tmin = token(ws), tmax = token(min(ws + 15, w1 - 1));
      const bool need_band = tmax >= band_lo && tmin < band_end;
      const bool need_out = tmin < sink_end || tmax >= band_end;
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        const int row = r0 + (lane & 7) + (((lane >> 3) & 1) << 3);
        const int chunk = 2 * ks + (lane >> 4);
        uint32_t af[4];
        decode::Ldsm4(af, kt + row * HEAD_DIM + ((chunk ^ (row & 7)) << 3));
        decode::Mma16816<DType>(s, af, qf[ks][0], qf[ks][1]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) s[i] *= a.scale_log2;
      const bool va = ws + g < w1, vb8 = ws + g + 8 < w1;
      const int ta = token(ws + g), tb = token(ws + g + 8);
      const bool oa = va && (ta < sink_end || ta >= band_end), ob = vb8 && (tb < sink_end || tb >= band_end);
      if (need_band) {
        float sb4[4];
        sb4[0] = va && ta >= lo0 && ta < band_end ? s[0] : -INFINITY;
        sb4[1] = va && ta >= lo1 && ta < band_end ? s[1] : -INFINITY;
        sb4[2] = vb8 && tb >= lo0 && tb < band_end ? s[2] : -INFINITY;
        sb4[3] = vb8 && tb >= lo1 && tb < band_end ? s[3] : -INFINITY;
        update(sb, sb4, vt, r0);
      }
      if (need_out) {
        float so4[4];
        so4[0] = oa ? s[0] : -INFINITY;
        so4[1] = oa ? s[1] : -INFINITY;
        so4[2] = ob ? s[2] : -INFINITY;
        so4[3] = ob ? s[3] : -INFINITY;
        update(so, so4, vt, r0);
      }
    }
    if (ct == cn - 1) {  // the segment's last tile: its states into its partial rows
      TL(const bool tl_seg0 = cs == 0 && n_seg > 1 && tid == 0 && !a.fill && TlCta());
      TL(if (tl_seg0) g_tl_seg0[blockIdx.x][0] = TlNow());
      if constexpr (!kFill) {
        if (spec) {  // the plan is made: keep this work only if it is the step's plan
          GridDependencyWait();
          if (__ldcg(a.step_spec + 1) != 1u) {
            CpAsyncWait<0>();
            __syncthreads();
            return true;
          }
          GridLaunchDependents();
          spec = false;
        }
      }
      TL(if (tl_seg0) g_tl_seg0[blockIdx.x][1] = TlNow());
      __syncthreads();   // every warp is done with tile f's stage, which stages the states
      TL(if (cs == n_seg - 1 && tid == 0 && !a.fill && TlCta()) g_tl_attend[blockIdx.x].t[4] = TlNow());
      const ChunkPos cp = pos_of(cs);
      StoreSegmentStates<HEAD_DIM, GROUP>(
          a, cp.row_band, cp.row_out, sb, so, reinterpret_cast<float*>(tiles + (f % kStages) * 2 * kTile),
          reinterpret_cast<float*>(qs + (cs % Sm::kQSlots) * GROUP * Sm::kQStride));
      TL(if (tl_seg0) {
        g_tl_seg0[blockIdx.x][2] = TlNow();
        g_tl_seg0[blockIdx.x][3] = g_tl_attend[blockIdx.x].t[6];  // this epilogue's stamps
        g_tl_seg0[blockIdx.x][4] = g_tl_attend[blockIdx.x].t[7];
      });
      if constexpr (!kFill) {
        // The segment's partial rows are written: one release per segment on its group's
        // count, which the group's combine CTAs wait for instead of the whole grid.
        if (a.group_wait) {
          __syncthreads();
          if (tid == 0) ReleaseAdd(a.group_done + cp.b * a.hkv + cp.h, 1);
        }
      }
      ++cs;
      ct = 0;
    } else {
      ++ct;
    }
    ++f;
  }
  TL(if (tid == 0 && !a.fill && TlCta()) { g_tl_attend[blockIdx.x].tiles = f; g_tl_attend[blockIdx.x].tokens = tl_tokens; });
  return false;
}

// Two CTAs per SM (97 KB of tiles and page ids and up to 13 KB of segment inputs each at
// d = 128), as decode attention's kernel: the register budget (up to 255 per thread) holds
// both states without spilling.
constexpr int kAttendMinBlocks = 2;

// MacFill: one chunk per CTA.
template <typename DType, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(kThreads, kAttendMinBlocks) MacFillAttendKernel(const LaunchArgs a) {
  extern __shared__ float4 mac_smem[];
  ChunkPos cp;
  if (!LocateFillChunk(a, int(blockIdx.x), GROUP, &cp)) return;
  AttendSegments<DType, HEAD_DIM, GROUP, true>(a, nullptr, nullptr, 0, 1, cp, reinterpret_cast<char*>(mac_smem), false);
}

// Decode: CTA k streams the plan's segments cta_first[k] .. cta_first[k + 1] - 1 (the plan
// writes all kTargetChunks + 1 bounds; the CTAs past its portions have none and exit).
// kSpec (launched where LaunchArgs::spec is set; without it none of this kernel's code
// speculates): where the layer's last step missed everywhere, the CTA finds its portion of
// the all-miss plan (FindSpecPortion) and streams it at once; if the step's plan turns out
// different, it takes its portion of that one instead, having written nothing.
template <typename DType, int HEAD_DIM, int GROUP, bool kSpec>
__global__ void __launch_bounds__(kThreads, kAttendMinBlocks) MacAttendKernel(const LaunchArgs a) {
  // The tiles' base: no more static __shared__ in this kernel, which would move it (session
  // 25 bullet at the top of this file).
  extern __shared__ float4 mac_smem[];
  TL(const unsigned long long tl0 = TlNow());
  TL(if (threadIdx.x == 0 && TlCta()) { g_tl_attend[blockIdx.x].t[0] = tl0; g_tl_attend[blockIdx.x].chunk = -1;
                             g_tl_attend[blockIdx.x].sm = TlSm(); if (blockIdx.x == 0) g_tl_grid[1] = gridDim.x;
                             g_tl_seg0[blockIdx.x][0] = 0; });
  const int k = int(blockIdx.x);
  bool spec = false;
  SpecPortion sp;
  if constexpr (kSpec) {
    // The page-id ring is first written after AttendSegments' first barrier.
    using Sm = SegSmem<HEAD_DIM, GROUP>;
    static_assert(Sm::kDescSlots >= kSpecMaxSegs, "the speculative portion's descriptors fit the ring");
    char* smem = reinterpret_cast<char*>(mac_smem);
    spec = FindSpecPortion(a, k, reinterpret_cast<int32_t*>(smem + Sm::Cfg::kBytes),
                           reinterpret_cast<ChunkDesc*>(smem + Sm::kDescs), &sp);
  }
  if (!spec) {
    GridDependencyWait();  // the plan is complete and visible
    GridLaunchDependents();
  }
  TL(if (threadIdx.x == 0 && TlCta()) g_tl_attend[blockIdx.x].t[1] = TlNow());
#pragma unroll 1
  for (;;) {
    int c_begin = sp.c_begin, c_end = sp.c_begin + sp.n_seg;
    if (!spec) {
      c_begin = __ldcg(a.cta_first + k);  // the plan grid's: not __ldg
      c_end = __ldcg(a.cta_first + k + 1);
    }
    if (c_end > c_begin) {
      TL(if (threadIdx.x == 0 && TlCta()) g_tl_attend[blockIdx.x].chunk = c_begin);
      if (!AttendSegments<DType, HEAD_DIM, GROUP, false>(a, a.chunks, a.heads, c_begin, c_end - c_begin, ChunkPos{},
                                                         reinterpret_cast<char*>(mac_smem), spec, spec)) {
        break;
      }
    } else if (!spec) {
      break;
    } else {
      GridDependencyWait();
      if (__ldcg(a.step_spec + 1) == 1u) break;  // no portion in the step's plan either
    }
    // The step's plan is not the speculative one: this CTA's portion of it.
    GridDependencyWait();
    GridLaunchDependents();
    spec = false;
  }
  TL(if (threadIdx.x == 0 && TlCta()) g_tl_attend[blockIdx.x].t[5] = TlNow());
}

// ---------------------------------------------------------------------------------------
// Combine
// ---------------------------------------------------------------------------------------

// LoadRow, and one float; with CG through L2 (ld.global.cg): what another grid wrote while
// this one runs (the per-group combine wait).
template <int kPer, bool CG>
__device__ __forceinline__ void LoadRowAny(const float* src, float* dst) {
  if constexpr (!CG) {
    LoadRow<kPer>(src, dst);
  } else if constexpr (kPer == 4) {
    const float4 x = __ldcg(reinterpret_cast<const float4*>(src));
    dst[0] = x.x; dst[1] = x.y; dst[2] = x.z; dst[3] = x.w;
  } else {
    const float2 x = __ldcg(reinterpret_cast<const float2*>(src));
    dst[0] = x.x; dst[1] = x.y;
  }
}
template <bool CG>
__device__ __forceinline__ float LoadF(const float* p) {
  if constexpr (CG) {
    return __ldcg(p);
  } else {
    return *p;
  }
}

// Lane-held state of kPer dims.
template <int kPer>
struct LaneState {
  float o[kPer];
  float lse;
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < kPer; ++i) o[i] = 0.f;
    lse = -INFINITY;
  }
  __device__ __forceinline__ void merge(const float* o2, float l2) { merge_state_inplace(o, &lse, o2, l2, kPer); }
};

// Cross-warp merge of two lane states per warp through shared memory; warp 0 ends with the
// merged states. sm_o: [2][kWarps][HEAD_DIM], sm_l: [2][kWarps].
template <int HEAD_DIM, int kPer>
__device__ __forceinline__ void MergeWarps(LaneState<kPer>* st, float* sm_o, float* sm_l) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    StoreRow<kPer>(sm_o + (k * kWarps + warp) * HEAD_DIM + lane * kPer, st[k].o);
    if (lane == 0) sm_l[k * kWarps + warp] = st[k].lse;
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      float o2[kPer];
      LoadRow<kPer>(sm_o + (k * kWarps + w) * HEAD_DIM + lane * kPer, o2);
      st[k].merge(o2, sm_l[k * kWarps + w]);
    }
  }
}

// tot[second], field by field (an indexed pick puts the pair on the stack).
__device__ __forceinline__ LseSum PickSum(const LseSum (&tot)[2], bool second) {
  LseSum t;
  t.max = second ? tot[1].max : tot[0].max;
  t.sum = second ? tot[1].sum : tot[0].sum;
  t.inf = second ? tot[1].inf : tot[0].inf;
  return t;
}

// The N-way merge of a head's partial rows, spread over the CTA: the rows' lse first (one
// or two per thread: at most 2 kMaxGroupChunks rows), the two states' LseSum (state.cuh)
// from them, then the rows of nonzero weight, compacted, loaded BATCH per warp at a time and
// summed with their weights (no merge waits on the one before). Per segment j of the group
// the band row is 2 j and the sink-and-tail row 2 j + 1. Warp 0 ends with both states.
// Eager (EBATCH > 0): when the head has at most kWarps EBATCH rows, warp w loads rows w,
// w + kWarps, ... (o and lse) together with the lse of the whole set, in one round trip,
// and weighs them once the sums are known: no compaction and no second round trip (B = 1
// all-hit: about a dozen rows per head; a group of one segment: two rows). Grids of one
// wave take EBATCH = BATCH; grids bounded to 64 registers EBATCH = 1 (groups of up to two
// segments: at BATCH it spilled).
// Staged (STAGE > 0, `stage` non-null): a head of more than the eager rows and at most STAGE
// rows has all of them copied into `stage` (shared memory, STAGE x HEAD_DIM floats) by
// cp.async, issued with the lse loads: one round trip for every row, then each warp weighs
// rows warp, warp + kWarps, ... from shared memory (rows of zero weight are skipped).
static_assert(2 * kMaxGroupChunks <= 2 * kThreads, "two partial rows per thread");
template <int HEAD_DIM, int kPer, int BATCH, int EBATCH, bool CG, int STAGE = 0>
__device__ __forceinline__ void MergePartials(const float* part_o, const float* part_lse, int64_t row0, int n_all,
                                              int group, int g, LaneState<kPer>* st, float* stage = nullptr) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c0 = lane * kPer;
  __shared__ float sm_w[2 * kThreads];
  __shared__ int32_t sm_j[2 * kThreads];
  __shared__ LseSum sm_sum[kWarps][2];
  __shared__ int32_t sm_scan[kWarps];
  __shared__ __align__(16) float sm_o[kWarps][2][HEAD_DIM];
  // Rows tid and tid + kThreads: both of state tid & 1 (kThreads is even).
  const float l0 = tid < n_all ? LoadF<CG>(part_lse + (row0 + tid) * group + g) : -INFINITY;
  const float l1 = tid + kThreads < n_all ? LoadF<CG>(part_lse + (row0 + tid + kThreads) * group + g) : -INFINITY;
  constexpr bool kEager = EBATCH > 0;
  const bool eager = kEager && n_all <= kWarps * EBATCH;  // uniform over the CTA
  const bool staged = STAGE > 0 && stage != nullptr && !eager && n_all <= STAGE;
  if constexpr (STAGE > 0) {
    if (staged) {
      constexpr int kChunks = HEAD_DIM / 4;  // 16-byte pieces per row
      for (int i = tid; i < n_all * kChunks; i += kThreads) {
        const int r = i / kChunks, c = i - r * kChunks;
        CpAsync16(stage + r * HEAD_DIM + 4 * c, part_o + ((row0 + r) * group + g) * HEAD_DIM + 4 * c, true);
      }
      CpAsyncCommit();
    }
  }
  float eo[kEager ? EBATCH : 1][kPer];
  float el[kEager ? EBATCH : 1];
  if constexpr (kEager) {
    if (eager) {
#pragma unroll
      for (int k = 0; k < EBATCH; ++k) {
        const int i = warp + k * kWarps;  // of state warp & 1 (kWarps is even)
        el[k] = -INFINITY;
#pragma unroll
        for (int e = 0; e < kPer; ++e) eo[k][e] = 0.f;
        if (i < n_all) {
          el[k] = LoadF<CG>(part_lse + (row0 + i) * group + g);
          LoadRowAny<kPer, CG>(part_o + ((row0 + i) * group + g) * HEAD_DIM + c0, eo[k]);
        }
      }
    }
  }
  // Over the lanes of this lane's parity (the rows of one state).
  const LseSum sum = decode::WarpLseSum<2>(lse_sum_add(lse_sum_add(lse_sum_empty(), l0), l1));
  if (lane < 2) sm_sum[warp][lane] = sum;
  __syncthreads();
  LseSum tot[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    tot[k] = sm_sum[0][k];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) tot[k] = lse_sum_combine(tot[k], sm_sum[w][k]);
  }
  float acc[2][kPer];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) acc[k][i] = 0.f;
  }
  if (eager) {
    if constexpr (kEager) {
      const bool odd = warp & 1;
      const LseSum t = PickSum(tot, odd);
      float x[kPer] = {};
#pragma unroll
      for (int k = 0; k < EBATCH; ++k) {
        const float w = lse_sum_weight(t, el[k]);  // 0 past n_all (lse -inf)
        if (w > 0.f) {
#pragma unroll
          for (int e = 0; e < kPer; ++e) x[e] = fmaf(w, eo[k][e], x[e]);
        }
      }
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        acc[0][e] = odd ? 0.f : x[e];
        acc[1][e] = odd ? x[e] : 0.f;
      }
    }
  } else if (STAGE > 0 && staged) {
    // Row r is of state r & 1; rows tid and tid + kThreads are of state tid & 1.
    const LseSum t = PickSum(tot, tid & 1);
    sm_w[tid] = lse_sum_weight(t, l0);
    sm_w[tid + kThreads] = lse_sum_weight(t, l1);
    CpAsyncWait<0>();
    __syncthreads();
    // kWarps is even: warp w's rows are all of state w & 1. A row of zero weight (an empty
    // state, possibly never written) is selected away, not multiplied.
    float x[kPer] = {};
#pragma unroll 4
    for (int r = warp; r < n_all; r += kWarps) {
      const float w = sm_w[r];
      float o2[kPer];
      LoadRow<kPer>(stage + r * HEAD_DIM + c0, o2);
#pragma unroll
      for (int e = 0; e < kPer; ++e) x[e] = w > 0.f ? fmaf(w, o2[e], x[e]) : x[e];
    }
    const bool odd = warp & 1;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      acc[0][e] = odd ? 0.f : x[e];
      acc[1][e] = odd ? x[e] : 0.f;
    }
  } else {
    // Compact the rows of nonzero weight (empty states weigh 0 and are not loaded).
    const LseSum t = PickSum(tot, tid & 1);
    const float w0 = lse_sum_weight(t, l0), w1 = lse_sum_weight(t, l1);
    const int cnt = int(w0 > 0.f) + int(w1 > 0.f);
    int32_t n = 0;
    int32_t pos = BlockExclusiveScan(cnt, &n, sm_scan);
    if (w0 > 0.f) {
      sm_w[pos] = w0;
      sm_j[pos++] = tid;
    }
    if (w1 > 0.f) {
      sm_w[pos] = w1;
      sm_j[pos] = tid + kThreads;
    }
    __syncthreads();
    for (int i0 = warp; i0 < n; i0 += kWarps * BATCH) {
      float o2[BATCH][kPer];
#pragma unroll
      for (int k = 0; k < BATCH; ++k) {
        const int i = i0 + k * kWarps;
        if (i < n) {
          LoadRowAny<kPer, CG>(part_o + ((row0 + sm_j[i]) * group + g) * HEAD_DIM + c0, o2[k]);
        } else {
#pragma unroll
          for (int e = 0; e < kPer; ++e) o2[k][e] = 0.f;
        }
      }
#pragma unroll
      for (int k = 0; k < BATCH; ++k) {
        const int i = i0 + k * kWarps;
        if (i < n) {
          const float w = sm_w[i];
          if (sm_j[i] & 1) {
#pragma unroll
            for (int e = 0; e < kPer; ++e) acc[1][e] = fmaf(w, o2[k][e], acc[1][e]);
          } else {
#pragma unroll
            for (int e = 0; e < kPer; ++e) acc[0][e] = fmaf(w, o2[k][e], acc[0][e]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) StoreRow<kPer>(&sm_o[warp][k][c0], acc[k]);
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      float x = sm_o[0][k][c0 + e];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) x += sm_o[w][k][c0 + e];
      st[k].o[e] = x;
    }
    st[k].lse = lse_sum_lse(tot[k]);
  }
}

// BATCH: partial rows per warp in flight; MIN_BLOCKS: the launch bound (LaunchCombine).
// Everything but the partials was written before the attend grid started (the plan, the
// previous steps' rings, the inputs), and with programmatic launch this grid starts only
// once every attend CTA has waited for the plan: so those loads go out before the wait for
// the attend grid, and only the partials after it.
// STAGE: partial rows a head may stage in dynamic shared memory (MergePartials; 0: none).
template <typename DType, int HEAD_DIM, int BATCH, int MIN_BLOCKS, int STAGE = 0>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS) MacCombineKernel(const LaunchArgs a) {
  constexpr int kPer = HEAD_DIM / 32;
  // Only the bounded grids (past one wave) wait per group (CombineGroupWait); the one-wave
  // variant's code is as it was. With a group wait, CTA 0 ends only after the attend grid
  // (griddepcontrol.wait on its way out), so that this grid never completes before the one
  // it reads: stream order for what follows.
  constexpr bool kGroupWait = MIN_BLOCKS > 1;
  struct EndWait {
    bool on;
    __device__ ~EndWait() {
      if (on) GridDependencyWait();
    }
  } end_wait{kGroupWait && a.group_wait && blockIdx.x == 0 && threadIdx.x == 0};
  TL(if (threadIdx.x == 0 && TlCta()) { g_tl_combine[blockIdx.x][0] = TlNow(); if (blockIdx.x == 0) g_tl_grid[2] = gridDim.x; });
  const MacParams& p = a.p;
  const int bhq = int(blockIdx.x);
  const int b = bhq / a.hq, hq = bhq % a.hq;
  const int h = hq / a.group, g = hq % a.group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c0 = lane * kPer;
  const int32_t T = p.seq_lens[b];
  const int32_t slot = SlotOfDev(p.slot_ids, b);
  const int32_t W = a.window;
  const int64_t ring_row0 = (int64_t(slot) * a.hq + hq) * W;

  // Warp 0's decision and its other inputs (the reused entry, the prefix state, the query
  // and epoch for the ring writes), loaded before the wait. In grids of one wave they stay
  // in registers; a grid bounded to 8 CTAs per SM (64 registers) parks them in shared
  // memory across the merge (held in registers they would spill; loaded after the merge
  // they cost a round trip at the step's end). The plan's words are read from L2 (ld.cg):
  // they were written by the grid before the attend grid.
  constexpr bool kEarly = MIN_BLOCKS == 1;
  HeadDecision dec{-1, 0};
  if (warp == 0) {
    const int2 d2 = __ldcg(reinterpret_cast<const int2*>(a.heads + bhq));
    dec = HeadDecision{d2.x, d2.y};
  }
  // The plan holds zero chunks for T == 0, so the group's plan is read alongside T.
  const UnitPlan* upp = a.units + b * a.hkv + h;
  const int32_t first_chunk = __ldcg(&upp->first_chunk), n_chunks = __ldcg(&upp->n_chunks);
  float eo[kPer] = {}, e_lse = -INFINITY, po[kPer] = {}, p_lse = -INFINITY;
  float qv[kPer] = {};
  int32_t epoch = 0;
  auto load_inputs = [&] {
    if (T > 0 && dec.hit_pos >= 0) {
      const int64_t row = ring_row0 + dec.hit_pos % W;
      LoadRow<kPer>(p.state.ring_o + row * HEAD_DIM + c0, eo);
      e_lse = p.state.ring_lse[row];
    }
    if (p.prefix_o) {
      const DType* src = static_cast<const DType*>(p.prefix_o) + b * p.prefix_stride_b + hq * p.prefix_stride_h + c0;
#pragma unroll
      for (int i = 0; i < kPer; ++i) po[i] = Pack<DType>::One(src[i]);
      p_lse = p.prefix_lse[bhq];
    }
    if (T > 0) {
      const DType* src = static_cast<const DType*>(p.q_pre) + b * p.q_pre_stride_b + hq * p.q_pre_stride_h + c0;
#pragma unroll
      for (int i = 0; i < kPer; ++i) qv[i] = Pack<DType>::One(src[i]);
      if (lane == 0 && hq == 0) epoch = p.slots[slot].epoch;
    }
  };
  __shared__ __align__(16) float sm_in[kEarly ? 1 : 3 * 32 * kPer + 4];  // [eo | po | qv], e_lse, p_lse, epoch
  if (warp == 0) {
    load_inputs();
    if constexpr (!kEarly) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        sm_in[c0 + i] = eo[i];
        sm_in[32 * kPer + c0 + i] = po[i];
        sm_in[64 * kPer + c0 + i] = qv[i];
      }
      if (lane == 0) {
        sm_in[96 * kPer] = e_lse;
        sm_in[96 * kPer + 1] = p_lse;
        sm_in[96 * kPer + 2] = __int_as_float(epoch);
      }
    }
  }
  // The attend partials are visible. With a.group_wait, once every segment of the group is
  // counted (release by the attend CTA that wrote it, acquire here), not once the whole
  // attend grid is done, so that the combine of the groups whose CTAs are done runs while
  // the last attend CTAs still stream. Every attend CTA has started before this grid
  // launches (each lets its dependents launch after its wait for the plan), so the wait
  // cannot hold one back.
  if (kGroupWait && a.group_wait) {
    if (threadIdx.x == 0) {
      const int32_t* done = a.group_done + b * a.hkv + h;
      while (AcquireLoad(done) < n_chunks) __nanosleep(64);
    }
    __syncthreads();
  } else {
    GridDependencyWait();
  }
  TL(if (threadIdx.x == 0 && TlCta()) g_tl_combine[blockIdx.x][1] = TlNow());
  LaneState<kPer> st[2];  // [0]: band (-> entry), [1]: sink and tail (-> output)
  float* stage = nullptr;
  if constexpr (STAGE > 0) {
    extern __shared__ float4 combine_stage[];
    if (a.combine_stage) stage = reinterpret_cast<float*>(combine_stage);
  }
  MergePartials<HEAD_DIM, kPer, BATCH, kEarly ? BATCH : 1, kGroupWait, STAGE>(
      a.part_o, a.part_lse, int64_t(first_chunk) * 2, 2 * n_chunks, a.group, g, st, stage);
  TL(if (threadIdx.x == 0 && TlCta()) g_tl_combine[blockIdx.x][3] = TlNow());
  if (warp != 0) return;
  if constexpr (!kEarly) {  // written by warp 0 before MergePartials' barriers
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      eo[i] = sm_in[c0 + i];
      po[i] = sm_in[32 * kPer + c0 + i];
      qv[i] = sm_in[64 * kPer + c0 + i];
    }
    e_lse = sm_in[96 * kPer];
    p_lse = sm_in[96 * kPer + 1];
    epoch = __float_as_int(sm_in[96 * kPer + 2]);
  }

  if (T > 0 && dec.hit_pos >= 0) st[0].merge(eo, e_lse);  // entry' = entry(p) + band
  LaneState<kPer> out;
  out.init();
  if (p.prefix_o) out.merge(po, p_lse);
  out.merge(st[1].o, st[1].lse);
  out.merge(st[0].o, st[0].lse);
  StoreOut<DType, kPer>(static_cast<DType*>(p.o) + b * p.o_stride_b + hq * p.o_stride_h + c0, out.o);
  if (lane == 0) {
    if (p.lse) p.lse[bhq] = out.lse;
    if (p.hit_pos) p.hit_pos[bhq] = T > 0 ? dec.hit_pos : -1;
  }
  if (T <= 0) return;
  // Amend: the entry and query of position m into ring slot m % W.
  const int32_t m = T - 1;
  const int64_t row = ring_row0 + m % W;
  StoreRow<kPer>(p.state.ring_o + row * HEAD_DIM + c0, st[0].o);
  StoreRingQuery<kPer>(p.state.ring_q + ring_row0 * HEAD_DIM, W, m % W, p.state.ring_qs + row, qv);
  if (lane == 0) {
    p.state.ring_lse[row] = st[0].lse;
    if (hq == 0) p.state.ring_tag[int64_t(slot) * W + m % W] = MacTag{m, epoch};
  }
  TL(if (threadIdx.x == 0 && TlCta()) g_tl_combine[blockIdx.x][2] = TlNow());
}

template <typename DType, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads) MacFillCombineKernel(const LaunchArgs a) {
  constexpr int kPer = HEAD_DIM / 32;
  constexpr int kBatch = 8;
  __shared__ __align__(16) float sm_o[2 * kWarps * HEAD_DIM];
  __shared__ float sm_l[2 * kWarps];
  const MacFillParams& f = a.f;
  const int N = a.fill_n, S = a.fill_splits;
  const int cta = int(blockIdx.x);
  const int hq = cta % a.hq, bn = cta / a.hq;
  const int n = bn % N, b = bn / N;
  const int h = hq / a.group, g = hq % a.group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c0 = lane * kPer;
  const int32_t x = f.positions[int64_t(b) * N + n];
  if (x < 0 || x >= f.seq_lens[b]) return;
  const int32_t lo = SinkEnd(a.front_sink, x), hi = EntryEnd(a.front_sink, a.band, x);
  const int32_t per = FillChunkTokens(hi - lo, S);
  const int cnt = hi > lo ? CeilDiv(hi - lo, per) : 0;
  const int64_t unit = (int64_t(b) * N + n) * a.hkv + h;
  LaneState<kPer> st[2];
  st[0].init();
  st[1].init();
  for (int j0 = warp; j0 < cnt; j0 += kWarps * kBatch) {
    float o2[kBatch][kPer], l2[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int j = j0 + k * kWarps;
      if (j < cnt) {
        const int64_t row = (unit * S + j) * a.group + g;
        LoadRow<kPer>(a.part_o + row * HEAD_DIM + c0, o2[k]);
        l2[k] = a.part_lse[row];
      } else {
#pragma unroll
        for (int i = 0; i < kPer; ++i) o2[k][i] = 0.f;
        l2[k] = -INFINITY;
      }
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) st[0].merge(o2[k], l2[k]);
  }
  MergeWarps<HEAD_DIM, kPer>(st, sm_o, sm_l);
  if (warp != 0) return;
  const int32_t slot = SlotOfDev(f.slot_ids, b);
  const int32_t W = a.window;
  const int64_t ring_row0 = (int64_t(slot) * a.hq + hq) * W;  // ring slot 0 of (slot, head)
  const int64_t row = ring_row0 + x % W;
  StoreRow<kPer>(f.state.ring_o + row * HEAD_DIM + c0, st[0].o);
  float qv[kPer];
  const DType* src = static_cast<const DType*>(f.q_pre) + b * f.q_pre_stride_b + n * f.q_pre_stride_n +
                     hq * f.q_pre_stride_h + c0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) qv[i] = Pack<DType>::One(src[i]);
  StoreRingQuery<kPer>(f.state.ring_q + ring_row0 * HEAD_DIM, W, x % W, f.state.ring_qs + row, qv);
  if (lane == 0) {
    f.state.ring_lse[row] = st[0].lse;
    if (hq == 0) f.state.ring_tag[int64_t(slot) * W + x % W] = MacTag{x, f.slots[slot].epoch};
  }
}

// ---------------------------------------------------------------------------------------
// Launch functions (instantiated in reuse_attn_*.cu)
// ---------------------------------------------------------------------------------------

// Match CTAs of 128 threads (at most 128 registers: 4 per SM) that fit on a 132-SM H200 at
// once; larger grids take CTAs of 64 threads (8 per SM): the same threads per SM, twice the
// CTAs. Rows in flight per thread: 2 (one, at 84 registers instead of 121, was no faster at
// B = 32 and 2-3 us slower at B = 64 in session 12), 4 for the filtered 128-thread match.
// Where a full scan reads at least kMatchFilterBytes (both planes and the scales: LLaMA-8B
// and GQA-8 heads from B = 16 at W = 512) ring bytes set the match's pace, and it is filtered
// (the high nibble plane first, reuse.h). Below that the extra round trip costs more than
// the bytes it saves: filtered from 265 CTAs (a form that also dropped the plan's dry pass
// at B = 64), the SmolLM2 query trace (9 heads of d = 64) was 0.6-3.3 us slower at B = 16-64,
// where 63% of its rows need their low plane (their bound under the threshold; 18% are under
// it). Timeline (session 21, LLaMA-8B B = 32 32K, us from the first match CTA): the match
// grid ends at 19.7-20.7 reading whole rows, 13.3 filtered (12.3-13.6 for a diagnostic that
// read half of each row and nothing else). The plan CTA's dry pass (kPlanWarmHeads) then ran
// 2.3 us past the end of the filtered match (the plan CTA comes resident only as its first
// CTAs end, at 12.3), so a filtered match of one wave of 64-thread CTAs sets none.
// A/B in the session-21 bullet at the top of this file.
constexpr int64_t kMatchOneWave = 4 * kDecodePlanSms;
constexpr int64_t kMatchFilterBytes = int64_t(24) << 20;

template <typename DType, int HEAD_DIM>
void LaunchMatch(const LaunchArgs& a, cudaStream_t stream) {
  const int64_t ctas = int64_t(a.batch) * a.hq * a.match_splits;
  const bool filter = int64_t(a.batch) * a.hq * a.window * (HEAD_DIM + 8) >= kMatchFilterBytes;
  if (ctas > kMatchOneWave) {
    if (filter) {
      MacMatchKernel<DType, HEAD_DIM, 2, 64, true><<<unsigned(ctas), 64, 0, stream>>>(a);
    } else {
      MacMatchKernel<DType, HEAD_DIM, 2, 64, false><<<unsigned(ctas), 64, 0, stream>>>(a);
    }
  } else if (filter) {
    MacMatchKernel<DType, HEAD_DIM, 4, kThreads, true><<<unsigned(ctas), kThreads, 0, stream>>>(a);
  } else {
    MacMatchKernel<DType, HEAD_DIM, 2, kThreads, false><<<unsigned(ctas), kThreads, 0, stream>>>(a);
  }
  ASMEM_CUDA_CHECK_LAUNCH();
  LaunchArgs pa = a;
  pa.plan_dry = a.batch * a.hq >= kPlanWarmHeads &&
                !(filter && ctas > kMatchOneWave && ctas <= 2 * kMatchOneWave);
  const int64_t groups = int64_t(a.batch) * a.hkv;
  static_assert(kSpecMaxHeads <= 256, "a speculating plan has at most 256 groups");
  if (a.spec) {  // B Hq <= kSpecMaxHeads
    if (groups <= 128) {
      decode::LaunchMaybePdl(MacPlanKernel<DType, 128, true>, 1u, 128, 0, true, pa, stream);
    } else {
      decode::LaunchMaybePdl(MacPlanKernel<DType, 256, true>, 1u, 256, 0, true, pa, stream);
    }
  } else if (groups <= 128) {
    decode::LaunchMaybePdl(MacPlanKernel<DType, 128, false>, 1u, 128, 0, true, pa, stream);
  } else if (groups <= 256) {
    decode::LaunchMaybePdl(MacPlanKernel<DType, 256, false>, 1u, 256, 0, true, pa, stream);
  } else if (groups <= 512) {
    decode::LaunchMaybePdl(MacPlanKernel<DType, 512, false>, 1u, 512, 0, true, pa, stream);
  } else {
    decode::LaunchMaybePdl(MacPlanKernel<DType, 1024, false>, 1u, 1024, 0, true, pa, stream);
  }
}

// Fill: one CTA per static split. Decode: `ctas` = kTargetChunks, one per portion of the
// plan (the CTAs past the plan's portions exit at once).
template <typename DType, int HEAD_DIM, int GROUP>
void LaunchAttend(const LaunchArgs& a, int32_t ctas, cudaStream_t stream) {
  if (ctas <= 0) return;
  constexpr size_t kSmem = SegSmem<HEAD_DIM, GROUP>::kBytes;
  if (a.fill) {
    decode::AllowDynamicSmem(MacFillAttendKernel<DType, HEAD_DIM, GROUP>, kSmem, false);
    MacFillAttendKernel<DType, HEAD_DIM, GROUP><<<unsigned(ctas), kThreads, kSmem, stream>>>(a);
    ASMEM_CUDA_CHECK_LAUNCH();
    return;
  }
  if (a.spec) {
    decode::AllowDynamicSmem(MacAttendKernel<DType, HEAD_DIM, GROUP, true>, kSmem, false);
    decode::LaunchMaybePdl(MacAttendKernel<DType, HEAD_DIM, GROUP, true>, unsigned(ctas), kThreads, kSmem, a.pdl, a,
                           stream);
  } else {
    decode::AllowDynamicSmem(MacAttendKernel<DType, HEAD_DIM, GROUP, false>, kSmem, false);
    decode::LaunchMaybePdl(MacAttendKernel<DType, HEAD_DIM, GROUP, false>, unsigned(ctas), kThreads, kSmem, a.pdl,
                           a, stream);
  }
}

// Grids of at most two combine CTAs per SM (B Hq <= 264) stage a head's partial rows in
// shared memory (MergePartials): up to kCombineStageRows of them (reuse_common.h), 68 KB at
// d = 128. Before, the merge of 130 rows
// took 4.6 us at p50 after the combine's wait (timeline, GQA-8 B = 1 all-miss 32K): the lse,
// then three rounds of 32 compacted rows. Session 51, one machine, asmem_bench_mac, 32K unless
// said, two runs each, us, without -> with (ASMEM_MAC_COMBINE_STAGE=0 / 1): GQA-8 B = 1
// all-miss 34.5, 34.2 -> 33.3, 34.2, 64K 49.3, 49.7 -> 48.5, 48.6, 128K 79.1, 79.2 -> 77.8,
// 78.1; LLaMA-8B 47.9, 48.2 -> 47.4, 47.8, 128K 137.8, 137.8 -> 137.1, 136.9; all-hit and
// B = 2-8 within 0.5.
constexpr int kOneWaveCombineBatch = 8;
static_assert(kWarps * kOneWaveCombineBatch == kCombineEagerRows, "the one-wave combine's eager rows");
template <typename DType, int HEAD_DIM>
void LaunchCombine(const LaunchArgs& a, cudaStream_t stream) {
  const int64_t ctas = int64_t(a.batch) * a.hq;
  if (ctas <= 2 * kDecodePlanSms) {
    constexpr size_t kStageBytes = size_t(kCombineStageRows) * HEAD_DIM * sizeof(float);
    auto kernel = MacCombineKernel<DType, HEAD_DIM, kOneWaveCombineBatch, 1, kCombineStageRows>;
    decode::AllowDynamicSmem(kernel, kStageBytes, false);
    decode::LaunchMaybePdl(kernel, unsigned(ctas), kThreads, kStageBytes, a.pdl, a, stream);
  } else if (ctas > kCombineOneWave) {
    decode::LaunchMaybePdl(MacCombineKernel<DType, HEAD_DIM, 4, 8>, unsigned(ctas), kThreads, 0, a.pdl, a, stream);
  } else {
    decode::LaunchMaybePdl(MacCombineKernel<DType, HEAD_DIM, kOneWaveCombineBatch, 1>, unsigned(ctas), kThreads, 0,
                           a.pdl, a, stream);
  }
}

template <typename DType, int HEAD_DIM>
void LaunchFillCombine(const LaunchArgs& a, cudaStream_t stream) {
  const int64_t ctas = int64_t(a.batch) * a.fill_n * a.hq;
  MacFillCombineKernel<DType, HEAD_DIM><<<unsigned(ctas), kThreads, 0, stream>>>(a);
  ASMEM_CUDA_CHECK_LAUNCH();
}

// Explicit instantiations of one dtype and head dim (used by reuse_attn_*.cu).
#define ASMEM_MAC_INSTANTIATE(DT, HD)                                              \
  template void LaunchAttend<DT, HD, 1>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchAttend<DT, HD, 2>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchAttend<DT, HD, 3>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchAttend<DT, HD, 4>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchAttend<DT, HD, 5>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchAttend<DT, HD, 6>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchAttend<DT, HD, 7>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchAttend<DT, HD, 8>(const LaunchArgs&, int32_t, cudaStream_t); \
  template void LaunchMatch<DT, HD>(const LaunchArgs&, cudaStream_t);              \
  template void LaunchCombine<DT, HD>(const LaunchArgs&, cudaStream_t);            \
  template void LaunchFillCombine<DT, HD>(const LaunchArgs&, cudaStream_t);

}  // namespace mac
}  // namespace asmem
