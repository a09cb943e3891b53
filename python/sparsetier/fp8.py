"""FP8 Indexer-K as DeepSeek-V3.2 stores it: e4m3 values with one fp32 scale per 128-value
block of a token, and the page layout "all values of the page, then all its scales".

Quantization follows the real kernels: per token and block, ``scale = amax / 448`` (e4m3's
largest finite value), ``value = e4m3(x / scale)``; scores dequantize (``value * scale``) before
the dot products. With a 128-dim key there is one block, so 132 bytes per token: 128 values and
one fp32 scale; a 64-token page is 64 x 128 value bytes then 64 x 4 scale bytes (8,448 B).
"""

from __future__ import annotations

import torch

from sparsetier.errors import ConfigError

BLOCK = 128
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def quantize(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `x` [T, D] (D a multiple of `block`, or D < block for one block) to e4m3 values as
    bytes [T, D] (uint8) and fp32 scales [T, D / block]."""
    t, d = x.shape
    b = min(block, d)
    if d % b:
        raise ConfigError.of("head_dim", d, f"a multiple of the quant block {block}")
    xf = x.to(torch.float32).view(t, d // b, b)
    amax = xf.abs().amax(dim=2).clamp(min=1e-12)  # an all-zero block keeps a finite scale
    scale = amax / E4M3_MAX
    q = (xf / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).view(t, d), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Bytes [..., D] of e4m3 values and fp32 scales [..., D / block] back to float32."""
    d = values.shape[-1]
    nb = scales.shape[-1]
    v = values.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    v = v.view(*values.shape[:-1], nb, d // nb) * scales[..., None]
    return v.view(values.shape)


def page_bytes(page_size: int, head_dim: int, block: int = BLOCK) -> int:
    """Bytes of one page of one layer: values, then scales."""
    return page_size * (head_dim + 4 * max(head_dim // block, 1))


def store(
    pages: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, scales: torch.Tensor
) -> None:
    """Writes token rows into byte pages [P, page_bytes] laid out values-then-scales: token
    slot `s` (page `s // page_size`, token `s % page_size`) gets its values at `token *
    head_dim` and its scales at `page_size * head_dim + token * 4 * blocks`."""
    n, d = values.shape
    nb = scales.shape[1]
    ps = pages.shape[1] // (d + 4 * nb)
    page, tok = slots // ps, slots % ps
    vcols = tok[:, None] * d + torch.arange(d, device=slots.device)
    pages[page[:, None], vcols] = values
    sbytes = scales.contiguous().view(torch.uint8).view(n, 4 * nb)
    scols = ps * d + tok[:, None] * 4 * nb + torch.arange(4 * nb, device=slots.device)
    pages[page[:, None], scols] = sbytes


def load(pages: torch.Tensor, head_dim: int, block: int = BLOCK) -> torch.Tensor:
    """Every token of byte pages [..., page_bytes] (values-then-scales) as float32
    [..., page_size, head_dim]."""
    nb = max(head_dim // block, 1)
    row = head_dim + 4 * nb
    ps = pages.shape[-1] // row
    lead = pages.shape[:-1]
    values = pages[..., : ps * head_dim].reshape(*lead, ps, head_dim)
    scales = pages[..., ps * head_dim :].contiguous().view(torch.float32).reshape(*lead, ps, nb)
    return dequantize(values, scales)


def gather(pages: torch.Tensor, slots: torch.Tensor, head_dim: int, block: int = BLOCK):
    """Token rows at `slots` (any shape; page * page_size + token) of byte pages [P,
    page_bytes] (values-then-scales), dequantized to float32 [*slots.shape, head_dim]: only the
    gathered rows are read."""
    nb = max(head_dim // block, 1)
    ps = pages.shape[1] // (head_dim + 4 * nb)
    flat = slots.reshape(-1)
    page, tok = flat // ps, flat % ps
    vcols = tok[:, None] * head_dim + torch.arange(head_dim, device=slots.device)
    scols = ps * head_dim + tok[:, None] * 4 * nb + torch.arange(4 * nb, device=slots.device)
    values = pages[page[:, None], vcols]
    scales = pages[page[:, None], scols].contiguous().view(torch.float32)
    return dequantize(values, scales).view(*slots.shape, head_dim)
