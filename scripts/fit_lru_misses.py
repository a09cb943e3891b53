"""Fits the selection model's churn to published decode-cache miss counts, layer by layer, and
gives the prefix restore they imply.

Input: a JSON file with `misses` (one count a layer: tokens a decode step missed in an LRU
holding `--ratio` of the context). For each layer, the churn whose simulated misses match
(`sparsetier.tools.lru_misses`, interpolated over a grid of churns), and that churn's union for
a `--suffix`-token turn over a `--context`-token prefix. Prints the mean union over the layers
and full restore / Indexer-K only, with the single churn that fits the mean count beside it.

    python scripts/fit_lru_misses.py benches/results/2026-12-04-ess-fig5-misses.json \\
        --context 32768 --ratio 0.2 --query-tokens 3
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from sparsetier.tools.bench_prefix_sparse import PrefixSparseConfig
from sparsetier.tools.lru_misses import lru_misses
from sparsetier.tools.selection_model import SelectionModel

CHURNS = [0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("misses", help="JSON with `misses`: one count a layer")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--ratio", type=float, default=0.2, help="the cache's share of the context")
    ap.add_argument("--query-tokens", type=int, default=1, help="query tokens a decode step")
    ap.add_argument("--suffix", type=int, default=256, help="the turn's tokens")
    ap.add_argument("--zipf-s", type=float, default=SelectionModel.zipf_s)
    a = ap.parse_args()
    with open(a.misses) as f:
        counts = np.asarray(json.load(f)["misses"], dtype=np.float64)
    models = [SelectionModel(churn=c, zipf_s=a.zipf_s) for c in CHURNS]
    cap = int(a.ratio * a.context)
    sim = np.array([lru_misses(m, a.context, cap, query_tokens=a.query_tokens) for m in models])
    pages = -(-a.context // models[0].page_size)
    union = np.array([m.prefix_union(a.context, a.suffix) / pages for m in models])
    cfg = PrefixSparseConfig()
    kv, idx = cfg.kv_token_bytes, cfg.idx_token_bytes

    def ratio(u: float) -> float:
        return (kv + idx) / (idx + kv * u)

    churns = np.interp(counts, sim, CHURNS)  # (counts past churn 1's are read as churn 1)
    per_layer = float(np.interp(churns, CHURNS, union).mean())
    one = float(np.interp(counts.mean(), sim, CHURNS))
    one_union = float(np.interp(one, CHURNS, union))
    print(
        f"{counts.size} layers, mean {counts.mean():.0f} misses a step; LRU of {a.ratio:g} of "
        f"{a.context} tokens, {a.query_tokens} query token(s) a step; zipf_s {a.zipf_s}"
    )
    pairs = zip(CHURNS, sim, strict=True)
    print("simulated misses by churn: " + ", ".join(f"{c}: {m:.0f}" for c, m in pairs))
    print(
        f"per-layer fit: mean union {per_layer:.3f} of the prefix -> full / Indexer-K only "
        f"{ratio(per_layer):.2f}x for a {a.suffix}-token turn; "
        f"{int((counts > sim[-1]).sum())} layer(s) past churn 1"
    )
    print(f"one churn for all layers: {one:.3f}, union {one_union:.3f} -> {ratio(one_union):.2f}x")


if __name__ == "__main__":
    main()
