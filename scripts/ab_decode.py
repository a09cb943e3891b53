"""Two builds of the extension in one process: `bench decode`'s scheduler step, paired.

    python scripts/ab_decode.py A/_core.abi3.so B/_core.abi3.so [--steps 24] [--locality 0.9]
        [--mode block|token] [--warmup N] [--csr] [--int32 a|b]

Builds one step-scheduler stack per build (same shape, contexts and seed as `sparsetier bench
decode --mode block`), feeds both the same selections and alternates their steps (A, B then
B, A), so the VM's drift hits both sides alike. The timed steps follow the bench's warm-up
(by default until A's device has turned over: the steady state). Reports each side's median
CPU time per step (the time blocked on copies taken out, as the bench does) and the median of
the per-step ratios B / A; checks that both sides selected the same pages every step, and in
block mode that they loaded the same (in token mode a build that keeps token selections pinned
evicts differently from one that does not). With `--csr` both plan each layer's rows as CSR
(`plan_csr`: the same rows, padding dropped, converted before the timer, as a caller holding
CSR rows would hand them). With `--int32 a` (or `b`) that side gets the same rows as int32,
converted before the timer: with one build on both sides, what int32 rows save.

The stacks are built in order (A's first), and where their memory lands differs: a build run
against itself gave 1.03, and one pair of builds 1.05 with either first. Run both orders and
read a ratio within a few percent of 1 as no change.

How to get a build's library: `maturin build --release -o DIR` in a checkout of that commit,
then unzip the wheel (`sparsetier/_core.abi3.so`).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics

import numpy as np

from sparsetier.tools.bench_decode import (
    DecodeBenchConfig,
    Selections,
    WarmUp,
    _stack,
    _step,
    _step_scheduler,
    sizes,
)


def load(path: str):
    """The extension module at `path` (a second copy of `sparsetier._core` can load beside
    the first: each build is its own shared object)."""
    loader = importlib.machinery.ExtensionFileLoader("sparsetier._core", path)
    spec = importlib.util.spec_from_file_location("sparsetier._core", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="build A's _core shared object")
    ap.add_argument("b", help="build B's _core shared object")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--locality", type=float, default=0.9)
    ap.add_argument("--mode", choices=("block", "token"), default="block")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default: auto)")
    ap.add_argument("--csr", action="store_true", help="plan the rows as CSR (plan_csr)")
    ap.add_argument("--int32", choices=("a", "b"), help="hand this side its rows as int32")
    args = ap.parse_args()
    cfg = DecodeBenchConfig(
        mode=args.mode, steps=args.steps, locality=args.locality, warmup=args.warmup
    )
    cfg.check()
    lens, device_pages, host_pages = sizes(cfg)
    stacks = [
        _stack(cfg, lens, device_pages, host_pages, core=load(path))[0] for path in (args.a, args.b)
    ]
    sels = Selections(cfg, lens)
    rids = np.arange(cfg.batch, dtype=np.int64)
    unit = cfg.page_size if cfg.mode == "block" else 1
    checked = ("selected", "pages", "loaded") if cfg.mode == "block" else ("selected", "pages")
    times: list[list[float]] = [[], []]
    warm = WarmUp(cfg, device_pages)
    i = 0
    while len(times[0]) < cfg.steps:
        sel = sels.next()
        given = [sel, sel]
        if args.int32 is not None:
            given["ab".index(args.int32)] = sel.astype(np.int32)
        rows = [csr_rows(g) for g in given] if args.csr else [None, None]
        recs = [None, None]
        timed = warm.done()
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            r = step(stacks[side], rids, given[side], rows[side], unit)
            recs[side] = r["rec"]
            if timed:
                times[side].append((r["wall_s"] - r["wait_s"]) * 1e3)
        if not timed:
            warm.saw(recs[0])
        same = all(recs[0][k] == recs[1][k] for k in checked)
        assert same, f"step {i}: the builds disagree: {recs[0]} / {recs[1]}"
        i += 1
    a, b = times
    ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
    print(
        f"{cfg.mode} mode{' as CSR' if args.csr else ''}"
        f"{f', {args.int32.upper()} given int32 rows' if args.int32 else ''}, "
        f"locality {args.locality}, "
        f"{args.steps} steps after a warm-up of "
        f"{warm.describe()}: "
        f"A {statistics.median(a):.2f} ms | B {statistics.median(b):.2f} ms | "
        f"B/A {ratio:.3f} (median of per-step ratios)"
    )


def csr_rows(sel: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each layer's padded rows `[B, K]` as CSR (offsets, entries in the rows' dtype), padding
    (-1) dropped."""
    out = []
    for layer in sel:
        valid = layer >= 0
        offsets = np.zeros(layer.shape[0] + 1, dtype=np.int64)
        np.cumsum(valid.sum(axis=1), out=offsets[1:])
        out.append((offsets, np.ascontiguousarray(layer[valid])))
    return out


def step(s, rids: np.ndarray, sel: np.ndarray, rows, unit: int) -> dict:
    """One timed step: padded rows (`plan`), or CSR ones (`plan_csr`) where `rows` is given."""
    if rows is None:
        return _step_scheduler(s, rids, sel, unit)
    return _step(
        s, rids, sel.shape[0], lambda layer: s.plan_csr(layer, rids, *rows[layer], unit)[0]
    )


if __name__ == "__main__":
    main()
