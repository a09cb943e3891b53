"""``sparsetier bench``: benchmarks reported as ratios against a baseline from the same run.

``transfer``: copy-engine bandwidth. On cpu, the cpu engine against one large memcpy of the
same bytes; on cuda (``bench_gpu.py``), the kernel and direct engines against a per-page copy
loop, torch index copies, and one large pinned copy (the link's peak).

``directory``: the binding's overhead. For each batch size and device hit rate, the same resolve
workload runs once in Rust alone (``sparsetier.testing.bench_resolve``) and once through the
Python binding, and the report gives the ratio. Timing covers the ``resolve`` call only; the
reset between calls (failing the batch's load with ``ended`` and releasing its pins) is untimed,
as in the Rust workload."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from sparsetier import testing
from sparsetier._core import PoolSpec, ResidencyDirectory
from sparsetier.keys import object_keys

BENCH_OBJECT_BYTES = 256 * 1024


@dataclass
class DirectoryRow:
    batch: int
    hit_rate: float
    rust_ns_per_key: float
    python_ns_per_key: float

    @property
    def ratio(self) -> float:
        return self.python_ns_per_key / self.rust_ns_per_key


def _workload(batch: int, hit_rate: float) -> tuple[ResidencyDirectory, np.ndarray]:
    """The state `directory::bench::ResolveWorkload::new` builds, through the binding."""
    d = ResidencyDirectory(batch, batch, object_bytes=BENCH_OBJECT_BYTES)
    keys = object_keys(1, np.arange(batch), layer=0)
    d.allocate(keys)
    d.backup_complete(d.backup(keys).transfer_id)
    misses = round((1.0 - hit_rate) * batch)
    miss = np.zeros(batch, dtype=bool)
    miss[[i * batch // max(misses, 1) for i in range(misses)]] = True
    hits = keys[~miss]
    guard = d.resolve(hits) if len(hits) else None
    d.evict(misses)
    if guard is not None:
        d.release(guard.handle)
    return d, keys


def _time_python(batch: int, hit_rate: float, iters: int) -> float:
    d, keys = _workload(batch, hit_rate)
    total = 0
    for i in range(iters + 3):
        t = time.perf_counter_ns()
        r = d.resolve(keys)
        dt = time.perf_counter_ns() - t
        if i >= 3:  # warm-up
            total += dt
        for lp in r.loads:
            d.fail(lp.transfer_id, "bench reset", ended=True)
        d.release(r.handle)
    d.validate()
    return total / iters


def bench_directory(
    batches: tuple[int, ...] = (64, 2048, 16384),
    hit_rates: tuple[float, ...] = (1.0, 0.9, 0.5),
    budget_s: float = 0.3,
) -> list[DirectoryRow]:
    rows = []
    for batch in batches:
        for hit in hit_rates:
            iters = max(5, int(budget_s * 1e9 / max(batch * 40, 1) / 2))
            rust = testing.bench_resolve(batch, hit, iters)
            py = _time_python(batch, hit, iters)
            rows.append(DirectoryRow(batch, hit, rust / batch, py / batch))
    return rows


def format_directory(rows: list[DirectoryRow]) -> str:
    lines = [
        "batch   hit  rust ns/key  python ns/key  python/rust",
        "------  ---  -----------  -------------  -----------",
    ]
    for r in rows:
        lines.append(
            f"{r.batch:>6}  {r.hit_rate:>3.0%}  {r.rust_ns_per_key:>11.1f}  "
            f"{r.python_ns_per_key:>13.1f}  {r.ratio:>10.2f}x"
        )
    return "\n".join(lines)


def directory_json(rows: list[DirectoryRow]) -> list[dict[str, float]]:
    return [{**asdict(r), "ratio": r.ratio} for r in rows]


# ---------------------------------------------------------------------------------------
# transfer: copy-engine bandwidth against baselines from the same run

PAGE_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
TOKENS_PER_PAGE = 16


@dataclass
class TransferRow:
    engine: str
    direction: str
    pattern: str  # contiguous | scattered | token
    page_bytes: int
    bytes: int
    seconds: float
    baseline: str
    baseline_gbps: float
    #: The median of per-repetition ratios engine / baseline, when the two alternated.
    paired_ratio: float | None = None
    #: The CPU time of one submission (planning the ops and launching), best of the repeats.
    submit_seconds: float | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9

    @property
    def ratio(self) -> float:
        if self.paired_ratio is not None:
            return self.paired_ratio
        return self.gbps / self.baseline_gbps


def _pool(page_bytes: int, pages: int, granular: bool) -> PoolSpec:
    """A one-layer K-only pool of raw bytes whose page is `page_bytes` long."""
    from sparsetier._core import PoolSpec

    ps = TOKENS_PER_PAGE if granular else 1
    return PoolSpec("INDEXER", 1, 1, page_bytes // ps, "fp8_e4m3", ps, pages)


def _paired(a, b, repeats: int) -> tuple[float, float, float]:
    """Runs `a` and `b` alternately (a, b, a, b...): their best times and the median of the
    per-repetition ratios time(b) / time(a) (a's speed relative to b's)."""
    ta, tb = [], []
    for _ in range(repeats):
        for fn, out in ((a, ta), (b, tb)):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    ratios = sorted(y / x for x, y in zip(ta, tb, strict=True))
    return min(ta), min(tb), ratios[len(ratios) // 2]


def _units(pattern: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if pattern == "contiguous":
        return np.arange(n), np.arange(n)
    return rng.permutation(n), rng.permutation(n)


def bench_transfer_cpu(total_mb: int = 128, repeats: int = 5) -> list[TransferRow]:
    """The cpu engine (one worker: one copy thread) against one large single-threaded memcpy
    of the same bytes (numpy copyto), for each page size and pattern; the two alternate within
    each row and the row's ratio is the median of the paired ratios."""
    import torch

    from sparsetier._core import (
        PageTransferBinding,
        PageTransferGroup,
        PreparedPageTransfer,
        TransferEngine,
    )

    total = total_mb << 20
    src_np = np.random.default_rng(0).integers(0, 255, size=total, dtype=np.uint8)
    dst_np = np.empty_like(src_np)
    base_np = np.empty_like(src_np)
    engine = TransferEngine("cpu", threads=1)
    rng = np.random.default_rng(1)
    rows = []
    for page_bytes in PAGE_SIZES:
        pages = total // page_bytes
        for pattern in ("contiguous", "scattered", "token"):
            granular = pattern == "token"
            spec = _pool(page_bytes, pages, granular)
            src = torch.from_numpy(src_np).view(spec.shape())
            dst = torch.from_numpy(dst_np).view(spec.shape())
            n = pages * (TOKENS_PER_PAGE if granular else 1)
            s, d = _units("contiguous" if pattern == "contiguous" else "scattered", n, rng)
            t = PreparedPageTransfer(
                PageTransferBinding(src, spec),
                PageTransferBinding(dst, spec),
                s,
                d,
                granularity="token" if granular else "page",
            )
            group = PageTransferGroup([t])
            secs, base, ratio = _paired(
                lambda g=group: engine.submit(g).wait(),
                lambda: np.copyto(base_np, src_np),
                repeats,
            )
            memcpy = total / base / 1e9
            rows.append(
                TransferRow("cpu", "h2h", pattern, page_bytes, total, secs, "memcpy", memcpy, ratio)
            )
            unit = page_bytes // TOKENS_PER_PAGE if granular else page_bytes
            for i in rng.integers(0, n, size=8):  # one layer, one plane: units are linear
                a, b = s[i] * unit, d[i] * unit
                if not np.array_equal(dst_np[b : b + unit], src_np[a : a + unit]):
                    raise AssertionError(f"{pattern} {page_bytes} B: the copy is wrong")
    return rows


def format_transfer(rows: list[TransferRow]) -> str:
    head = (
        "engine  dir  pattern     page     GB/s   baseline        GB/s  ratio",
        "------  ---  ----------  -------  -----  ----------  -------  -----",
    )
    submits = any(r.submit_seconds is not None for r in rows)
    lines = [h + ("  submit ms" if submits else "") for h in head]
    if submits:
        lines[1] = head[1] + "  ---------"
    for r in rows:
        line = (
            f"{r.engine:<6}  {r.direction:<3}  {r.pattern:<10}  {r.page_bytes >> 10:>4} KiB  "
            f"{r.gbps:>5.1f}  {r.baseline:<10}  {r.baseline_gbps:>7.1f}  {r.ratio:>4.0%}"
        )
        if r.submit_seconds is not None:
            line += f"  {r.submit_seconds * 1e3:>9.2f}"
        lines.append(line)
    return "\n".join(lines)


def transfer_json(rows: list[TransferRow]) -> list[dict[str, object]]:
    return [{**asdict(r), "gbps": r.gbps, "ratio": r.ratio} for r in rows]
