"""The pieces `StepScheduler` and `HiCache` are built from, for those who build their own
runtime: the residency directory and its results, the page allocator, prepared page
transfers, object keys, trace replay, the CUDA kernels' cubins, and a prefix cache's side of
the L3 protocol (`L3Protocol`).

An engine that uses `StepScheduler`, `HiCache` or `sparsetier.vllm` needs none of this. Here
the caller owns what the core owns there: it completes the transfers it starts and releases
the pins it takes (`docs/api.md`, "Low level").
"""

from __future__ import annotations

from typing import Any

from sparsetier._core import (
    BackupPlan,
    HiCache,
    LoadPlan,
    PageAllocator,
    PageTransferGroup,
    PinHandle,
    PreparedPageTransfer,
    ResidencyDirectory,
    ResolveResult,
    TransferHandle,
    compile_cuda_kernels,
    kernel_cubin,
    replay_trace,
    token_pages,
    trace_peak_live,
)
from sparsetier.keys import ALL_LAYERS, object_keys


class L3Protocol:
    """A `HiCache`'s side of the L3 protocol, what `sparsetier.l3.StorageController` drives,
    for an L3 controller of your own. The cache plans (which pages to write, which host pages
    a prefetch fills); the controller moves the bytes and reports back. Every plan taken is
    ended exactly once (`write_done`; `prefetch_commit` then `prefetch_end`), or its host
    pages stay pinned."""

    __slots__ = ("_c",)

    def __init__(self, cache: HiCache) -> None:
        self._c = cache

    def set_online(self, online: bool) -> None:
        """The store is reachable (or not: no new plans; write-back evicts without writing)."""
        self._c._set_storage_online(online)

    def write_ahead(self) -> int:
        """Plans writes of the least recently used host pages the store lacks while too few
        host pages are free; how many it planned."""
        return self._c._storage_write_ahead()

    def take_writes(self) -> list[tuple[int, list[str], Any]]:
        """The write plans queued since the last call: `(plan_id, keys, host_pages)` each."""
        return self._c._take_storage_writes()

    def write_done(self, plan_id: int, ok: list[bool]) -> None:
        """Ends write `plan_id`: `ok[i]` says whether its page i was stored."""
        self._c._storage_write_done(plan_id, ok)

    def plan_prefetch(
        self, tokens: Any, start_page: int, n_pages: int, namespace: int | None = None
    ) -> tuple[int, list[str], Any] | None:
        """Plans a prefetch of pages `start_page..start_page + n_pages` of `tokens` into host
        pages: `(plan_id, keys, host_pages)`, possibly fewer pages, or None."""
        return self._c._plan_prefetch(tokens, start_page, n_pages, namespace)

    def prefetch_commit(self, plan_id: int, arrived: int) -> int:
        """Inserts the first `arrived` pages of prefetch `plan_id` (complete, verified) as host
        copies; how many the tree took. Once per prefetch, before `prefetch_end`."""
        return self._c._prefetch_commit(plan_id, arrived)

    def prefetch_end(self, plan_id: int) -> None:
        """Ends prefetch `plan_id` once nothing writes its pages: frees what was not committed."""
        self._c._prefetch_end(plan_id)

    def host_segments(self, page: int) -> list[tuple[int, int]]:
        """The byte ranges `(address, length)` of host page `page` in every pool, in the
        store's order."""
        return self._c._host_segments(page)


__all__ = [
    "ALL_LAYERS",
    "BackupPlan",
    "L3Protocol",
    "LoadPlan",
    "PageAllocator",
    "PageTransferGroup",
    "PinHandle",
    "PreparedPageTransfer",
    "ResidencyDirectory",
    "ResolveResult",
    "TransferHandle",
    "compile_cuda_kernels",
    "kernel_cubin",
    "object_keys",
    "replay_trace",
    "token_pages",
    "trace_peak_live",
]
