"""``sparsetier bench transfer --device cuda``: the kernel and direct engines on a GPU.

It runs from ``scripts/gpu-check.sh`` on the device machine (figures from an H200 in
``benches/RESULTS.md``). In one run it measures, for pages of 4 KiB to
1 MiB, contiguous, scattered and token-granularity copies in both directions (H2D, D2H):

- the kernel and direct engines;
- three baselines: a per-page copy loop (one ``cudaMemcpyAsync`` per page, through torch),
  torch ``index_select`` + ``index_copy_`` between pinned and device tensors, and one large
  contiguous pinned copy of the same bytes (the link's peak, the ratio's denominator);
- how many SMs the kernel needs: 16 KiB scattered H2D with ``sm_limit`` 1 to 32;
- the kernel's threads per op chosen by op length against a whole block per op
  (``lanes=512``), alternating in one process, on token rows and on DeepSeek-V3.2's rows
  (656-byte KV rows and 132-byte Indexer-K rows, 64 tokens a page).

Every row alternates with its baseline in one process (row, peak, row, peak...) and its ratio
is the median of the paired ratios. Each engine row also gives the CPU time of one submission
(building the copy ops and launching): what a decode step pays on its thread.
"""

from __future__ import annotations

import time

import numpy as np

from sparsetier.tools.bench import PAGE_SIZES, TransferRow, _paired, _pool, _units

#: DeepSeek-V3.2's token rows: packed FP8 main KV (656 B) and FP8 Indexer-K with its scale
#: (132 B); 64 tokens a page.
DEEPSEEK_ROWS = (656, 132)
DEEPSEEK_PAGE_TOKENS = 64


def _synced(fn):
    """`fn`, then wait until the GPU has finished it (a timed call is the whole copy)."""
    import torch

    def run():
        fn()
        torch.cuda.synchronize()

    return run


