"""Sparse attention: one query token attends to the tokens of its selected blocks only, read
from the device slots the residency directory resolved."""

from __future__ import annotations

import math

import torch

from sparsetier._checks import count, describe, tensor
from sparsetier.errors import ConfigError

_INTS = (torch.int64, torch.int32, torch.int16)  # signed: -1 is "none"


def _ints(field: str, x: object, shape: tuple, allowed: str) -> None:
    """`x` a signed integer tensor of `shape` (None: any size there): a shorter one would
    broadcast, a float one be truncated, not refused."""
    tensor(field, x, _INTS, shape, allowed)


def _query(q: object, lead: tuple, hkv: int, d: int) -> None:
    """Query heads `q` [*lead, Hq, d], Hq a multiple of the `hkv` KV heads (GQA): fewer
    heads would give an empty answer, a remainder an einsum error."""
    ok = isinstance(q, torch.Tensor) and q.dim() == len(lead) + 2
    ok = ok and tuple(q.shape[: len(lead)]) == lead and q.shape[-1] == d
    if not (ok and q.shape[-2] >= hkv and q.shape[-2] % hkv == 0):
        shape = [*lead, f"a multiple of {hkv}", d]
        raise ConfigError.of("q", describe(q), f"a tensor {shape}".replace("'", ""))


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
    pos, block_size = count("pos", pos, 0), count("block_size", block_size, 1)
    if kv_pool.dim() != 6 or kv_pool.shape[3] != block_size:
        raise ConfigError.of("kv_pool", describe(kv_pool), f"[2, 1, slots, {block_size}, H, D]")
    n = blocks.numel() if isinstance(blocks, torch.Tensor) else -1
    _ints("blocks", blocks, (None,), "an integer [N] tensor")
    _ints("slots", slots, (n,), f"an integer [{n}] tensor, a slot per block")
    slots = slots.long()  # (an int16 tensor does not index)
    k = kv_pool[0, 0, slots].reshape(-1, kv_pool.shape[-2], kv_pool.shape[-1]).to(torch.float32)
    v = kv_pool[1, 0, slots].reshape(-1, kv_pool.shape[-2], kv_pool.shape[-1]).to(torch.float32)
    blocks = blocks.to(kv_pool.device)
    tok = (blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)).reshape(
        -1
    )
    return attend(q, k, v, tok <= pos)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [Hq, D] over k, v [S, Hkv, D] where `mask` [S] is True."""
    if not (isinstance(k, torch.Tensor) and k.dim() == 3):
        raise ConfigError.of("k", describe(k), "a tensor [S, Hkv, D]")
    if not (isinstance(v, torch.Tensor) and v.shape == k.shape):
        raise ConfigError.of("v", describe(v), f"a tensor {list(k.shape)}, as k")
    _query(q, (), k.shape[1], k.shape[2])
    ok = isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
    if not (ok and mask.shape == k.shape[:1]):  # a shorter mask would broadcast
        raise ConfigError.of("mask", describe(mask), f"a bool [{k.shape[0]}] tensor")
    hq, d = q.shape
    group = hq // k.shape[1]
    kk = k.repeat_interleave(group, dim=1)  # [S, Hq, D]
    # Rows masked out read zeros: whatever a slot held before (a failed request's NaN) must
    # not reach the sum through a zero weight (0 x NaN is NaN).
    vv = v.repeat_interleave(group, dim=1).masked_fill(~mask[:, None, None], 0)
    logits = torch.einsum("hd,shd->hs", q.to(torch.float32), kk) / math.sqrt(d)
    logits = logits.masked_fill(~mask[None, :], float("-inf"))
    return torch.einsum("hs,shd->hd", torch.softmax(logits, dim=-1), vv)


def sparse_attention_batched(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    table: torch.Tensor,
    selection: torch.Tensor,
    positions: torch.Tensor,
    unit: int,
    page_size: int,
    fmt=None,
) -> torch.Tensor:
    """Attention of a batch of query tokens over their selections, in one tensor program.

    `q` [B, Hq, D]; `selection` [B, K] entries of `unit` tokens (-1 = none); `table`
    [B, K * max(1, unit // page_size)] the device slot of each entry's pages, as the step
    scheduler returned it (-1 where there is none); `kv_pool` [2, 1, slots, page_size, Hkv, D];
    `positions` [B] the queries' positions (later tokens are masked). Computed in float32;
    returns [B, Hq, D]. A row with nothing to read (a failed request) returns zeros. `fmt` (a
    `sparsetier.kv_format.KvFormat`) reads packed pools, dequantizing only the gathered rows.
    """
    _ints("selection", selection, (None, None), "an integer [B, K] tensor")
    b, k = selection.shape
    unit, page_size = count("unit", unit, 1), count("page_size", page_size, 1)
    if unit % page_size and page_size % unit:  # an entry would straddle pages it has no slot of
        raise ConfigError.of("unit", unit, f"a multiple or a divisor of page_size {page_size}")
    if kv_pool.dim() != 6 or kv_pool.shape[3] != page_size:
        raise ConfigError.of("kv_pool", describe(kv_pool), f"[2, 1, slots, {page_size}, H, D]")
    dev = kv_pool.device
    if fmt is None:  # a plain pool [2, 1, slots, page_size, Hkv, D]
        from sparsetier.kv_format import KvFormat

        fmt = KvFormat(kv_pool.shape[-2], kv_pool.shape[-1], 0)
    hkv, d = fmt.heads, fmt.dim
    ppe = max(1, unit // page_size)
    _query(q, (b,), hkv, d)
    _ints("positions", positions, (b,), f"an integer [{b}] tensor")
    allowed = f"an integer [{b}, >= {k * ppe}] tensor"
    _ints("table", table, (b, None), allowed)
    if table.shape[1] < k * ppe:
        raise ConfigError.of("table", describe(table), allowed)
    sel = selection.to(dev)
    off = torch.arange(unit, device=dev)
    tok = sel[:, :, None] * unit + off  # [B, K, unit]
    cell = torch.arange(k, device=dev)[:, None] * ppe + (off // page_size if ppe > 1 else 0 * off)
    slot = table.to(dev, torch.long).gather(1, cell.reshape(1, -1).expand(b, -1)).view(b, k, unit)
    mask = (sel[:, :, None] >= 0) & (slot >= 0) & (tok <= positions.to(dev)[:, None, None])
    rows = (slot.clamp(min=0) * page_size + tok.clamp(min=0) % page_size).reshape(b, -1)
    kk, vv = fmt.gather_kv(kv_pool, 0, rows), fmt.gather_kv(kv_pool, 1, rows)  # [B, N, Hkv, D]
    mask = mask.reshape(b, -1)
    group = q.shape[1] // hkv
    kk = kk.repeat_interleave(group, dim=2)
    # (Masked rows read zeros, as in `attend`: a slot's stale NaN must not reach the sum.)
    vv = vv.repeat_interleave(group, dim=2).masked_fill(~mask[:, :, None, None], 0)
    logits = torch.einsum("bhd,bnhd->bhn", q.to(torch.float32), kk) / math.sqrt(d)
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    any_valid = mask.any(dim=1)
    logits = torch.where(any_valid[:, None, None], logits, torch.zeros_like(logits))
    out = torch.einsum("bhn,bnhd->bhd", torch.softmax(logits, dim=-1), vv)
    return torch.where(any_valid[:, None, None], out, torch.zeros_like(out))
