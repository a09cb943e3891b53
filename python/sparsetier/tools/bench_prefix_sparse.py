"""`sparsetier bench prefix-sparse`: what a prefix hit moves host -> device under sparse
attention, at DeepSeek-V3.2's shape, over a grid of prefix and suffix lengths, for the three
restore choices and the core's restore policy between them:
- full restore: every prefix page's KV and Indexer-K, every layer, the KV in bulk (a copy a
  layer, as the policy's cost model counts it);
- Indexer-K only: every prefix page's Indexer-K (the indexer scores every past token), and the
  KV of the pages the suffix's selections name (per layer, the union over its tokens),
  loaded on demand, a copy each;
- predicted pages: Indexer-K, the KV of the pages the policy's position model expects
  selected (sinks, the window's end of the prefix) in bulk, and the rest on demand;
- the policy (`sparsetier._core.RestorePolicy`, the core's own): taught this model's coverage
  by requests of the other suffix lengths of the row (it has never seen this one), and again
  by one of this length.

The selections come from the parametric selection model, or are replayed from selections
recorded from a real model (`--selections`: `RecordedSelections`; only the cells within the
recording's length).

The selections come from the parametric selection model (`selection_model.py`), so the
figures are the model's expectations, not measurements of copies. Costs are the policy's:
bytes plus `copy_overhead` bytes a copy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from sparsetier._core import RestorePolicy
from sparsetier.tools.selection_model import RecordedSelections, SelectionModel

#: What a copy's fixed cost is worth, in bytes: the cpu engine's default in the core (the
#: kernel engine's is 2 KiB, `direct`'s 192 KiB; `--copy-overhead`).
COPY_OVERHEAD = 16 << 10


@dataclass(frozen=True)
class PrefixSparseConfig:
    layers: int = 61
    kv_token_bytes: int = 656  # per token and layer: FP8 MLA latent, scales and RoPE part
    idx_token_bytes: int = 132  # per token and layer: FP8 Indexer-K and its scale
    # The parametric model, or selections recorded from a real model (`--selections`).
    model: SelectionModel | RecordedSelections = field(default_factory=SelectionModel)
    prefixes: tuple[int, ...] = (8192, 16384, 32768, 65536, 131072)
    suffixes: tuple[int, ...] = (16, 64, 256, 1024, 4096)
    copy_overhead: int = COPY_OVERHEAD
    # The context, tokens, over which the report gives the model's adjacent-token overlap.
    overlap_context: int = 65536

    def __post_init__(self):
        for name in ("layers", "kv_token_bytes", "idx_token_bytes", "overlap_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: allowed >= 1")
        if self.copy_overhead < 0:
            raise ValueError(f"copy_overhead = {self.copy_overhead}: allowed >= 0")
        for name in ("prefixes", "suffixes"):
            vals = getattr(self, name)
            if not vals or min(vals) < 1:
                raise ValueError(f"{name} = {vals}: allowed one or more lengths >= 1")


@dataclass(frozen=True)
class Cell:
    prefix: int
    suffix: int
    union_pages: float  # expected prefix pages a layer's suffix selections name
    full_bytes: float
    full_copies: float
    idx_only_bytes: float
    idx_only_copies: float
    full_cost: float
    idx_only_cost: float
    # The predicted restore (its pages as the policy, taught this length, predicts them).
    pred_pages: int
    pred_bytes: float
    pred_copies: float
    pred_cost: float
    # The policy's choice and cost, taught by the row's other suffix lengths; then by this one.
    policy_unseen: str
    policy_unseen_cost: float
    policy_seen: str
    policy_seen_cost: float

    @property
    def full_over_idx_only(self) -> float:
        return self.full_bytes / self.idx_only_bytes

    @property
    def best_cost(self) -> float:
        return min(self.full_cost, self.idx_only_cost, self.pred_cost)


def _predicted(probs, bulk_pages: list[int], layers: int, object_bytes: int, ov: int):
    """A predicted restore of `bulk_pages` where each page is selected with `probs`: (objects
    in bulk, objects then expected on demand, the KV part of its cost)."""
    bulk = len(bulk_pages) * layers
    rest = float(probs.sum() - probs[bulk_pages].sum()) * layers
    return bulk, rest, bulk * object_bytes + layers * ov + rest * (object_bytes + ov)


def run(cfg: PrefixSparseConfig = PrefixSparseConfig()) -> list[Cell]:
    ps, layers, ov = cfg.model.page_size, cfg.layers, cfg.copy_overhead
    object_bytes = ps * cfg.kv_token_bytes
    cells = []
    recorded = isinstance(cfg.model, RecordedSelections)
    for p in cfg.prefixes:
        pages = -(-p // ps)
        objects = pages * layers
        # A recording covers the cells within its length only.
        suffixes = [s for s in cfg.suffixes if not recorded or cfg.model.covers(p, s)]
        probs = {s: cfg.model.page_probs(p, s) for s in suffixes}
        absent = [layers] * pages  # every layer of every page is off the device
        # What a request of each suffix length loaded, page by page (every layer counted).
        loaded = {s: [round(x * layers) for x in probs[s]] for s in suffixes}

        def taught(mode: str, lengths: list[int], absent=absent, loaded=loaded) -> RestorePolicy:
            """A policy in `mode` that saw one request of each of `lengths`."""
            pol = RestorePolicy(mode, ov)
            for other in lengths:
                pol.learn(other, absent, loaded[other])
            return pol

        idx_bytes = p * layers * cfg.idx_token_bytes  # the same under every choice
        for s in suffixes:
            u = float(probs[s].sum())
            full = p * layers * (cfg.kv_token_bytes + cfg.idx_token_bytes)
            idx_only = idx_bytes + u * layers * object_bytes
            # The KV part of each choice's cost, as the policy counts it.
            full_cost = objects * object_bytes + layers * ov
            idx_cost = u * layers * (object_bytes + ov)

            def cost(choice: str, bulk_pages: list[int], pr=probs[s], fc=full_cost, ic=idx_cost):
                if choice == "full":
                    return fc
                if choice == "indexer" or not bulk_pages:
                    return ic
                return _predicted(pr, bulk_pages, layers, object_bytes, ov)[2]

            picks = []
            others = [x for x in suffixes if x != s]
            for lengths in (others, suffixes):  # unseen, then seen
                d = taught("auto", lengths).decide(absent, layers, s, object_bytes)
                picks.append((d["choice"], cost(d["choice"], d["pages"])))
            unseen, seen = picks
            # The fixed predicted choice, by the same model taught this length too.
            fixed = taught("predicted", suffixes)
            pred_pages = fixed.decide(absent, layers, s, object_bytes)["pages"]
            bulk, rest, _ = _predicted(probs[s], pred_pages, layers, object_bytes, ov)
            cells.append(
                Cell(
                    prefix=p,
                    suffix=s,
                    union_pages=u,
                    full_bytes=full,
                    full_copies=2 * pages * layers,
                    idx_only_bytes=idx_only,
                    idx_only_copies=(pages + u) * layers,
                    full_cost=full_cost,
                    idx_only_cost=idx_cost,
                    pred_pages=len(pred_pages),
                    pred_bytes=idx_bytes + (bulk + rest) * object_bytes,
                    pred_copies=pages * layers + (layers if pred_pages else 0) + rest,
                    pred_cost=cost("predicted", pred_pages),
                    policy_unseen=unseen[0],
                    policy_unseen_cost=unseen[1],
                    policy_seen=seen[0],
                    policy_seen_cost=seen[1],
                )
            )
    return cells


def format_report(cfg: PrefixSparseConfig, cells: list[Cell]) -> str:
    m = cfg.model
    source = (
        _recorded_source(m, cfg.overlap_context)
        if isinstance(m, RecordedSelections)
        else f"{m.sink_pages} sink page, {m.window}-token window, Zipf s={m.zipf_s}, "
        f"churn {m.churn:.4g}: adjacent tokens share "
        f"{m.adjacent_overlap(cfg.overlap_context):.1%} of their pages over "
        f"{cfg.overlap_context} tokens"
    )
    lines = [
        f"prefix restore: {cfg.layers} layers, "
        f"{cfg.kv_token_bytes} B KV + {cfg.idx_token_bytes} B Indexer-K per token and layer, "
        f"{m.page_size}-token pages, top-{m.topk_pages * m.page_size} "
        f"({source}); costs: KV bytes + {cfg.copy_overhead} B a copy",
        f"{'prefix':>8} {'suffix':>7} {'union pages':>12} {'full GiB':>9} "
        f"{'idx-only GiB':>13} {'full/idx-only':>14} {'pred pages':>10} {'pred cost/idx':>13}  "
        f"{'policy (unseen / seen)':>24} {'cost / best':>12}",
    ]
    for c in cells:
        lines.append(
            f"{c.prefix:>8} {c.suffix:>7} {c.union_pages:>12.1f} {c.full_bytes / 2**30:>9.3f} "
            f"{c.idx_only_bytes / 2**30:>13.3f} {c.full_over_idx_only:>13.2f}x "
            f"{c.pred_pages:>10} {c.pred_cost / c.idx_only_cost:>13.3f}  "
            f"{c.policy_unseen:>11} / {c.policy_seen:<10} "
            f"{c.policy_unseen_cost / c.best_cost:>5.2f} / {c.policy_seen_cost / c.best_cost:.2f}"
        )
    worst = max(max(c.policy_unseen_cost, c.policy_seen_cost) / c.best_cost for c in cells)
    lines.append(f"worst policy cost / better fixed choice: {worst:.3f}")
    return "\n".join(lines)


def _recorded_overlap(m: RecordedSelections, context: int) -> float | None:
    """The recording's adjacent-token page overlap from `context` on, where it reaches that
    far."""
    return m.adjacent_overlap(context) if context < m.tokens - 1 else None


def _recorded_source(m: RecordedSelections, context: int) -> str:
    overlap = _recorded_overlap(m, context)
    if overlap is None:
        return f"recorded selections ({m.tokens} tokens)"
    return (
        f"recorded selections ({m.tokens} tokens; adjacent tokens share {overlap:.1%} of their "
        f"pages from {context})"
    )


def to_json(cfg: PrefixSparseConfig, cells: list[Cell]) -> dict:
    config = {k: v for k, v in cfg.__dict__.items() if k != "model"}
    config["model"] = (
        {"recorded_tokens": cfg.model.tokens, "page_size": cfg.model.page_size}
        | {"adjacent_overlap": _recorded_overlap(cfg.model, cfg.overlap_context)}
        if isinstance(cfg.model, RecordedSelections)
        else asdict(cfg.model)
        | {"adjacent_overlap": cfg.model.adjacent_overlap(cfg.overlap_context)}
    )
    return {
        "config": config,
        "cells": [
            asdict(c) | {"full_over_idx_only": c.full_over_idx_only, "best_cost": c.best_cost}
            for c in cells
        ],
    }


def lru_report(cfg: PrefixSparseConfig, ratio: float, query_tokens: int) -> dict:
    """A decode-side LRU holding `ratio` of the context, at each prefix length of the grid
    as the context: the tokens a step of `query_tokens` query tokens misses
    (`lru_misses`)."""
    from sparsetier.tools.lru_misses import lru_misses

    return {
        "ratio": ratio,
        "query_tokens": query_tokens,
        "misses_per_step": {
            str(ctx): lru_misses(cfg.model, ctx, int(ratio * ctx), query_tokens=query_tokens)
            for ctx in cfg.prefixes
        },
    }


def format_lru(lru: dict) -> str:
    misses = ", ".join(f"{ctx}: {m:.0f}" for ctx, m in lru["misses_per_step"].items())
    return (
        f"decode LRU holding {lru['ratio']:g} of the context, {lru['query_tokens']} query "
        f"token(s) a step: tokens missed a step by context: {misses}"
    )
