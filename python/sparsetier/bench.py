"""``sparsetier bench``: benchmarks reported as ratios against a baseline from the same run.

``directory``: the binding's overhead. For each batch size and device hit rate, the same
resolve workload runs once in Rust alone (``_core._bench_resolve``) and once through the Python
binding, and the report gives the ratio. Timing covers the ``resolve`` call only; the reset
between calls (failing the batch's load with ``ended`` and releasing its pins) is untimed, as in
the Rust workload.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from sparsetier import _core
from sparsetier._core import ResidencyDirectory
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
            rust = _core._bench_resolve(batch, hit, iters)
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
