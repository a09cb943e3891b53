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

from sparsetier._checks import count, describe
from sparsetier.errors import ConfigError


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


#: Selection modes: NSA-style top-k blocks (with the sink block and a local window), or
#: DSA-style top-k tokens (with the sink token and the current token).
MODES = ("block", "token")


class SparseIndexer(nn.Module):
    """The indexer of one layer. `store_key` writes Indexer-K; `select` scores and selects for
    a whole batch at once."""

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
        (page * page_size + token). A NaN key raises `ConfigError` on the CPU; on a GPU that
        check would stall the host once a layer, so it is the caller's (`DecodeRuntime` checks
        each step's logits, in the copy it makes anyway)."""
        k = self.key(hidden, positions)
        _check_finite(k)
        rows = pool[0, layer].reshape(-1, self.head_dim)
        rows[out_cache_loc] = k.to(pool.dtype)

    def store_key_fp8(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        pages: torch.Tensor,
    ) -> None:
        """Writes Indexer-K of `hidden` as DeepSeek-V3.2 stores it: FP8 e4m3 values and one
        fp32 scale per 128-value block, into one layer's byte pages `pages` [P, page_bytes]
        laid out values-then-scales (`sparsetier.fp8`), at token `slots` (page * page_size +
        token). Score from them with `scores(..., fp8.load(pages, head_dim)[...])`."""
        from sparsetier import fp8

        k = self.key(hidden, positions)
        _check_finite(k)
        values, scales = fp8.quantize(k)
        fp8.store(pages, slots, values, scales)

    def scores(
        self, hidden: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """Token scores of queries `hidden` [T, H] against past Indexer-K: `keys` [S, head_dim]
        shared by every query gives [T, S]; `keys` [T, S, head_dim] (one history per query,
        the batched decode form) gives [T, S] too."""
        q = self.wq(hidden).view(-1, self.heads, self.head_dim).to(torch.bfloat16)
        q = rope(q, positions).to(torch.float32)
        w = self.ww(hidden).to(torch.float32)  # [T, H]
        if keys.dim() == 2:
            dots = torch.einsum("thd,sd->ths", q, keys.to(torch.float32))
        else:
            dots = torch.einsum("thd,tsd->ths", q, keys.to(torch.float32))
        return torch.einsum("th,ths->ts", w, torch.relu(dots))

    def select(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        *,
        mode: str,
        unit: int,
        topk: int,
        window: int = 1,
        reduce: str = "max",
    ) -> torch.Tensor:
        """Selects for a batch of queries at once: `keys` [B, S, head_dim] holds each query's
        history (query b sees keys[b, : positions[b] + 1]). Returns an int64 [B, topk] tensor of
        ascending entries, -1 where a short history has fewer: block ids of `unit` tokens in
        block mode, token indices in token mode."""
        return select_from_scores(
            self.scores(hidden, positions, keys),
            positions,
            mode=mode,
            unit=unit,
            topk=topk,
            window=window,
            reduce=reduce,
        )


def _check_finite(k: torch.Tensor) -> None:
    """Refuses NaN keys where that costs no device sync (CPU tensors)."""
    if k.device.type == "cpu" and torch.isnan(k).any():
        raise ConfigError.of("hidden", "NaN", "finite values")


def select_from_scores(
    scores: torch.Tensor,
    positions: torch.Tensor,
    *,
    mode: str,
    unit: int,
    topk: int,
    window: int = 1,
    reduce: str = "max",
) -> torch.Tensor:
    """Top-k selection over token scores [B, S] for the whole batch: one stable sort, no loop
    over requests. Block mode reduces `unit`-token blocks (max or mean over their visible
    tokens) and always keeps the sink block and the `window` most recent blocks; token mode
    keeps the sink token and the query's own token. Ties go to the lower entry. Returns int64
    [B, topk], ascending: a row with fewer entries starts with -1s. Neither depends on the
    width of `scores` past the batch's positions."""
    if mode not in MODES:
        raise ConfigError.of("mode", mode, "block or token")
    if reduce not in ("max", "mean"):
        raise ConfigError.of("reduce", reduce, "max or mean")
    unit, topk, window = count("unit", unit, 1), count("topk", topk, 1), count("window", window)
    ok = isinstance(scores, torch.Tensor) and scores.dim() == 2
    if not ok or not scores.is_floating_point():
        raise ConfigError.of("scores", describe(scores), "a float [B, S] tensor")
    b, s = scores.shape
    # One position per row: a shorter tensor would broadcast, every row read at one position.
    ok = isinstance(positions, torch.Tensor) and positions.shape == (b,)
    if not ok or positions.is_floating_point() or positions.dtype == torch.bool:
        raise ConfigError.of("positions", describe(positions), f"an integer [{b}] tensor")
    dev = scores.device
    pos = positions.to(dev)
    t = torch.arange(s, device=dev)
    visible = t[None, :] <= pos[:, None]  # [B, S]
    inf = float("inf")
    if mode == "token":
        x = scores.masked_fill(~visible, -inf)
        forced = (t[None, :] == 0) | (t[None, :] == pos[:, None])
        x = x.masked_fill(forced, inf)
    else:
        nb = -(-s // unit)
        pad = nb * unit - s
        if reduce == "max":
            v = scores.masked_fill(~visible, -inf)
            v = torch.nn.functional.pad(v, (0, pad), value=-inf).view(b, nb, unit)
            x = v.max(dim=2).values
        else:
            v = scores.masked_fill(~visible, 0.0)
            v = torch.nn.functional.pad(v, (0, pad), value=0.0).view(b, nb, unit)
            cnt = torch.nn.functional.pad(visible, (0, pad)).view(b, nb, unit).sum(dim=2)
            x = v.sum(dim=2) / cnt.clamp(min=1)
        blk = torch.arange(nb, device=dev)
        n_blocks = pos // unit + 1  # [B]
        x = x.masked_fill(blk[None, :] >= n_blocks[:, None], -inf)
        forced = (blk[None, :] == 0) | (
            (blk[None, :] >= (n_blocks - window)[:, None]) & (blk[None, :] < n_blocks[:, None])
        )
        x = x.masked_fill(forced, inf)
    if x.shape[1] < topk:
        # Fewer candidates than topk: padded with ones never chosen, so that the rows' layout
        # (-1 first) does not depend on how wide the history was (a CUDA graph's history is
        # a bucket wider than the batch's).
        x = torch.nn.functional.pad(x, (0, topk - x.shape[1]), value=-inf)
    # Ties (ReLU scores are often exactly 0) go to the lower entry: `torch.topk` breaks them
    # in an order that depends on the row's length, so the same scores in a wider history
    # could select other entries.
    order = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :topk]
    vals = x.gather(1, order)
    idx = order.masked_fill(vals == -inf, -1)
    idx, _ = torch.sort(idx, dim=1)
    return idx


def select_blocks(
    token_scores: torch.Tensor, pos: int, block_size: int, topk: int, window: int, reduce: str
) -> Selection:
    """Top-k blocks by reduced score among blocks 0..pos // block_size, always with the sink
    block and the `window` most recent blocks: one row of `select_from_scores`."""
    ok = isinstance(token_scores, torch.Tensor) and token_scores.dim() == 1
    if not ok or not token_scores.is_floating_point():
        raise ConfigError.of("token_scores", describe(token_scores), "a float [S] tensor")
    # Past the scores, the window's blocks would not exist and be silently left out.
    pos = count("pos", pos, 0, token_scores.shape[0] - 1)
    sel = select_from_scores(
        token_scores[None, : pos + 1],
        torch.tensor([pos]),
        mode="block",
        unit=block_size,
        topk=topk,
        window=window,
        reduce=reduce,
    )[0]
    blocks = sel[sel >= 0].cpu()
    positions = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    return Selection(blocks, positions)
