"""Model presets: the cache formats of models whose shapes can be cited.

A preset names each pool's per-token row as parts (``values``, ``scales``, ``rope``) with
their dtypes, and its page layout: ``interleaved`` (each token's row whole, one after another)
or ``values_then_scales`` (all the page's values, then all its scales, as SGLang's DSA
Indexer-K page is laid out). The pools are byte pools of that row size (``fp8_e4m3``, one byte
per element, one plane per layer) carrying the row format (``PoolSpec(row_parts=...,
page_layout=...)``): plan, budget, bindings and whole-page transfers see a page as one byte
range per layer, and a token-granular transfer moves each part of a token's row from where the
core's geometry puts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsetier._checks import count
from sparsetier._core import PoolSpec
from sparsetier.errors import ConfigError

_ITEMSIZE = {"fp8_e4m3": 1, "bf16": 2, "fp16": 2, "fp32": 4}
_LAYOUTS = ("interleaved", "values_then_scales")


@dataclass(frozen=True)
class RowPart:
    """A named run of `count` elements of `dtype` in a token's row."""

    name: str
    dtype: str
    count: int

    def __post_init__(self) -> None:
        if self.dtype not in _ITEMSIZE:
            raise ConfigError.of("dtype", repr(self.dtype), ", ".join(_ITEMSIZE))
        count("count", self.count, 1)  # a float or negative count would size rows wrongly

    @property
    def bytes(self) -> int:
        return _ITEMSIZE[self.dtype] * self.count


@dataclass(frozen=True)
class RowFormat:
    """A pool's per-token row (per layer) and how a page lays its rows out."""

    parts: tuple[RowPart, ...]
    page_layout: str = "interleaved"  # or "values_then_scales"

    def __post_init__(self) -> None:
        if self.page_layout not in _LAYOUTS:
            raise ConfigError.of("page_layout", repr(self.page_layout), " or ".join(_LAYOUTS))

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.parts)

    def page_bytes(self, page_size: int) -> int:
        return self.bytes * count("page_size", page_size, 1)

    def core_parts(self) -> list[tuple[str, str, int]]:
        """The parts as ``PoolSpec(row_parts=...)`` takes them."""
        return [(p.name, p.dtype, p.count) for p in self.parts]

    def to_dict(self, page_size: int) -> dict:
        return {
            "parts": [
                {"name": p.name, "dtype": p.dtype, "count": p.count, "bytes": p.bytes}
                for p in self.parts
            ],
            "page_layout": self.page_layout,
            "token_bytes": self.bytes,
            "page_bytes": self.page_bytes(page_size),
        }


@dataclass(frozen=True)
class ModelPreset:
    name: str
    layers: int
    page_size: int
    kv: RowFormat
    indexer: RowFormat
    source: str

    def specs(self, pages: int) -> list[PoolSpec]:
        """The pool specs: byte pools of the rows' sizes, one plane per layer (MLA has no
        separate V; the Indexer-K is K only)."""
        return [
            PoolSpec(comp, self.layers, 1, row.bytes, "fp8_e4m3", self.page_size, pages,
                     planes_per_layer=1, row_parts=row.core_parts(),
                     page_layout=row.page_layout)
            for comp, row in (("KV", self.kv), ("INDEXER", self.indexer))
        ]  # fmt: skip

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "layers": self.layers,
            "page_size": self.page_size,
            "KV": self.kv.to_dict(self.page_size),
            "INDEXER": self.indexer.to_dict(self.page_size),
            "source": self.source,
        }


#: DeepSeek-V3.2 (DSA), as SGLang's DSA pools store it on CUDA: 61 layers, 64-token pages;
#: main KV (MLA, FP8) 656 B per token per layer = 512 FP8 latent values, 4 fp32 scales (one
#: per 128 values), 64 bf16 RoPE dims, each token's row whole; Indexer-K 128 FP8 values and
#: one fp32 scale per token (quant block 128), each 64-token page stored as 64 x 128 values
#: then 64 scales (8,448 B).
DEEPSEEK_V32 = ModelPreset(
    name="deepseek-v3.2",
    layers=61,
    page_size=64,
    kv=RowFormat(
        (
            RowPart("values", "fp8_e4m3", 512),  # the MLA latent
            RowPart("scales", "fp32", 4),
            RowPart("rope", "bf16", 64),
        )
    ),
    indexer=RowFormat(
        (RowPart("values", "fp8_e4m3", 128), RowPart("scales", "fp32", 1)),
        page_layout="values_then_scales",
    ),
    source="SGLang's DSA token-to-KV pools (kv_cache_dim 656; index_head_dim 128, "
    "quant block 128, 64-token pages), DeepSeek-V3.2-Exp config (61 layers)",
)

PRESETS = {p.name: p for p in (DEEPSEEK_V32,)}
