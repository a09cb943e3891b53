"""The sparse indexer: the DSA lightning indexer that picks which KV blocks attention reads.

Per token it keeps one scoring key (Indexer-K, K only: there is no Indexer-V) in the INDEXER
pool. To select, it scores every past token against the query's heads,

    score(t, s) = sum_h w[t, h] * ReLU(q[t, h] . k[s]),

reduces token scores to block scores (max, or mean), and picks the top-k blocks, always
including the first (sink) block and the local window. The selection is never cached: it is
recomputed for every query.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10_000.0) -> torch.Tensor:
    """Rotary embedding over the last dim (rotate-half form), computed in float32."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    ang = positions.to(torch.float32)[:, None] * inv[None, :]  # [T, d/2]
    shape = [ang.shape[0]] + [1] * (x.dim() - 2) + [d // 2]
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    xf = x.to(torch.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@dataclass
class Selection:
    """The blocks one query reads: block ids (ascending) and their token positions."""

    blocks: torch.Tensor  # int64 [k]
    positions: torch.Tensor  # int64 [k * block_size], may run past the last token

    def num_blocks(self) -> int:
        return int(self.blocks.numel())


class SparseIndexer(nn.Module):
    """The indexer of one layer. `store_key` writes Indexer-K; `forward` scores and selects."""

    def __init__(
        self,
        hidden: int,
        heads: int = 4,
        head_dim: int = 32,
        *,
        zero_centered: bool = False,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        self.zero_centered = zero_centered
        self.wq = nn.Linear(hidden, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.ww = nn.Linear(hidden, heads, bias=False)
        self.gamma_k = nn.Parameter(
            torch.zeros(head_dim) if zero_centered else torch.ones(head_dim)
        )

    def key(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Indexer-K of tokens: wk, RMSNorm with gamma_k ((1 + gamma) when zero-centered),
        bf16, RoPE. Returns [T, head_dim] bf16."""
        k = self.wk(hidden).to(torch.float32)
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + self.eps)
        gamma = (1.0 + self.gamma_k) if self.zero_centered else self.gamma_k
        k = (k * gamma.to(torch.float32)).to(torch.bfloat16)
        return rope(k, positions)

    def store_key(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        pool: torch.Tensor,
        layer: int,
    ) -> None:
        """Writes Indexer-K of `hidden` into the INDEXER `pool` (layer-first,
        [1, layers, pages, page_size, 1, head_dim]) at token slots `out_cache_loc`
        (page * page_size + token)."""
        k = self.key(hidden, positions)
        if torch.isnan(k).any():
            from sparsetier.errors import ConfigError

            raise ConfigError.of("hidden", "NaN", "finite values")
        rows = pool[0, layer].reshape(-1, self.head_dim)
        rows[out_cache_loc] = k.to(pool.dtype)

    def scores(
        self, hidden: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """Token scores [T, S] of queries `hidden` against past Indexer-K `keys` [S, head_dim]."""
        q = self.wq(hidden).view(-1, self.heads, self.head_dim).to(torch.bfloat16)
        q = rope(q, positions).to(torch.float32)
        w = self.ww(hidden).to(torch.float32)  # [T, H]
        dots = torch.einsum("thd,sd->ths", q, keys.to(torch.float32))
        return torch.einsum("th,ths->ts", w, torch.relu(dots))

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        *,
        block_size: int,
        topk: int,
        window: int = 1,
        reduce: str = "max",
    ) -> list[Selection]:
        """Selects blocks for each query token (whose own key is the last of `keys` it may
        see: token t sees keys[: positions[t] + 1])."""
        s = self.scores(hidden, positions, keys)
        out = []
        for t in range(hidden.shape[0]):
            out.append(select_blocks(s[t], int(positions[t]), block_size, topk, window, reduce))
        return out


def select_blocks(
    token_scores: torch.Tensor, pos: int, block_size: int, topk: int, window: int, reduce: str
) -> Selection:
    """Top-k blocks by reduced score among blocks 0..pos // block_size, always with the sink
    block and the `window` most recent blocks."""
    n_blocks = pos // block_size + 1
    visible = token_scores[: pos + 1]
    pad = n_blocks * block_size - (pos + 1)
    fill = float("-inf") if reduce == "max" else 0.0
    padded = torch.cat([visible, visible.new_full((pad,), fill)]).view(n_blocks, block_size)
    if reduce == "max":
        block = padded.max(dim=1).values
    elif reduce == "mean":
        counts = torch.full((n_blocks,), float(block_size), device=token_scores.device)
        counts[-1] = block_size - pad
        block = padded.sum(dim=1) / counts
    else:
        from sparsetier.errors import ConfigError

        raise ConfigError.of("reduce", reduce, "max or mean")
    forced = {0, *range(max(0, n_blocks - window), n_blocks)}
    chosen = set(forced)
    if len(chosen) < topk:
        order = torch.argsort(block, descending=True, stable=True).tolist()
        for b in order:
            if len(chosen) >= topk:
                break
            chosen.add(b)
    blocks = torch.tensor(sorted(chosen), dtype=torch.int64)
    positions = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    return Selection(blocks, positions)
