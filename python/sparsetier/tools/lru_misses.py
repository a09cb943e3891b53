"""What a decode-side LRU of selected KV misses under the selection model.

Miss counts of such a cache are what has been published of a real sparse-attention model's
selections over time (ESS, arXiv 2512.10576, for DeepSeek-V3.2: misses a step against the
cache's share of the context). Simulating the same cache over the model makes its `churn`
comparable with them (benches/RESULTS.md, "Prefix hits under sparse attention").

A decode step's query tokens (one, plus the draft tokens under MTP) select pages by the
model's process, token after token: each keeps its predecessor's Zipf draws but with
probability `churn` and makes new ones. A cache of `capacity_tokens` slots holds the most
recently selected pages, whole (the model's selections are whole pages). A step's misses are
the tokens of the pages it selected that the cache did not hold when the step began (a cache
smaller than a step's selection then keeps the step's last pages). The context stays fixed (in
a few hundred steps the window moves one page in `page_size` tokens), and `steps` steps run
first, uncounted, to warm the cache (ESS warms its cache from the prefill's last selections).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from sparsetier.tools.selection_model import SelectionModel, _draws_for


def lru_misses(
    model: SelectionModel,
    context_tokens: int,
    capacity_tokens: int,
    *,
    query_tokens: int = 1,
    steps: int = 512,
    seed: int = 0,
) -> float:
    """Mean tokens a decode step misses in an LRU of `capacity_tokens` slots, over `steps`
    steps of `query_tokens` query tokens each, after as many warming steps (module docs).
    Deterministic for a `seed`."""
    for name, value, least in (
        ("context_tokens", context_tokens, 1),
        ("capacity_tokens", capacity_tokens, 0),
        ("query_tokens", query_tokens, 1),
        ("steps", steps, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} = {value!r}: allowed an integer >= {least}")
    ps = model.page_size
    pages = -(-context_tokens // ps)
    sinks = min(model.sink_pages, pages)
    window = min(model.window_pages, pages - sinks)
    rest = pages - sinks - window
    budget = model.topk_pages - model.sink_pages - model.window_pages
    fixed = list(range(sinks)) + list(range(pages - window, pages))
    if rest <= budget:
        fixed = list(range(pages))  # every token selects the whole context
    rng = np.random.default_rng(seed)
    draw = None
    held = np.zeros(0, np.int64)
    if rest > budget > 0:
        p = model._zipf(rest)
        cdf = np.cumsum(p)
        lam = _draws_for(p, budget)

        def draw(n: int) -> np.ndarray:
            return np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1]), rest - 1)

        held = draw(rng.poisson(lam))
    cache: OrderedDict[int, None] = OrderedDict()
    counted = []
    for step in range(2 * steps):
        selected = set(fixed)
        for _ in range(query_tokens if draw is not None else 0):
            held = held[rng.random(held.size) >= model.churn]
            held = np.concatenate([held, draw(rng.poisson(lam * model.churn))])
            selected.update((np.unique(held) + sinks).tolist())
        missed = lru_step(cache, sorted(selected), capacity_tokens // ps)
        if step >= steps:
            counted.append(missed * ps)
    return float(np.mean(counted))


def lru_step(cache: OrderedDict[int, None], selected: list[int], capacity: int) -> int:
    """One step of an LRU of `capacity` pages (`cache`, least recent first) that reads
    `selected`: returns how many of them it did not hold, then holds the `capacity` most
    recently read pages (this step's in the order given)."""
    missed = sum(page not in cache for page in selected)
    for page in selected:
        cache[page] = None
        cache.move_to_end(page)
    while len(cache) > capacity:
        cache.popitem(last=False)
    return missed
