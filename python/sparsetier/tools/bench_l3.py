"""``sparsetier bench l3``: the L3 tier on its real stores.

1. **Throughput**: put and get of whole pages (every pool of the page) through each backend,
   batches of ``batch`` pages, against a memcpy of the same bytes measured alternately in the
   same process (A, B, A, B...): the median paired ratio says how close to a plain copy the
   store gets.
2. **Serve**: the peers' shared-prefix workload (``sparsetier.tools.workload``) through one
   ``HiCache`` whose host tier is too small for the working set, once without L3 and once per
   backend, same stream, same process. Reported: the prefix hit rate per tier and the
   TTFT proxy, pages each request must recompute (its whole pages not found on any tier).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import numpy as np

import sparsetier as st
from sparsetier.errors import OutOfPagesError
from sparsetier.lowlevel import L3Protocol
from sparsetier.tools.workload import Workload, WorkloadSpec


def _mooncake() -> Any:
    from sparsetier.l3 import MooncakeMaster

    return MooncakeMaster()


def _stack(backend: str | None, where: Any, *, page_size: int, device: int, host: int,
           layers: int, heads: int, dim: int, segment_mb: int = 512) -> st.SparseStack:  # fmt: skip
    pools = [
        st.PoolSpec("KV", layers, heads, dim, "bf16", page_size, device),
        st.PoolSpec("INDEXER", layers, 1, 128, "bf16", page_size, device),
    ]
    cfg: dict[str, Any] | None = None
    if backend == "file":
        cfg = {"path": str(where)}
    elif backend == "mooncake":
        cfg = {
            "master": where.master,
            "metadata_server": where.metadata_server,
            "global_segment_size": segment_mb << 20,
            "local_buffer_size": 64 << 20,
        }
    return st.build_sparse_stack(
        pools,
        hicache_ratio=host / device,
        layout="layer_page_first",
        device_reserve=1,
        storage_backend=backend,
        storage_config=cfg,
    )


def throughput(
    backends: list[str], *, pages: int = 256, batch: int = 16, reps: int = 5
) -> list[dict]:
    """Put/get GB/s per backend, with the paired memcpy ratio."""
    rows = []
    for b in backends:
        with tempfile.TemporaryDirectory() as d:
            master = _mooncake() if b == "mooncake" else None
            try:
                s = _stack(b, master or d, page_size=64, device=pages + 1, host=pages + 1,
                           layers=8, heads=2, dim=128)  # fmt: skip
                rows += _throughput_one(s, b, pages, batch, reps)
                s.storage.close()
            finally:
                if master is not None:
                    master.stop()
    return rows


def _throughput_one(s: st.SparseStack, name: str, pages: int, batch: int, reps: int) -> list[dict]:
    c, backend = s.hicache, s.storage.backend
    rng = np.random.default_rng(0)
    for t in s.host_pools.values():
        t.view(-1).copy_(st_random(t.numel(), rng).view(t.dtype))
    host = L3Protocol(c).plan_prefetch(np.arange(1, 64 * pages + 1), 0, pages)  # borrow host pages
    assert host is not None
    plan_id, _, hp = host
    segs = [L3Protocol(c).host_segments(int(h)) for h in hp]
    page_bytes = sum(n for _, n in segs[0])
    src = np.frombuffer(bytes(page_bytes * batch), dtype=np.uint8).copy()
    dst = np.empty_like(src)
    out = []
    for op in ("put", "get"):
        store_s, copy_s = [], []
        for r in range(reps):
            keys = [f"bench-{name}-{r}-{i:06d}" for i in range(pages)]
            if op == "get":
                keys = [f"bench-{name}-0-{i:06d}" for i in range(pages)]
            t0 = time.perf_counter()
            for at in range(0, pages, batch):
                ok = getattr(backend, op)(keys[at : at + batch], segs[at : at + batch])
                assert all(ok), f"{name} {op} failed"
            store_s.append(time.perf_counter() - t0)
            if op == "put" and r > 0:
                backend.remove(keys)  # the store's capacity holds one repetition
            t0 = time.perf_counter()
            for _ in range(0, pages, batch):
                np.copyto(dst, src)
            copy_s.append(time.perf_counter() - t0)
        total = page_bytes * pages
        ratios = [cs / ss for ss, cs in zip(store_s, copy_s, strict=True)]
        out.append({
            "backend": name, "op": op, "page_bytes": page_bytes,
            "segments_per_page": len(segs[0]), "pages": pages, "batch": batch,
            "gbps": total / statistics.median(store_s) / 1e9,
            "memcpy_gbps": total / statistics.median(copy_s) / 1e9,
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
        })  # fmt: skip
    L3Protocol(c).prefetch_commit(plan_id, 0)
    L3Protocol(c).prefetch_end(plan_id)
    return out


def st_random(n: int, rng: np.random.Generator) -> Any:
    import torch

    return torch.from_numpy(rng.integers(0, 256, size=n * 2, dtype=np.uint8)).view(torch.bfloat16)


def serve(backends: list[str], *, requests: int = 300, page_size: int = 16,
          device_pages: int = 1024, host_pages: int = 2048) -> list[dict]:  # fmt: skip
    """The serve loop with and without L3 on the same stream."""
    wl = Workload(WorkloadSpec(num_seqs=requests, align=page_size))
    stream = [t.astype(np.uint32) for _, t in wl.stream(requests, 3)]
    rows = []
    for b in [None, *backends]:
        with tempfile.TemporaryDirectory() as d:
            master = _mooncake() if b == "mooncake" else None
            try:
                s = _stack(b, master or d, page_size=page_size, device=device_pages,
                           host=host_pages, layers=2, heads=1, dim=64, segment_mb=1024)  # fmt: skip
                rows.append(_serve_one(s, b or "none", stream, page_size))
                if s.storage is not None:
                    s.storage.close()
            finally:
                if master is not None:
                    master.stop()
    return rows


def _serve_one(s: st.SparseStack, name: str, stream: list[np.ndarray], ps: int) -> dict:
    c, l3 = s.hicache, s.storage
    dev = host = l3_hit = total = recompute = failed = waits = 0
    per_req: list[int] = []
    t0 = time.perf_counter()
    for toks in stream:
        n = len(toks) // ps
        total += n
        m = l3.match_prefix(toks) if l3 else c.match_prefix(toks)
        got_l3 = 0
        if l3 is not None and m["storage_pages"]:
            start = (m["device_len"] + m["host_len"]) // ps
            p = l3.prefetch(toks, start, m["storage_pages"])
            if p is not None:
                got_l3 = l3.finish_prefetch(p, "wait_complete")
            l3.poll()
            m = c.match_prefix(toks)
        dev_p = m["device_len"] // ps
        host_p = m["host_len"] // ps - got_l3
        c.lock(m["last_node"])
        if m["host_len"] and c.load_back(m["last_node"]) is not None:
            c.flush()
            c.drain()
        fresh = None
        for attempt in range(2):
            m2 = c.match_prefix(toks)
            try:
                fresh = c.alloc_device(n - m2["device_len"] // ps)
                break
            except OutOfPagesError:
                if attempt:
                    break
                # Backpressure (both runs alike): device pages free up once their backups
                # land, which under write-back waits for host pages whose L3 writes run.
                waits += 1
                if l3 is not None:
                    l3.drain()
                c.flush()
                c.drain()
                c.evict_host(n)
                c.flush()
                c.drain()
        if fresh is None:
            failed += 1
            c.unlock(m["last_node"])
            continue
        c.insert(toks, np.concatenate([m2["device_pages"], fresh]))
        c.unlock(m["last_node"])
        c.flush()
        c.drain()  # the backup lands before the next request (a synchronous loop)
        if l3 is not None:
            l3.poll()
        dev += dev_p
        host += host_p
        l3_hit += got_l3
        miss = n - dev_p - host_p - got_l3
        recompute += miss
        per_req.append(miss)
    c.drain()
    if l3 is not None:
        l3.drain()
    c.validate()
    out = {
        "l3": name,
        "requests": len(stream),
        "failed": failed,
        "waits_for_l3": waits,
        "pages": total,
        "device_hit": dev / total,
        "host_hit": host / total,
        "l3_hit": l3_hit / total,
        "hit": (dev + host + l3_hit) / total,
        "recompute_pages_mean": float(np.mean(per_req)),
        "recompute_pages_p99": float(np.percentile(per_req, 99)),
        "seconds": time.perf_counter() - t0,
    }
    if l3 is not None:
        out["storage"] = l3.stats()
    return out


def run(backends: list[str] | None = None, *, requests: int = 300) -> dict:
    backends = backends or ["file", "mooncake"]
    return {
        "throughput": throughput(backends),
        "serve": serve(backends, requests=requests),
    }


def format_report(r: dict) -> str:
    lines = [
        "put/get of whole pages (every pool), batches of 16 pages, against a memcpy of the same",
        "bytes alternated in the same process",
        "",
        "backend   op   page KiB  segs  GB/s   memcpy GB/s  store/memcpy median (min-max)",
        "--------  ---  --------  ----  -----  -----------  -----------------------------",
    ]
    for t in r["throughput"]:
        lines.append(
            f"{t['backend']:<8}  {t['op']:<3}  {t['page_bytes'] / 1024:>8.0f}  "
            f"{t['segments_per_page']:>4}  {t['gbps']:>5.2f}  {t['memcpy_gbps']:>11.2f}  "
            f"{t['ratio_median']:.3f} ({t['ratio_min']:.3f}-{t['ratio_max']:.3f})"
        )
    lines += [
        "",
        "serve loop, host tier smaller than the working set (same stream); recompute = whole",
        "pages per request found on no tier (the TTFT proxy)",
        "",
        "L3        hit    device  host   L3     recompute mean  p99  waits  failed",
        "--------  -----  ------  -----  -----  --------------  ---  -----  ------",
    ]
    for s in r["serve"]:
        lines.append(
            f"{s['l3']:<8}  {s['hit']:.3f}  {s['device_hit']:>6.3f}  {s['host_hit']:.3f}  "
            f"{s['l3_hit']:.3f}  {s['recompute_pages_mean']:>14.1f}  "
            f"{s['recompute_pages_p99']:>3.0f}  {s['waits_for_l3']:>5}  {s['failed']:>6}"
        )
    return "\n".join(lines)
