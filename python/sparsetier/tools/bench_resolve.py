"""`sparsetier bench decode --resolve device`: the joined scheduler's decode step with its layers
resolved on the device (one grant a step, the device resolver once a layer, no call into the
core) against the same step planned on the host (plan, ready, finish a layer), at `bench
decode`'s shape (DeepSeek-V3.2's by default: 61 layers, batch 64, 32k-128k contexts).

Two joined stacks get the same contexts and the same selections (`bench_decode.Selections`),
the order alternating each step (A, B then B, A) in one process. Reported: each side's host CPU
per step in the core (the step's wall time, the time blocked on copies and, on the device side,
the resolver's own time taken out), the median of the per-step ratios, and the resolver's time
apart. The resolver here is the reference implementation, on the CPU: its time is not what a
GPU would spend, and not the figure that counts; the core's is.

With `kernel_threads` (test builds: `make build`), the device side runs the CUDA kernel's own
source on that many CPU threads, through the protocol a GPU gets: the step's uploads (the
mirror's changes, the grant, what changed of the page tables) packed when it opens, its log
read back and followed when it closes. That host work is the core's on a GPU too, and is in
the core's time here; the device's work at those boundaries (the copies, fills and small
kernels, on the CPU here) is taken out, as the launches are.

Rows are one head of one dimension (the core's work does not depend on the row bytes), so a
stack at the default shape holds a few GB: the KV host pool, Indexer-K on device and host.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from sparsetier import _core
from sparsetier.errors import ConfigError
from sparsetier.tools.bench_decode import (
    WARMUP_CAP,
    DecodeBenchConfig,
    Selections,
    WarmUp,
    as_given,
    sizes,
)

PREFILL_CHUNK = 8192  # tokens a prefill extends at once (then written through)


class JoinedStack:
    """A joined scheduler at the bench's shape with every request admitted and prefilled."""

    def __init__(
        self,
        cfg: DecodeBenchConfig,
        lens: np.ndarray,
        device_pages: int,
        resolve,
        kernel_threads: int | None = None,
    ):
        ps, layers = cfg.page_size, cfg.layers
        # Every request's pages through the longest run (warm-up cap and timed steps), on
        # host (the KV host pool and Indexer-K's) and on the device (Indexer-K).
        steps_total = (WARMUP_CAP if cfg.warmup is None else cfg.warmup) + cfg.steps
        pages = int((-(-(lens + steps_total) // ps)).sum()) + cfg.batch * 2
        kv = _core.PoolSpec("KV", 1, 1, 1, "bf16", ps, device_pages)
        kv_host = _core.PoolSpec("KV", layers, 1, 1, "bf16", ps, pages)
        ik = _core.PoolSpec("INDEXER", layers, 1, 1, "bf16", ps, pages)
        self.tensors = [
            torch.zeros(kv.shape(), dtype=torch.bfloat16),
            torch.zeros(kv_host.shape(), dtype=torch.bfloat16),
            torch.zeros(ik.shape(), dtype=torch.bfloat16),
            torch.zeros(ik.shape(), dtype=torch.bfloat16),
        ]
        dev, host, idev, ihost = self.tensors
        self.engine = _core.TransferEngine("cpu", threads=1)
        self.s = _core.StepScheduler.joined(
            _core.PageTransferBinding(dev, kv),
            _core.PageTransferBinding(host, kv_host),
            self.engine,
            indexer_device=_core.PageTransferBinding(idev, ik),
            indexer_host=_core.PageTransferBinding(ihost, ik),
            prefetch=False,
        )
        self.resolver = self.s.enable_device_resolver() if resolve == "device" else None
        rng = np.random.default_rng(cfg.seed + 1)
        for rid, n in enumerate(lens.tolist()):
            # Distinct prompts: no prefix is shared, so every page is the request's own.
            toks = rng.integers(0, 1 << 31, n, dtype=np.int64)
            self.s.admit(rid, toks)
            done = 0
            while done < n:
                step = min(PREFILL_CHUNK, n - done)
                self.s.extend(rid, step)
                self.s.end_step()  # written through, so the next chunk finds room
                done += step
        self.s.drain()
        if kernel_threads is not None and self.resolver is not None:
            from sparsetier import testing

            testing.use_host_kernel(self.resolver, kernel_threads)

    def _device_ns(self) -> int:
        """The kernel's device time at step boundaries so far (0 on the reference)."""
        if self.resolver is None or not hasattr(self.resolver, "_kernel_device_ns"):
            return 0
        return self.resolver._kernel_device_ns() or 0

    def step(self, rids: np.ndarray, sel: np.ndarray, unit: int, tokens: bool) -> dict:
        """One timed step; returns the core's CPU (wall, less waits and the resolver's time),
        the resolver's time, and the record."""
        s, pc = self.s, time.perf_counter
        dev0 = self._device_ns()
        t = pc()
        s.append(rids)
        resolver_s = 0.0
        if self.resolver is not None and s.begin_device_step(rids, sel.shape[2]):
            # (The resolver takes int32: selections held as int64 are converted here, in
            # the device path's time.)
            sel32 = sel.astype(np.int32, copy=False)
            for layer in range(sel.shape[0]):
                r = pc()
                self.resolver.resolve(layer, rids, sel32[layer], tokens)
                resolver_s += pc() - r
        else:
            for layer in range(sel.shape[0]):
                plan, _ = s.plan(layer, rids, sel[layer], unit)
                s.ready(plan)
                s.finish(plan)
        rec = s.end_step()
        wall = pc() - t
        boundary_s = (self._device_ns() - dev0) / 1e9
        core_s = wall - resolver_s - boundary_s - rec["exposed_wait_ns"] / 1e9
        return {"core_s": core_s, "resolver_s": resolver_s, "boundary_s": boundary_s, "rec": rec}


def run(cfg: DecodeBenchConfig, progress: bool = False, kernel_threads: int | None = None) -> dict:
    """Builds the two stacks, warms them up and times `cfg.steps` paired steps; with
    `kernel_threads`, the device side runs the kernel's source on CPU threads (module docs)."""
    cfg.check()
    if kernel_threads is not None and not hasattr(_core.DeviceResolver, "_use_host_kernel"):
        raise ConfigError.of(
            "kernel_threads", str(kernel_threads), "a build with the host kernel (make build)"
        )
    lens, device_pages, _ = sizes(cfg)
    t0 = time.perf_counter()
    host = JoinedStack(cfg, lens, device_pages, "host")
    dev = JoinedStack(cfg, lens, device_pages, "device", kernel_threads)
    setup_s = time.perf_counter() - t0
    sels = Selections(cfg, lens)
    rids = np.arange(cfg.batch, dtype=np.int64)
    unit = cfg.page_size if cfg.mode == "block" else 1
    tokens = cfg.mode == "token"
    warm = WarmUp(cfg, device_pages)
    rows = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc=f"bench decode --resolve device ({cfg.mode})", unit="step")
    while len(rows) < cfg.steps:
        sel = as_given(cfg, sels.next())
        first, second = (host, dev) if (warm.steps + len(rows)) % 2 == 0 else (dev, host)
        a = first.step(rids, sel, unit, tokens)
        b = second.step(rids, sel, unit, tokens)
        rh, rd = (a, b) if first is host else (b, a)
        if warm.done():
            rows.append((rh, rd))
        else:
            warm.saw(rh["rec"])
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    host_ms = [r[0]["core_s"] * 1e3 for r in rows]
    dev_ms = [r[1]["core_s"] * 1e3 for r in rows]
    resolver_ms = [r[1]["resolver_s"] * 1e3 for r in rows]
    boundary_ms = [r[1]["boundary_s"] * 1e3 for r in rows]
    ratios = [d / h for h, d in zip(host_ms, dev_ms, strict=True)]
    totals = dev.s.device_stats()
    return {
        "config": {**vars(cfg), "resolve": "device", "kernel_threads": kernel_threads},
        "setup_s": setup_s,
        "warmup": warm.describe(),
        "device_pages": device_pages,
        "host_core_ms": statistics.median(host_ms),
        "device_core_ms": statistics.median(dev_ms),
        # The slowest timed step of each: a stall (a table growing, a page fault run) shows
        # here and nowhere in the medians.
        "host_core_max_ms": max(host_ms),
        "device_core_max_ms": max(dev_ms),
        "resolver_ms": statistics.median(resolver_ms),
        "boundary_device_ms": statistics.median(boundary_ms),
        "ratio_device_host": statistics.median(ratios),
        "device_steps": totals["steps"],
        "device_fallbacks": totals["fallbacks"],
        "host_loaded": sum(r[0]["rec"]["loaded"] for r in rows),
        "device_loaded": sum(r[1]["rec"]["loaded"] for r in rows),
        "steps": len(rows),
    }


def format_report(r: dict) -> str:
    c = r["config"]
    return "\n".join(
        [
            f"bench decode --resolve device: {c['mode']} mode, {c['layers']} layers, batch "
            f"{c['batch']}, contexts {c['context_min']}-{c['context_max']}, rows as "
            f"{c.get('entry_dtype', 'int64')}, "
            f"{r['device_pages']} device slots; {r['steps']} paired steps after a warm-up of "
            f"{r['warmup']}",
            f"core CPU per step   host-resolved {r['host_core_ms']:.2f} ms | device-resolved "
            f"{r['device_core_ms']:.2f} ms | device/host {r['ratio_device_host']:.3f} (median "
            "of per-step ratios)",
            f"slowest step        host-resolved {r['host_core_max_ms']:.2f} ms | "
            f"device-resolved {r['device_core_max_ms']:.2f} ms",
            (
                f"resolver            {r['resolver_ms']:.2f} ms a step (the reference "
                "implementation, on the CPU: not a GPU's time)"
                if c.get("kernel_threads") is None
                else f"resolver            {r['resolver_ms']:.2f} ms a step of launches, and "
                f"{r['boundary_device_ms']:.2f} ms of the device's work when steps open and "
                f"close (the kernel's source on {c['kernel_threads']} CPU threads: not a GPU's "
                "time; taken out of the core's)"
            ),
            f"pages loaded        host {r['host_loaded']} | device {r['device_loaded']}; "
            f"device steps {r['device_steps']}, planned on the host for want of a grant "
            f"{r['device_fallbacks']}",
        ]
    )
