"""A small step scheduler on the cpu engine, its requests prefilled and settled: what the
Python tests of `plan`, `plan_csr` and the token mapping start from; a small joined one; and a
small HiCache over one pool on both tiers."""

from __future__ import annotations

import torch

import sparsetier as st


def small_scheduler(
    page_size: int, device_pages: int, host_pages: int, layers: int, requests: dict[int, int]
) -> st.StepScheduler:
    """A scheduler over one-plane bf16 pools (8 heads) with `requests` (rid -> tokens)
    prefilled, the step ended and every write-through landed."""
    spec = st.PoolSpec("KV", 1, 1, 8, "bf16", page_size, device_pages)
    host_spec = spec.with_pages(host_pages)
    dev = torch.zeros(spec.shape(), dtype=torch.bfloat16)
    host = torch.zeros(host_spec.shape(), dtype=torch.bfloat16)
    s = st.StepScheduler(
        st.PageTransferBinding(dev, spec), st.PageTransferBinding(host, host_spec),
        st.TransferEngine("cpu"), layers=layers, prefetch=False,
    )  # fmt: skip
    for rid, n in requests.items():
        s.add_request(rid, n)
    s.end_step()
    s.drain()
    return s


def end_steps_alike(a: st.StepScheduler, b: st.StepScheduler, fields, *context) -> None:
    """Ends the step of two schedulers fed the same rows and checks that their records agree
    on `fields`. Both drain first: write-throughs land when they land and decide what the
    next step may evict, so settled between steps, both evict alike."""
    ra, rb = a.end_step(), b.end_step()
    a.drain()
    b.drain()
    for f in fields:
        assert ra[f] == rb[f], (f, *context, ra, rb)


def small_joined(page_size: int = 4, layers: int = 2, pages: int = 24) -> st.StepScheduler:
    """A joined scheduler (main KV host-resident, Indexer-K on both tiers) on bf16 pools."""
    kv = st.PoolSpec("KV", 1, 1, 8, "bf16", page_size, pages)
    kv_host = st.PoolSpec("KV", layers, 1, 8, "bf16", page_size, pages)
    ik = st.PoolSpec("INDEXER", layers, 1, 8, "bf16", page_size, pages)
    return st.StepScheduler.joined(
        st.PageTransferBinding(torch.zeros(kv.shape(), dtype=torch.bfloat16), kv),
        st.PageTransferBinding(torch.zeros(kv_host.shape(), dtype=torch.bfloat16), kv_host),
        st.TransferEngine("cpu"),
        indexer_device=st.PageTransferBinding(torch.zeros(ik.shape(), dtype=torch.bfloat16), ik),
        indexer_host=st.PageTransferBinding(torch.zeros(ik.shape(), dtype=torch.bfloat16), ik),
    )


def pooled_hicache(page_size: int, pages: int = 8):
    """A HiCache over one bf16 KV pool on both tiers and the cpu engine: the cache, its engine
    and the device and host bindings."""
    kv = st.PoolSpec("KV", 1, 1, 8, "bf16", page_size, pages)
    e = st.TransferEngine("cpu")
    dev = st.PageTransferBinding(torch.zeros(kv.shape(), dtype=torch.bfloat16), kv)
    host = st.PageTransferBinding(torch.zeros(kv.shape(), dtype=torch.bfloat16), kv)
    c = st.HiCache(page_size, pages, host_pages=pages, pools=[(dev, host, None)], engine=e)
    return c, e, dev, host
