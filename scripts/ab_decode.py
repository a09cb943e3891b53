"""Two builds of the extension in one process: `bench decode`'s scheduler step, paired.

    python scripts/ab_decode.py A/_core.abi3.so B/_core.abi3.so [--steps 24] [--locality 0.9]

Builds one step-scheduler stack per build (same shape, contexts and seed as `sparsetier bench
decode --mode block`), feeds both the same selections and alternates their steps (A, B then
B, A), so the VM's drift hits both sides alike. Reports each side's median CPU time per step
(the time blocked on copies taken out, as the bench does) and the median of the per-step
ratios B / A; checks that both sides selected and loaded the same pages every step.

How to get a build's library: `maturin build --release -o DIR` in a checkout of that commit,
then unzip the wheel (`sparsetier/_core.abi3.so`).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import math
import statistics
import time

import numpy as np
import torch

from sparsetier.bench_decode import DecodeBenchConfig, Selections


def load(path: str):
    """The extension module at `path` (a second copy of `sparsetier._core` can load beside
    the first: each build is its own shared object)."""
    loader = importlib.machinery.ExtensionFileLoader("sparsetier._core", path)
    spec = importlib.util.spec_from_file_location("sparsetier._core", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def stack(m, cfg: DecodeBenchConfig, lens: np.ndarray, device_pages: int, host_pages: int):
    spec = m.PoolSpec("KV", 1, 1, 1, "bf16", cfg.page_size, device_pages)
    host_spec = spec.with_pages(host_pages)
    dev = torch.zeros(spec.shape(), dtype=torch.bfloat16)
    host = torch.zeros(host_spec.shape(), dtype=torch.bfloat16)
    engine = m.TransferEngine("cpu", threads=1)
    s = m.StepScheduler(
        m.PageTransferBinding(dev, spec),
        m.PageTransferBinding(host, host_spec),
        engine,
        layers=cfg.layers,
        prefetch=False,
    )
    for rid, n in enumerate(lens):
        s.add_request(rid, int(n))
    s.drain()
    return s, (dev, host, engine)  # the tensors and engine live as long as the scheduler


def step(s, rids: np.ndarray, sel: np.ndarray, unit: int) -> tuple[float, dict]:
    pc = time.perf_counter
    t = pc()
    s.append(rids)
    for layer in range(sel.shape[0]):
        plan, _table = s.plan(layer, rids, sel[layer], unit)
        s.ready(plan)
        s.finish(plan)
    rec = s.end_step()
    return (pc() - t - rec["exposed_wait_ns"] / 1e9) * 1e3, rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="build A's _core shared object")
    ap.add_argument("b", help="build B's _core shared object")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--locality", type=float, default=0.9)
    args = ap.parse_args()
    mods = load(args.a), load(args.b)
    cfg = DecodeBenchConfig(mode="block", steps=args.steps, locality=args.locality)
    cfg.check()
    rng = np.random.default_rng(cfg.seed)
    lens = rng.integers(cfg.context_min, cfg.context_max + 1, cfg.batch)
    total = cfg.warmup + cfg.steps
    pages = int((-(-(lens + total) // cfg.page_size)).sum()) * cfg.layers
    device_pages = max(
        math.ceil(cfg.budget * pages),
        cfg.batch * cfg.layers * 2 + cfg.batch * max(cfg.blocks, cfg.token_pages) * 2 + 16,
    )
    host_pages = pages + cfg.batch * cfg.layers
    stacks = [stack(m, cfg, lens, device_pages, host_pages)[0] for m in mods]
    sels = Selections(cfg, lens)
    rids = np.arange(cfg.batch, dtype=np.int64)
    times: list[list[float]] = [[], []]
    for i in range(total):
        sel = sels.next()
        recs = [None, None]
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            ms, recs[side] = step(stacks[side], rids, sel, cfg.page_size)
            if i >= cfg.warmup:
                times[side].append(ms)
        same = all(recs[0][k] == recs[1][k] for k in ("pages", "loaded", "selected"))
        assert same, f"step {i}: the builds disagree: {recs[0]} / {recs[1]}"
    a, b = times
    ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
    print(
        f"locality {args.locality}, {args.steps} steps: A {statistics.median(a):.2f} ms | "
        f"B {statistics.median(b):.2f} ms | B/A {ratio:.3f} (median of per-step ratios)"
    )


if __name__ == "__main__":
    main()