def bench_transfer_cuda(total_mb: int = 256, repeats: int = 5) -> list[TransferRow]:
    import torch

    from sparsetier._core import (
        PageTransferBinding,
        PageTransferGroup,
        PoolSpec,
        PreparedPageTransfer,
        TransferEngine,
        cuda_status,
    )
    from sparsetier.errors import CudaUnavailableError

    ok, why = cuda_status()
    if not ok or not torch.cuda.is_available():
        raise CudaUnavailableError(
            why or "CUDA unavailable: torch sees no GPU",
            what=why or "torch sees no GPU",
            fix="run it on a machine with an NVIDIA GPU, or use --device cpu",
        )
    total = total_mb << 20
    host = torch.randint(0, 255, (total,), dtype=torch.uint8).pin_memory()
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    # The link's peak: one contiguous pinned copy of the whole buffer, each way.
    peak = {
        "h2d": _synced(lambda: dev.copy_(host, non_blocking=True)),
        "d2h": _synced(lambda: host.copy_(dev, non_blocking=True)),
    }

    def paired_row(label, direction, pattern, page_bytes, fn, reps, **extra):
        torch.cuda.synchronize()
        ta, tb, ratio = _paired(fn, peak[direction], reps)
        rows.append(TransferRow(label, direction, pattern, page_bytes, total, ta, "peak",
                                total / tb / 1e9, paired_ratio=ratio, **extra))  # fmt: skip

    rng = np.random.default_rng(1)
    rows: list[TransferRow] = []

    def group(direction, pattern, page_bytes, spec=None):
        granular = pattern == "token"
        spec = spec or _pool(page_bytes, total // page_bytes, granular)
        size = spec.total_bytes  # the whole buffer, or a prefix of it for odd rows
        h, d = host[:size].view(spec.shape()), dev[:size].view(spec.shape())
        n = spec.pages * (spec.page_size if granular else 1)
        s_u, d_u = _units("contiguous" if pattern == "contiguous" else "scattered", n, rng)
        hb, db = PageTransferBinding(h, spec), PageTransferBinding(d, spec)
        src, dst = (hb, db) if direction == "h2d" else (db, hb)
        t = PreparedPageTransfer(
            src,
            dst,
            s_u,
            d_u,
            direction="load" if direction == "h2d" else "backup",
            granularity="token" if granular else "page",
        )
        return PageTransferGroup([t]), s_u, d_u, size // n

    def check(label, direction, pattern, page_bytes, s_u, d_u, unit):
        # A figure for wrong bytes is no figure: check a sample of the units moved.
        a, b = (host, dev) if direction == "h2d" else (dev, host)
        for i in rng.choice(len(s_u), size=min(16, len(s_u)), replace=False):
            s0, d0 = int(s_u[i]) * unit, int(d_u[i]) * unit
            if not torch.equal(b[d0 : d0 + unit].cpu(), a[s0 : s0 + unit].cpu()):
                raise AssertionError(
                    f"{label} {direction} {pattern} {page_bytes} B: unit "
                    f"{int(s_u[i])} -> {int(d_u[i])} holds wrong bytes"
                )

    def submit_time(engine, g):
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            h = engine.submit(g)
            best = min(best, time.perf_counter() - t)
            h.wait()
        return best

    def run(engine, direction, pattern, page_bytes, label=None):
        g, s_u, d_u, unit = group(direction, pattern, page_bytes)
        label = label or engine.name
        paired_row(label, direction, pattern, page_bytes, lambda: engine.submit(g).wait(),
                   repeats, submit_seconds=submit_time(engine, g))  # fmt: skip
        engine.submit(g).wait()  # the peak copy ran last and overwrote the destination
        check(label, direction, pattern, page_bytes, s_u, d_u, unit)

    def lanes_pair(auto, block, direction, pattern, page_bytes, spec=None):
        # The kernel as built (threads per op by op length) against a whole block per op,
        # alternating: the paired ratio is block time / auto time (> 1: auto is faster).
        g, s_u, d_u, unit = group(direction, pattern, page_bytes, spec)
        moved = len(s_u) * unit
        ta, tb, ratio = _paired(
            lambda: auto.submit(g).wait(), lambda: block.submit(g).wait(), repeats
        )
        check("kernel", direction, pattern, page_bytes, s_u, d_u, unit)
        rows.append(
            TransferRow(
                "kernel",
                direction,
                pattern,
                page_bytes,
                moved,
                ta,
                "lanes=512",
                moved / tb / 1e9,
                paired_ratio=ratio,
            )
        )

    for backend in ("kernel", "direct"):
        engine = TransferEngine(backend)
        for direction in ("h2d", "d2h"):
            for page_bytes in PAGE_SIZES:
                for pattern in ("contiguous", "scattered", "token"):
                    run(engine, direction, pattern, page_bytes)
    for sm in (1, 2, 4, 8, 16, 32):
        run(TransferEngine("kernel", sm_limit=sm), "h2d", "scattered", 16 << 10, f"kernel-sm{sm}")

    auto, block = TransferEngine("kernel"), TransferEngine("kernel", lanes=512)
    for direction in ("h2d", "d2h"):
        for page_bytes in PAGE_SIZES[:3]:
            lanes_pair(auto, block, direction, "token", page_bytes)
        for row in DEEPSEEK_ROWS:
            pages = total // (row * DEEPSEEK_PAGE_TOKENS)
            spec = PoolSpec("INDEXER", 1, 1, row, "fp8_e4m3", DEEPSEEK_PAGE_TOKENS, pages)
            lanes_pair(auto, block, direction, "token", spec.page_bytes, spec)
            rows[-1].pattern = f"token-{row}B"

    for page_bytes in PAGE_SIZES:
        pages = total // page_bytes
        hp, dp = host.view(pages, page_bytes), dev.view(pages, page_bytes)
        s_u, d_u = rng.permutation(pages), rng.permutation(pages)
        s_l, d_l = s_u.tolist(), d_u.tolist()

        def loop(hp=hp, dp=dp, s_l=s_l, d_l=d_l):
            for a, b in zip(s_l, d_l, strict=True):
                dp[b].copy_(hp[a], non_blocking=True)

        s_t = torch.from_numpy(s_u)
        d_t = torch.from_numpy(d_u).cuda()

        def index(hp=hp, dp=dp, s_t=s_t, d_t=d_t):
            dp.index_copy_(0, d_t, hp.index_select(0, s_t).pin_memory().cuda(non_blocking=True))

        for label, fn in (("torch-loop", loop), ("torch-index", index)):
            paired_row(label, "h2d", "scattered", page_bytes, _synced(fn), max(2, repeats // 2))
    return rows
