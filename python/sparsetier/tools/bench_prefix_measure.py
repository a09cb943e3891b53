"""`sparsetier bench prefix-sparse --measure`: prefix hits at DeepSeek-V3.2's shape run through
the core itself, with the bytes counted by its prefix tier, to set beside the selection
model's expectations (`bench_prefix_sparse.py`).

Per cell (prefix P, suffix S) and restore mode, a fresh `StepScheduler.joined` on the cpu
engine, over pools of the bench's row sizes (a 656-byte KV row and a 132-byte Indexer-K row a
token and layer), goes through:
1. a request over the P prefix tokens, prefilled (its pages written through to host) and
   inserted into the prefix tree;
2. an unrelated request as long as the device, which takes every KV slot and Indexer-K page
   (the prefix's pages leave the device; they stay in host memory), ended without inserting;
3. the hit: a request over the prefix and S more tokens, admitted (the core decides its
   restore), its suffix prefilled as one chunk: per layer, `wait_prefix`, then one plan over
   the pages the suffix's selections name (a layer's union, drawn from the selection model
   or read from recorded selections) and the suffix's own pages.

Mode `auto` is first taught by one hit of the same lengths (restored Indexer-K only, having
no sample), the prefix pushed off the device again before the hit that counts.

What it reports comes from the core's counters (`prefix_stats`, `restore_status`): the bytes
moved host -> device (Indexer-K restored plus KV loaded for the prefix's pages), against a
full restore of the same pages; the objects loaded, beside those the drawn unions name and
the model's expectation; the submissions. Not the time: the pools are left untouched until
copied into, so the cpu engine's first copies pay the page faults, and its memory is no PCIe
link. Prefixes are whole pages (the tree matches whole pages only).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from sparsetier._core import PageTransferBinding, PoolSpec, StepScheduler, TransferEngine
from sparsetier.tools.selection_model import RecordedSelections, SelectionModel

#: The restore modes run per cell.
MODES = ("full", "indexer", "auto")


@dataclass(frozen=True)
class Measured:
    prefix: int
    suffix: int
    mode: str
    choice: str  # what the core chose (the mode itself unless `auto`)
    absent_objects: int  # the prefix's KV objects off the device at admission
    loaded_objects: int  # of those, loaded (in bulk or on demand)
    named_objects: int  # the prefix's objects the drawn unions named, every layer
    expected_objects: float  # the selection model's union, every layer (Indexer-K only)
    indexer_bytes: int
    kv_bytes: int
    full_restore_bytes: int
    bulk_submissions: int
    on_demand: int

    @property
    def moved_bytes(self) -> int:
        return self.indexer_bytes + self.kv_bytes

    @property
    def full_over_moved(self) -> float:
        return self.full_restore_bytes / self.moved_bytes


def _unions(
    model: SelectionModel | RecordedSelections,
    layers: int,
    prefix: int,
    suffix: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    if isinstance(model, RecordedSelections):
        return [model.layer_union(li, prefix, suffix) for li in range(layers)]
    return [model.sample_union(prefix, suffix, rng) for _ in range(layers)]


class _Hit:
    """One scheduler at the bench's shape, sized for a P-token prefix and its S-token hits."""

    def __init__(
        self, model, prefix: int, suffix: int, layers: int, mode: str, shape: tuple[int, int, int]
    ) -> None:
        kv_row, ik_row, copy_overhead = shape
        ps = model.page_size
        self.model, self.prefix, self.suffix, self.layers, self.ps = (
            model, prefix, suffix, layers, ps,
        )  # fmt: skip
        self.suffix_pages = -(-(prefix + suffix) // ps)
        # The filler takes the whole device: every slot and every Indexer-K page.
        self.device_pages = self.suffix_pages + 1
        # Host: the prefix and a hit's suffix in the tree, and a filler's pages.
        host_pages = 2 * self.device_pages + 2

        def spec(component: str, n_layers: int, row: int, pages: int) -> PoolSpec:
            return PoolSpec(component, n_layers, 1, row, "fp8_e4m3", ps, pages, planes_per_layer=1)

        kv = spec("KV", 1, kv_row, self.device_pages * layers)
        kv_host = spec("KV", layers, kv_row, host_pages)
        ik = spec("INDEXER", layers, ik_row, self.device_pages)
        ik_host = ik.with_pages(host_pages)

        def pool(s: PoolSpec) -> torch.Tensor:
            return torch.empty(s.shape(), dtype=torch.uint8)

        self.s = StepScheduler.joined(
            PageTransferBinding(pool(kv), kv),
            PageTransferBinding(pool(kv_host), kv_host),
            TransferEngine("cpu"),
            indexer_device=PageTransferBinding(pool(ik), ik),
            indexer_host=PageTransferBinding(pool(ik_host), ik_host),
            prefetch=False,
            restore=mode,
            restore_copy_overhead=copy_overhead,
        )
        self.next_rid = 0

    def _rid(self) -> int:
        self.next_rid += 1
        return self.next_rid

    def _push_off(self, tokens: np.ndarray) -> None:
        """An unrelated request as long as the device: the cached pages leave it."""
        rid = self._rid()
        n = self.device_pages * self.ps
        filler = np.arange(n, dtype=np.int64) + int(tokens.max()) + 1
        self.s.admit(rid, filler)
        self.s.extend(rid, n)
        self.s.finish_request(rid)
        self.s.drain()

    def cache_prefix(self, tokens: np.ndarray) -> None:
        rid = self._rid()
        self.s.admit(rid, tokens[: self.prefix])
        self.s.extend(rid, self.prefix)
        self.s.end_step()  # writes the filled pages through
        self.s.finish_request(rid, tokens[: self.prefix])
        self.s.flush_finished()
        self.s.drain()
        self._push_off(tokens)

    def hit(self, tokens: np.ndarray, rng: np.random.Generator) -> tuple[dict, int]:
        """Admits `tokens` (the prefix and a suffix) and prefills the suffix; returns its
        restore status and the prefix objects its selections named. The prefix is pushed off
        the device again after it (for a next hit)."""
        rid = self._rid()
        adm = self.s.admit(rid, tokens)
        if adm.matched_pages * self.ps != self.prefix:
            raise RuntimeError(
                f"the hit matched {adm.matched_pages} pages of the {self.prefix}-token prefix"
            )
        self.s.extend(rid, self.suffix)
        own = np.arange(self.prefix // self.ps, self.suffix_pages)  # the suffix's pages
        unions = _unions(self.model, self.layers, self.prefix, self.suffix, rng)
        for li, union in enumerate(unions):
            self.s.wait_prefix(rid, li, None)
            entries = np.union1d(union, own).astype(np.int32)[None, :]
            plan, _ = self.s.plan(li, np.array([rid]), entries, self.ps)
            failed, _ = self.s.ready(plan, None)
            self.s.finish(plan)
            if failed:
                raise RuntimeError(f"a load failed at layer {li}: {failed[0][2]}")
        self.s.end_step()
        status = self.s.restore_status(rid)
        self.s.finish_request(rid, tokens)
        self.s.flush_finished()
        self.s.drain()
        self._push_off(tokens)
        return status, sum(u.size for u in unions)


def check_prefix(prefix: int, page_size: int, field: str = "prefix") -> None:
    """A ValueError unless `prefix` is whole pages: the tree matches whole pages only."""
    if prefix < page_size or prefix % page_size:
        raise ValueError(f"{field} = {prefix}: allowed a multiple of the page size {page_size}")


def _other(tokens: np.ndarray, prefix: int, suffix: int) -> np.ndarray:
    """The prefix and a different suffix of the same length."""
    return np.concatenate([tokens[:prefix], tokens[prefix + suffix :]])


def measure(
    model: SelectionModel | RecordedSelections,
    prefix: int,
    suffix: int,
    layers: int = 61,
    shape: tuple[int, int, int] = (656, 132, 16 << 10),
    modes: tuple[str, ...] = MODES,
    seed: int = 0,
) -> list[Measured]:
    """One cell under each of `modes`, each on a fresh scheduler (module docs); `shape`: the
    KV and Indexer-K bytes a token and layer, and the policy's copy overhead. `prefix`: a
    multiple of the page size."""
    check_prefix(prefix, model.page_size)
    out = []
    expected = (
        model.prefix_union(prefix, suffix) * layers
        if isinstance(model, SelectionModel)
        else float(sum(len(model.layer_union(li, prefix, suffix)) for li in range(layers)))
    )
    # The same tokens and the same selections under every mode.
    tokens = np.random.default_rng(seed).integers(1, 1 << 30, size=prefix + 2 * suffix)
    for mode in modes:
        h = _Hit(model, prefix, suffix, layers, mode, shape)
        h.cache_prefix(tokens)
        if mode == "auto":  # taught by one hit of these lengths first
            h.hit(_other(tokens, prefix, suffix), np.random.default_rng(seed + 2))
        before = h.s.prefix_stats()
        status, named = h.hit(tokens[: prefix + suffix], np.random.default_rng(seed + 1))
        px = h.s.prefix_stats()
        counted = ("indexer_bytes_restored", "prefix_kv_bytes_loaded", "full_restore_bytes")
        delta = {k: px[k] - before[k] for k in counted}
        out.append(
            Measured(
                prefix=prefix,
                suffix=suffix,
                mode=mode,
                choice=status["choice"],
                absent_objects=status["absent"],
                loaded_objects=status["loaded"],
                named_objects=named,
                expected_objects=expected,
                indexer_bytes=delta["indexer_bytes_restored"],
                kv_bytes=delta["prefix_kv_bytes_loaded"],
                full_restore_bytes=delta["full_restore_bytes"],
                bulk_submissions=status["bulk_submissions"],
                on_demand=status["on_demand"],
            )
        )
        del h
    return out


def format_measured(rows: list[Measured]) -> str:
    lines = [
        "measured through the core (cpu engine; bytes from its prefix tier's counters):",
        f"{'prefix':>8} {'suffix':>7} {'mode':>8} {'choice':>10} {'absent':>8} {'loaded':>8} "
        f"{'named':>8} {'expected':>9} {'moved GiB':>10} {'full GiB':>9} {'full/moved':>11} "
        f"{'bulk':>5} {'on demand':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r.prefix:>8} {r.suffix:>7} {r.mode:>8} {r.choice:>10} {r.absent_objects:>8} "
            f"{r.loaded_objects:>8} {r.named_objects:>8} {r.expected_objects:>9.0f} "
            f"{r.moved_bytes / 2**30:>10.3f} {r.full_restore_bytes / 2**30:>9.3f} "
            f"{r.full_over_moved:>10.2f}x {r.bulk_submissions:>5} {r.on_demand:>9}"
        )
    return "\n".join(lines)


def to_json(rows: list[Measured]) -> list[dict]:
    return [
        asdict(r) | {"moved_bytes": r.moved_bytes, "full_over_moved": r.full_over_moved}
        for r in rows
    ]
