"""Two builds of the extension in one process: `bench prefix`'s serve loop, paired.

    python scripts/ab_prefix.py A/_core.abi3.so B/_core.abi3.so [--page-size 1] [--reps 15]

Each repetition serves the same requests (`bench prefix`'s workload, tokens as `array('q')`)
through a fresh `HiCache` of each build, the order alternating (A, B then B, A), and times the
whole serve loop; reports each side's median and the median of the per-repetition ratios B / A,
and checks that both sides hit the same tokens. How to get a build's library: see
`scripts/ab_decode.py`.
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import time

from ab_decode import load

from sparsetier.errors import OutOfPagesError
from sparsetier.tools.workload import Workload, WorkloadSpec, as_tokens


def serve(core, seqs, ps: int, cap_pages: int, inflight: int = 32) -> tuple[float, int]:
    """`bench prefix`'s serve loop on `core`'s HiCache: seconds, tokens hit."""
    c = core.HiCache(ps, cap_pages, drop_unbacked=True)
    held: collections.deque[int] = collections.deque()
    hit = 0
    t = time.perf_counter()
    for s in seqs:
        try:
            m = c.match_prefix(s, lock=True, alloc=True)
        except OutOfPagesError:
            continue
        r = c.insert(s, m, lock=True, unlock=m.device_node)
        held.append(r.last_node)
        if len(held) > inflight:
            c.unlock(held.popleft())
        hit += m["device_len"]
    dt = time.perf_counter() - t
    c.validate()
    return dt, hit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="build A's _core shared object")
    ap.add_argument("b", help="build B's _core shared object")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--num-seqs", type=int, default=500)
    ap.add_argument("--serve-reqs", type=int, default=500)
    args = ap.parse_args()
    ps = args.page_size
    wl = Workload(WorkloadSpec(num_seqs=args.num_seqs, align=ps))
    fill = [t for _, t in wl.stream(args.num_seqs, 1)]
    seqs = [as_tokens("q", t) for _, t in wl.stream(args.serve_reqs, 3)]
    cached = sum(len(s) // ps * ps for s in fill)
    cap_pages = int(0.25 * cached) // ps
    cores = [load(args.a), load(args.b)]
    times: list[list[float]] = [[], []]
    gc.disable()
    serve(cores[0], seqs, ps, cap_pages)  # warm both
    serve(cores[1], seqs, ps, cap_pages)
    for rep in range(args.reps):
        hits = [0, 0]
        for side in (0, 1) if rep % 2 == 0 else (1, 0):
            dt, hits[side] = serve(cores[side], seqs, ps, cap_pages)
            times[side].append(dt)
        assert hits[0] == hits[1], f"rep {rep}: the builds hit differently: {hits}"
    gc.enable()
    a, b = times
    ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
    per = 1e6 / len(seqs)
    print(
        f"serve loop, page {ps}, {len(seqs)} requests, {args.reps} reps: "
        f"A {statistics.median(a) * per:.1f} us | B {statistics.median(b) * per:.1f} us a "
        f"request | B/A {ratio:.3f} (median of per-rep ratios)"
    )


if __name__ == "__main__":
    main()
