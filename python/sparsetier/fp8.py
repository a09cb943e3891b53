"""FP8 Indexer-K as DeepSeek-V3.2 stores it: e4m3 values with one fp32 scale per 128-value
block of a token, and the page layout "all values of the page, then all its scales".

Quantization follows the real kernels: per token and block, ``scale = amax / 448`` (e4m3's
largest finite value), ``value = e4m3(x / scale)``; scores dequantize (``value * scale``) before
the dot products. With a 128-dim key there is one block, so 132 bytes per token: 128 values and
one fp32 scale; a 64-token page is 64 x 128 value bytes then 64 x 4 scale bytes (8,448 B).
"""

from __future__ import annotations

import torch

from sparsetier._checks import count, describe, tensor
from sparsetier.errors import ConfigError, OutOfRangeError

BLOCK = 128
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def _blocks(head_dim: int, block: int) -> int:
    """Scale blocks per token: `head_dim` a multiple of `block`, or below it (one block)."""
    count("head_dim", head_dim, 1)
    count("block", block, 1)
    if head_dim > block and head_dim % block:
        raise ConfigError.of("head_dim", head_dim, f"a multiple of the quant block {block}")
    return max(head_dim // block, 1)


def _page_tokens(pages: object, row: int, dims: int | None = 2) -> int:
    """Tokens per page of byte pages [..., page_bytes] holding `row`-byte token rows."""
    ok = isinstance(pages, torch.Tensor) and pages.dtype == torch.uint8
    if not ok or pages.dim() < 1 or (dims is not None and pages.dim() != dims):
        shape = "[P, page_bytes]" if dims == 2 else "[..., page_bytes]"
        raise ConfigError.of("pages", describe(pages), f"a uint8 tensor {shape}")
    if pages.shape[-1] == 0 or pages.shape[-1] % row:
        allowed = f"a positive multiple of the token row, {row} B"
        raise ConfigError.of("pages", f"{pages.shape[-1]} bytes a page", allowed)
    return pages.shape[-1] // row


def _slots(slots: object, pages: torch.Tensor, ps: int) -> torch.Tensor:
    """Integer slots within the pages. The range is checked where that costs no device sync
    (CPU tensors): a negative slot would wrap to the last page, not fail."""
    if not isinstance(slots, torch.Tensor) or slots.dtype not in _INDEX:
        raise ConfigError.of("slots", describe(slots), "a signed integer tensor")
    n = pages.shape[0] * ps
    if slots.device.type == "cpu" and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise OutOfRangeError(
                f"invalid slots = {bad}: allowed 0 <= slot < {n}",
                field="slots",
                value=bad,
                allowed=f"0 <= slot < {n}",
            )
    return slots.long()  # torch indexes with int64 or int32 only


_INDEX = (torch.int64, torch.int32, torch.int16, torch.int8)  # (uint8 would index as a mask)


def quantize(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `x` [T, D] (D a multiple of `block`, or D < block for one block) to e4m3 values as
    bytes [T, D] (uint8) and fp32 scales [T, D / block]."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ConfigError.of("x", describe(x), "a [T, D] tensor")
    t, d = x.shape
    _blocks(d, block)
    b = min(block, d)
    xf = x.to(torch.float32).view(t, d // b, b)
    amax = xf.abs().amax(dim=2).clamp(min=1e-12)  # an all-zero block keeps a finite scale
    scale = amax / E4M3_MAX
    q = (xf / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).view(t, d), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Bytes [..., D] of e4m3 values and fp32 scales [..., D / block] back to float32."""
    if not isinstance(values, torch.Tensor) or values.dtype != torch.uint8 or values.dim() < 1:
        raise ConfigError.of("values", describe(values), "a uint8 tensor [..., D]")
    d = values.shape[-1]
    # One scale per block of every row: scales of other rows would broadcast, not fail.
    ok = isinstance(scales, torch.Tensor) and scales.is_floating_point()
    if not (ok and scales.shape[:-1] == values.shape[:-1] and scales.shape[-1] >= 1):
        raise ConfigError.of("scales", describe(scales), "float [..., D / block] per value row")
    nb = scales.shape[-1]
    if d % nb:
        raise ConfigError.of("scales", describe(scales), f"blocks that divide D = {d}")
    v = values.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    v = v.view(*values.shape[:-1], nb, d // nb) * scales[..., None]
    return v.view(values.shape)


def page_bytes(page_size: int, head_dim: int, block: int = BLOCK) -> int:
    """Bytes of one page of one layer: values, then scales."""
    return count("page_size", page_size, 1) * (head_dim + 4 * _blocks(head_dim, block))


def store(
    pages: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, scales: torch.Tensor
) -> None:
    """Writes token rows into byte pages [P, page_bytes] laid out values-then-scales: token
    slot `s` (page `s // page_size`, token `s % page_size`) gets its values at `token *
    head_dim` and its scales at `page_size * head_dim + token * 4 * blocks`. Everything is
    checked before the first byte is written."""
    tensor("values", values, (torch.uint8,), (None, None), "a uint8 tensor [N, D]")
    n, d = values.shape
    tensor("scales", scales, (torch.float32,), (n, None), f"a float32 tensor [{n}, blocks]")
    nb = scales.shape[1]
    if nb < 1:
        raise ConfigError.of("scales", describe(scales), "at least one block a row")
    ps = _page_tokens(pages, d + 4 * nb)
    slots = _slots(slots, pages, ps)
    if slots.shape != (n,):
        raise ConfigError.of("slots", describe(slots), f"a tensor [{n}], one slot per row")
    page, tok = slots // ps, slots % ps
    vcols = tok[:, None] * d + torch.arange(d, device=slots.device)
    pages[page[:, None], vcols] = values
    sbytes = scales.contiguous().view(torch.uint8).view(n, 4 * nb)
    scols = ps * d + tok[:, None] * 4 * nb + torch.arange(4 * nb, device=slots.device)
    pages[page[:, None], scols] = sbytes


def load(pages: torch.Tensor, head_dim: int, block: int = BLOCK) -> torch.Tensor:
    """Every token of byte pages [..., page_bytes] (values-then-scales) as float32
    [..., page_size, head_dim]."""
    nb = _blocks(head_dim, block)
    row = head_dim + 4 * nb
    ps = _page_tokens(pages, row, dims=None)
    lead = pages.shape[:-1]
    values = pages[..., : ps * head_dim].reshape(*lead, ps, head_dim)
    scales = pages[..., ps * head_dim :].contiguous().view(torch.float32).reshape(*lead, ps, nb)
    return dequantize(values, scales)


def gather(pages: torch.Tensor, slots: torch.Tensor, head_dim: int, block: int = BLOCK):
    """Token rows at `slots` (any shape; page * page_size + token) of byte pages [P,
    page_bytes] (values-then-scales), dequantized to float32 [*slots.shape, head_dim]: only the
    gathered rows are read."""
    nb = _blocks(head_dim, block)
    ps = _page_tokens(pages, head_dim + 4 * nb)
    slots = _slots(slots, pages, ps)
    flat = slots.reshape(-1)
    page, tok = flat // ps, flat % ps
    vcols = tok[:, None] * head_dim + torch.arange(head_dim, device=slots.device)
    scols = ps * head_dim + tok[:, None] * 4 * nb + torch.arange(4 * nb, device=slots.device)
    values = pages[page[:, None], vcols]
    scales = pages[page[:, None], scols].contiguous().view(torch.float32)
    return dequantize(values, scales).view(*slots.shape, head_dim)
