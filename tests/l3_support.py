"""Shared pieces of the L3 tests: stacks over a real backend (a directory, or a real
``mooncake_master`` on free localhost ports), data patterns, and a gate that holds a backend
call until the test releases it (fault and timing injection around the real store)."""

from __future__ import annotations

import subprocess
import threading

import numpy as np
import torch

import sparsetier as st
from sparsetier.l3 import StorageController
from sparsetier.l3.mooncake import find_master

PS = 4


def mooncake_skip_reason() -> str | None:
    exe = find_master()
    if exe is None:
        return "mooncake_master not installed (pip install mooncake-transfer-engine-non-cuda)"
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30)
    if "libibverbs" in r.stderr:
        return "mooncake_master needs libibverbs1 (apt-get install libibverbs1; make test does)"
    return None


def specs(device_pages: int = 16) -> list[st.PoolSpec]:
    return [
        st.PoolSpec("KV", 2, 2, 8, "bf16", PS, device_pages),
        st.PoolSpec("INDEXER", 2, 1, 16, "bf16", PS, device_pages),
        st.PoolSpec("DRAFT", 1, 1, 8, "fp32", PS, device_pages),
    ]


def stack(backend: str, where, *, layout="layer_first", host_ratio=1.0, device_pages=16, **cfg):
    """A stack whose L3 is the file store at `where` (a path) or the Mooncake master `where`."""
    if backend == "file":
        storage_config = {"path": str(where), **cfg}
    else:
        storage_config = {
            "master": where.master,
            "metadata_server": where.metadata_server,
            "global_segment_size": 64 << 20,
            "local_buffer_size": 16 << 20,
            **cfg,
        }
    return st.build_sparse_stack(
        specs(device_pages),
        hicache_ratio=host_ratio,
        layout=layout,
        device_reserve=1,
        storage_backend=backend,
        storage_config=storage_config,
    )


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, size=n)


PATTERNS = ("random", "zeros", "ones", "alternating", "index")


def fill(s, pages, pattern: str, seed: int) -> dict[str, torch.Tensor]:
    """Writes `pattern` into `pages` of every device pool; returns the bytes written."""
    idx = torch.as_tensor(np.asarray(pages), dtype=torch.long)
    out = {}
    g = torch.Generator().manual_seed(seed)
    for comp, t in s.device_pools.items():
        shape = t[:, :, idx].shape
        raw = t[:, :, idx].contiguous().view(torch.uint8)
        if pattern == "random":
            b = torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8)
        elif pattern == "zeros":
            b = torch.zeros_like(raw)
        elif pattern == "ones":
            b = torch.full_like(raw, 0xFF)
        elif pattern == "alternating":
            b = (
                torch.tensor([0xAA, 0x55], dtype=torch.uint8)
                .repeat(raw.numel() // 2)
                .view(raw.shape)
            )
        else:
            b = (torch.arange(raw.numel()) % 251).to(torch.uint8).view(raw.shape)
        data = b.view(t.dtype).view(shape)
        t[:, :, idx] = data
        out[comp] = data.clone()
    return out


def read(s, pages) -> dict[str, torch.Tensor]:
    idx = torch.as_tensor(np.asarray(pages), dtype=torch.long)
    return {comp: t[:, :, idx].clone() for comp, t in s.device_pools.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def insert(s, toks, pattern="random", seed=1) -> dict[str, torch.Tensor]:
    """A request's pages written, inserted and backed up to host."""
    c = s.hicache
    pages = c.alloc_device(len(toks) // PS)
    data = fill(s, pages, pattern, seed)
    c.insert(toks, pages)
    c.flush()
    c.drain()
    return data


def push_to_l3(s) -> None:
    """Moves everything in the tree out of L1 and L2 through L3 (write-back)."""
    c, l3 = s.hicache, s.storage
    c.evict_device(10**6)
    for _ in range(4):
        c.evict_host(10**6)
        l3.drain()
    c.evict_host(10**6)


def restore(s, toks, policy="wait_complete") -> tuple[int, dict[str, torch.Tensor] | None]:
    """Matches `toks`, prefetches what L3 holds, loads the prefix back; returns the pages
    restored and their device data (poisoned first: only restored bytes can match)."""
    c, l3 = s.hicache, s.storage
    for t in s.device_pools.values():
        t.view(torch.uint8).fill_(0xEE)
    m = l3.match_prefix(toks)
    cached = (m["device_len"] + m["host_len"]) // PS
    if m["storage_pages"]:
        p = l3.prefetch(toks, cached, m["storage_pages"])
        if p is not None:
            l3.finish_prefetch(p, policy)
    l3.drain()
    m = c.match_prefix(toks)
    if m["host_len"]:
        c.load_back(m["last_node"])
        c.flush()
        c.drain()
        m = c.match_prefix(toks)
    n = m["device_len"] // PS
    return n, (read(s, m["device_pages"]) if n else None)


class Gate:
    """Wraps a backend: each ``get``/``put`` call waits for a release first (or runs `hook`)."""

    def __init__(self, inner, *, hook=None, gated=("get",)):
        self.inner = inner
        self.name = inner.name
        self.hook = hook
        self.gated = gated
        self.sem = threading.Semaphore(0)
        self.calls = 0

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.sem.release()

    def _gate(self, op: str) -> None:
        if op in self.gated:
            self.calls += 1
            if self.hook is not None:
                self.hook(op, self.calls)
            else:
                self.sem.acquire()

    def exists(self, keys):
        return self.inner.exists(keys)

    def put(self, keys, pages):
        self._gate("put")
        return self.inner.put(keys, pages)

    def get(self, keys, pages):
        self._gate("get")
        return self.inner.get(keys, pages)

    def register(self, address, length):
        self.inner.register(address, length)

    def healthy(self):
        return self.inner.healthy()

    def close(self):
        self.inner.close()


def controller(s, backend, **kw) -> StorageController:
    """A second controller for `s`'s cache over `backend` (the builder's is closed first)."""
    s.storage.drain()
    # The same client as the builder's: its host memory is registered already.
    return StorageController(s.hicache, backend, **kw)
