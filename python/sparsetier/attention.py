"""Sparse attention: one query token attends to the tokens of its selected blocks only, read
from the device slots the residency directory resolved."""

from __future__ import annotations

import math

import torch


def sparse_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    slots: torch.Tensor,
    blocks: torch.Tensor,
    pos: int,
    block_size: int,
) -> torch.Tensor:
    """Attention of one token's query heads `q` [Hq, D] over the blocks `blocks` (ascending),
    whose K/V live in device slots `slots` of `kv_pool` ([2, 1, slots, block, Hkv, D]).
    Tokens past `pos` in the last block are masked. GQA: Hq is a multiple of Hkv.
    Computed in float32; returns [Hq, D]."""
    k = kv_pool[0, 0, slots].reshape(-1, kv_pool.shape[-2], kv_pool.shape[-1]).to(torch.float32)
    v = kv_pool[1, 0, slots].reshape(-1, kv_pool.shape[-2], kv_pool.shape[-1]).to(torch.float32)
    blocks = blocks.to(kv_pool.device)
    tok = (blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)).reshape(
        -1
    )
    return attend(q, k, v, tok <= pos)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [Hq, D] over k, v [S, Hkv, D] where `mask` [S] is True."""
    hq, d = q.shape
    group = hq // k.shape[1]
    kk = k.repeat_interleave(group, dim=1)  # [S, Hq, D]
    vv = v.repeat_interleave(group, dim=1)
    logits = torch.einsum("hd,shd->hs", q.to(torch.float32), kk) / math.sqrt(d)
    logits = logits.masked_fill(~mask[None, :], float("-inf"))
    return torch.einsum("hs,shd->hd", torch.softmax(logits, dim=-1), vv)
