"""`sparsetier bench prefix-sparse`: what a prefix hit moves host -> device under sparse
attention, at DeepSeek-V3.2's shape, over a grid of prefix and suffix lengths, for the two
fixed restore choices:
- full restore: every prefix page's KV and Indexer-K, every layer;
- Indexer-K only: every prefix page's Indexer-K (the indexer scores every past token), and the
  KV of the pages the suffix's selections name (per layer, the union over its tokens),
  loaded on demand.

The selections come from the parametric selection model (`selection_model.py`), so the
figures are the model's expectations, not measurements of copies. Reported per cell: bytes and
page copies of each choice, and full / Indexer-K-only bytes. The core's restore policy, which
would choose per admission between these and a restore of the pages the suffix is predicted
to select, is not built yet.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from sparsetier.tools.selection_model import SelectionModel


@dataclass(frozen=True)
class PrefixSparseConfig:
    layers: int = 61
    kv_token_bytes: int = 656  # per token and layer: FP8 MLA latent, scales and RoPE part
    idx_token_bytes: int = 132  # per token and layer: FP8 Indexer-K and its scale
    model: SelectionModel = field(default_factory=SelectionModel)
    prefixes: tuple[int, ...] = (8192, 16384, 32768, 65536, 131072)
    suffixes: tuple[int, ...] = (16, 64, 256, 1024, 4096)

    def __post_init__(self):
        for name in ("layers", "kv_token_bytes", "idx_token_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: allowed >= 1")
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

    @property
    def full_over_idx_only(self) -> float:
        return self.full_bytes / self.idx_only_bytes


def run(cfg: PrefixSparseConfig = PrefixSparseConfig()) -> list[Cell]:
    ps = cfg.model.page_size
    cells = []
    for p in cfg.prefixes:
        pages = -(-p // ps)
        for s in cfg.suffixes:
            u = cfg.model.prefix_union(p, s)
            full = p * cfg.layers * (cfg.kv_token_bytes + cfg.idx_token_bytes)
            idx_only = p * cfg.layers * cfg.idx_token_bytes + u * ps * cfg.layers * (
                cfg.kv_token_bytes
            )
            cells.append(
                Cell(
                    prefix=p,
                    suffix=s,
                    union_pages=u,
                    full_bytes=full,
                    full_copies=2 * pages * cfg.layers,
                    idx_only_bytes=idx_only,
                    idx_only_copies=(pages + u) * cfg.layers,
                )
            )
    return cells


def format_report(cfg: PrefixSparseConfig, cells: list[Cell]) -> str:
    m = cfg.model
    lines = [
        f"prefix restore bytes under the selection model: {cfg.layers} layers, "
        f"{cfg.kv_token_bytes} B KV + {cfg.idx_token_bytes} B Indexer-K per token and layer, "
        f"{m.page_size}-token pages, top-{m.topk_pages * m.page_size} "
        f"({m.sink_pages} sink page, {m.window}-token window, Zipf s={m.zipf_s}, "
        f"churn {m.churn})",
        f"{'prefix':>8} {'suffix':>7} {'union pages':>12} {'full GiB':>9} "
        f"{'idx-only GiB':>13} {'full/idx-only':>14}",
    ]
    for c in cells:
        lines.append(
            f"{c.prefix:>8} {c.suffix:>7} {c.union_pages:>12.1f} {c.full_bytes / 2**30:>9.3f} "
            f"{c.idx_only_bytes / 2**30:>13.3f} {c.full_over_idx_only:>13.2f}x"
        )
    lines.append("(the restore policy that would choose per admission is not built yet)")
    return "\n".join(lines)


def to_json(cfg: PrefixSparseConfig, cells: list[Cell]) -> dict:
    return {
        "config": asdict(cfg),
        "cells": [asdict(c) | {"full_over_idx_only": c.full_over_idx_only} for c in cells],
    }
