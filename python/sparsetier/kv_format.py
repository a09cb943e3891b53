"""How the decode runtime stores its caches: ``bf16`` (plain heads) or ``fp8`` (DeepSeek-V3.2's
way, on the tiny model's shapes).

``fp8``:

- main KV: each token's K (and V) row is the heads' FP8 e4m3 values, then one fp32 scale per
  head (quant block = head_dim), whole rows one after another (``interleaved``), like V3.2's
  656-byte MLA row of values, scales and RoPE;
- Indexer-K: FP8 values and one fp32 scale per token, each page holding all its tokens' values
  and then all their scales (``values_then_scales``), exactly V3.2's Indexer-K page.

The pools are byte pools carrying that row format, so the core moves them as bytes: whole pages
for loads and backups, and a token's two pieces separately where it moves tokens. Attention and
the indexer dequantize only the rows they gather. Tiered and resident runs quantize the same
values the same way, so the demo's bit-identity check holds in FP8 as in bf16.
"""

from __future__ import annotations

import torch

from sparsetier import fp8
from sparsetier._checks import count
from sparsetier._core import PoolSpec
from sparsetier.errors import ConfigError

KV_FORMATS = ("bf16", "fp8")


class KvFormat:
    """Plain bf16 heads: `[planes, layers, pages, page_size, heads, dim]` bf16 pools."""

    name = "bf16"
    dtype = torch.bfloat16

    def __init__(self, kv_heads: int, head_dim: int, indexer_dim: int) -> None:
        # Checked here: the fp8 rows are computed from them, so the core would only see
        # (and name) a row size the caller never gave.
        self.heads = count("kv_heads", kv_heads, 1)
        self.dim = count("head_dim", head_dim, 1)
        self.idim = count("indexer_dim", indexer_dim, 0)

    def kv_spec(self, layers: int, page_size: int, pages: int) -> PoolSpec:
        return PoolSpec("KV", layers, self.heads, self.dim, "bf16", page_size, pages)

    def indexer_spec(self, layers: int, page_size: int, pages: int) -> PoolSpec:
        return PoolSpec("INDEXER", layers, 1, self.idim, "bf16", page_size, pages)

    def write_kv(self, pool: torch.Tensor, plane: int, slots, rows, x: torch.Tensor) -> None:
        """Writes token rows `x` [N, heads, dim] at page `slots` [N], row `rows` [N]."""
        pool[plane, 0, slots, rows] = x.to(self.dtype)

    def gather_kv(self, pool: torch.Tensor, plane: int, rows: torch.Tensor) -> torch.Tensor:
        """Token rows at flat row indices `rows` (page * page_size + token), as float32
        [..., heads, dim]."""
        return pool[plane, 0].reshape(-1, self.heads, self.dim)[rows].to(torch.float32)

    def write_keys(self, indexer, hidden, positions, locs, pool: torch.Tensor, layer: int) -> None:
        indexer.store_key(hidden, positions, locs, pool, layer)

    def gather_keys(self, pool: torch.Tensor, layer: int, locs: torch.Tensor) -> torch.Tensor:
        return pool[0, layer].reshape(-1, self.idim)[locs]


class Fp8Format(KvFormat):
    """FP8 e4m3 values with fp32 scales, in byte pools with packed rows (see the module)."""

    name = "fp8"
    dtype = torch.uint8

    def __init__(self, kv_heads: int, head_dim: int, indexer_dim: int) -> None:
        super().__init__(kv_heads, head_dim, indexer_dim)
        self.kv_row = kv_heads * head_dim + 4 * kv_heads
        self.ik_blocks = max(indexer_dim // fp8.BLOCK, 1)
        if indexer_dim > fp8.BLOCK and indexer_dim % fp8.BLOCK:
            raise ConfigError.of(
                "indexer_dim", str(indexer_dim), f"at most {fp8.BLOCK} or a multiple of it"
            )
        self.ik_row = indexer_dim + 4 * self.ik_blocks

    def kv_spec(self, layers: int, page_size: int, pages: int) -> PoolSpec:
        parts = [("values", "fp8_e4m3", self.heads * self.dim), ("scales", "fp32", self.heads)]
        return PoolSpec("KV", layers, 1, self.kv_row, "fp8_e4m3", page_size, pages,
                        planes_per_layer=2, row_parts=parts, page_layout="interleaved")  # fmt: skip

    def indexer_spec(self, layers: int, page_size: int, pages: int) -> PoolSpec:
        parts = [("values", "fp8_e4m3", self.idim), ("scales", "fp32", self.ik_blocks)]
        return PoolSpec("INDEXER", layers, 1, self.ik_row, "fp8_e4m3", page_size, pages,
                        planes_per_layer=1, row_parts=parts,
                        page_layout="values_then_scales")  # fmt: skip

    def write_kv(self, pool: torch.Tensor, plane: int, slots, rows, x: torch.Tensor) -> None:
        n = x.shape[0]
        values, scales = fp8.quantize(x.reshape(n * self.heads, self.dim), block=self.dim)
        packed = torch.cat(
            [values.view(n, -1), scales.contiguous().view(n, self.heads).view(torch.uint8)], 1
        )
        pool[plane, 0, slots, rows, 0] = packed

    def gather_kv(self, pool: torch.Tensor, plane: int, rows: torch.Tensor) -> torch.Tensor:
        raw = pool[plane, 0].reshape(-1, self.kv_row)[rows]  # [..., row bytes]
        hd = self.heads * self.dim
        values = raw[..., :hd].reshape(*raw.shape[:-1], self.heads, self.dim)
        scales = raw[..., hd:].contiguous().view(torch.float32)[..., None]  # [..., heads, 1]
        return fp8.dequantize(values, scales)

    def write_keys(self, indexer, hidden, positions, locs, pool: torch.Tensor, layer: int) -> None:
        indexer.store_key_fp8(hidden, positions, locs, self._pages(pool, layer))

    def gather_keys(self, pool: torch.Tensor, layer: int, locs: torch.Tensor) -> torch.Tensor:
        return fp8.gather(self._pages(pool, layer), locs, self.idim)

    @staticmethod
    def _pages(pool: torch.Tensor, layer: int) -> torch.Tensor:
        """One layer's pages as bytes [pages, page_bytes] (a view: writes reach the pool)."""
        return pool[0, layer].reshape(pool.shape[2], -1)


def kv_format(name: str, kv_heads: int, head_dim: int, indexer_dim: int) -> KvFormat:
    if name not in KV_FORMATS:
        raise ConfigError.of("kv_format", name, " or ".join(KV_FORMATS))
    cls = Fp8Format if name == "fp8" else KvFormat
    return cls(kv_heads, head_dim, indexer_dim)
