"""FP8 Indexer-K (DeepSeek-V3.2's format): the quantized round trip against a float reference,
the page layout (values, then scales), and the selection from the FP8 cache against bf16's."""

from __future__ import annotations

import torch

from sparsetier import fp8
from sparsetier.indexer import SparseIndexer, select_from_scores

# e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 per value (round to nearest),
# plus the subnormal step for values far below the block's amax.
REL = 2.0**-4


def test_quantized_round_trip_is_within_fp8_error():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g) * torch.logspace(-3, 3, 256)[:, None]
    v, s = fp8.quantize(x)
    assert v.dtype == torch.uint8 and v.shape == (256, 128) and s.shape == (256, 1)
    y = fp8.dequantize(v, s)
    step = s * 2.0**-9  # e4m3's smallest subnormal, scaled
    assert ((y - x).abs() <= REL * x.abs() + step).all()
    # Each token's largest value is exact to the format: it maps to +-448.
    top = x.abs().argmax(dim=1)
    assert torch.allclose(y.gather(1, top[:, None]), x.gather(1, top[:, None]), rtol=REL)


def test_pages_hold_values_then_scales():
    ps, d = 64, 128
    assert fp8.page_bytes(ps, d) == 8448
    pages = torch.zeros(3, fp8.page_bytes(ps, d), dtype=torch.uint8)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100, d, generator=g)
    v, s = fp8.quantize(x)
    slots = torch.randperm(3 * ps, generator=g)[:100]
    fp8.store(pages, slots, v, s)
    page, tok = slots // ps, slots % ps
    # Values of token t of a page at t * 128; its scale at 64 * 128 + t * 4.
    i = 7
    p, t = int(page[i]), int(tok[i])
    assert torch.equal(pages[p, t * d : (t + 1) * d], v[i])
    sb = pages[p, ps * d + 4 * t : ps * d + 4 * t + 4].view(torch.float32)
    assert sb.item() == s[i, 0].item()
    back = fp8.load(pages, d).view(3 * ps, d)
    assert torch.equal(back[slots], fp8.dequantize(v, s))


def test_selection_from_the_fp8_cache_matches_bf16_up_to_ties():
    """The tiny model's indexer on random hidden states: top-k from FP8 keys equals top-k from
    the bf16 keys except where two candidates' bf16 scores are closer than the FP8 error can
    reorder (documented ties)."""
    torch.manual_seed(0)
    ix = SparseIndexer(hidden=64, heads=4, head_dim=128)
    s_len, b = 512, 8
    hidden = torch.randn(s_len, 64)
    pos = torch.arange(s_len)
    keys = ix.key(hidden, pos).to(torch.float32)  # bf16 keys, as the bf16 cache holds them
    v, sc = fp8.quantize(keys)
    keys8 = fp8.dequantize(v, sc)
    q_pos = torch.arange(s_len - b, s_len)
    with torch.no_grad():
        s16 = ix.scores(hidden[q_pos], q_pos, keys)
        s8 = ix.scores(hidden[q_pos], q_pos, keys8)
    # The FP8 cache perturbs scores by a few percent of their range...
    assert (s8 - s16).abs().max() <= 0.05 * s16.abs().max()
    # ...which may swap an entry at the cut, and nothing else (measured: 16 of 512 token
    # entries and 8 of 64 blocks swap on this data; a broken quantization swaps most).
    for mode, unit, topk, most in (("token", 1, 64, 0.05), ("block", 16, 8, 0.25)):
        a = select_from_scores(s16, q_pos, mode=mode, unit=unit, topk=topk)
        c = select_from_scores(s8, q_pos, mode=mode, unit=unit, topk=topk)
        swaps = sum(len(set(a[r].tolist()) - set(c[r].tolist())) for r in range(b))
        assert swaps <= most * b * topk, (mode, swaps)
        for row in range(b):
            sa, sb = set(a[row].tolist()), set(c[row].tolist())
            if sa == sb:
                continue
            # Every disagreement is a near-tie at the cut: the swapped entries' bf16 scores lie
            # within the FP8 perturbation of the last score the bf16 selection took on merit
            # (the sink, the current token / local window are forced in both).
            p = int(q_pos[row])
            full = s16[row] if mode == "token" else _blocks(s16[row], unit, p)
            forced = {0, p} if mode == "token" else {0, p // unit}
            boundary = min(full[x].item() for x in sa - forced)
            tol = 2 * (s8[row] - s16[row]).abs().max().item() + 1e-6
            for e in sa ^ sb:
                assert abs(full[e].item() - boundary) <= tol, (mode, row, e)


def _blocks(scores: torch.Tensor, unit: int, pos: int) -> torch.Tensor:
    n = pos // unit + 1
    v = scores[: n * unit].clone()
    v[pos + 1 :] = -float("inf")
    return v.view(n, unit).max(dim=1).values


def test_the_indexer_stores_fp8_keys_in_values_then_scales_pages():
    torch.manual_seed(2)
    ix = SparseIndexer(hidden=64, heads=4, head_dim=128)
    hidden = torch.randn(100, 64)
    pos = torch.arange(100)
    pages = torch.zeros(2, fp8.page_bytes(64, 128), dtype=torch.uint8)
    with torch.no_grad():
        ix.store_key_fp8(hidden, pos, pos, pages)
        want = fp8.dequantize(*fp8.quantize(ix.key(hidden, pos)))
    got = fp8.load(pages, 128).view(128, 128)[:100]
    assert torch.equal(got, want)
