"""Packed per-token rows (issue 16): DeepSeek-V3.2's 656-byte KV rows (values, scales, RoPE,
each token's row whole) and 132-byte Indexer-K rows in values-then-scales pages. Every engine
moves them byte-exact at page and token granularity; a token's parts land where the core's
geometry (`PoolSpec.part_offset`) says, which is where `sparsetier.fp8` writes them."""

import pytest
import torch
from hypothesis import given
from hypothesis import settings as st_settings
from hypothesis import strategies as hyp

import sparsetier as st
from sparsetier import fp8, lowlevel
from sparsetier.presets import DEEPSEEK_V32

GPU = torch.cuda.is_available() and st.cuda_status()[0]
ENGINES = ["cpu", "kernel", "direct"]


def packed(comp, pages, layers=3, page_size=8):
    row = DEEPSEEK_V32.kv if comp == "KV" else DEEPSEEK_V32.indexer
    return st.PoolSpec(comp, layers, 1, row.bytes, "fp8_e4m3", page_size, pages,
                       planes_per_layer=1, row_parts=row.core_parts(),
                       page_layout=row.page_layout)  # fmt: skip


def engine_and_device(io):
    if io != "cpu" and not GPU:
        pytest.skip(f"the {io} engine needs a CUDA GPU: {st.cuda_status()[1]}")
    return st.TransferEngine(io), ("cpu" if io == "cpu" else "cuda")


def test_specs_carry_the_row_format():
    kv, ik = DEEPSEEK_V32.specs(pages=10)
    assert (kv.token_bytes, kv.page_bytes, kv.page_layout) == (656, 41_984, "interleaved")
    assert (ik.token_bytes, ik.page_bytes, ik.page_layout) == (132, 8_448, "values_then_scales")
    assert [p["name"] for p in kv.row_parts] == ["values", "scales", "rope"]
    assert ik.token_pieces == [("values", 0, 128), ("scales", 64 * 128, 4)]
    assert kv.token_pieces == [("row", 0, 656)]
    assert ik.with_pages(3).token_pieces == ik.token_pieces
    # Token 5 of page 2 of layer 7 (layer-first): its values, then its scale after all values.
    page = ik.page_offset("layer_first", 0, 7, 2)
    assert ik.part_offset("layer_first", 0, 7, 2, 5, 0) == page + 5 * 128
    assert ik.part_offset("layer_first", 0, 7, 2, 5, 1) == page + 8192 + 5 * 4
    assert ik.token_offset("layer_first", 0, 7, 2, 5) == page + 5 * 128
    with pytest.raises(st.OutOfRangeError) as e:
        ik.part_offset("layer_first", 0, 0, 0, 0, 2)
    assert e.value.field == "part"


def test_fp8_pages_match_the_core_geometry():
    # sparsetier.fp8 writes rows into byte pages itself (torch indexing); they must be where
    # the core's geometry, which every transfer uses, puts them.
    ps, d = 64, 128
    spec = st.PoolSpec("INDEXER", 1, 1, 132, "fp8_e4m3", ps, 3, planes_per_layer=1,
                       row_parts=[("values", "fp8_e4m3", d), ("scales", "fp32", 1)],
                       page_layout="values_then_scales")  # fmt: skip
    pages = torch.zeros(3, spec.page_bytes, dtype=torch.uint8)
    v, s = fp8.quantize(torch.randn(40, d, generator=torch.Generator().manual_seed(2)))
    slots = torch.randperm(3 * ps, generator=torch.Generator().manual_seed(3))[:40]
    fp8.store(pages, slots, v, s)
    flat = pages.view(-1)
    for i in (0, 17, 39):
        p, t = divmod(int(slots[i]), ps)
        vo = spec.part_offset("layer_first", 0, 0, p, t, 0)
        so = spec.part_offset("layer_first", 0, 0, p, t, 1)
        assert torch.equal(flat[vo : vo + d], v[i])
        assert flat[so : so + 4].view(torch.float32).item() == s[i, 0].item()


@pytest.mark.parametrize("io", ENGINES)
@pytest.mark.parametrize("layout", ["layer_first", "layer_page_first"])
@pytest.mark.parametrize("comp", ["KV", "INDEXER"])
@pytest.mark.parametrize("granularity", ["page", "token"])
def test_packed_pools_round_trip_byte_exact(io, layout, comp, granularity):
    engine, dev_type = engine_and_device(io)
    host_spec, dev_spec = packed(comp, 12), packed(comp, 7)
    g = torch.Generator().manual_seed(16)
    host = torch.randint(0, 256, tuple(host_spec.shape(layout)), generator=g, dtype=torch.uint8)
    host = host.pin_memory() if dev_type == "cuda" else host
    original = host.clone()
    dev = torch.zeros(tuple(dev_spec.shape()), dtype=torch.uint8, device=dev_type)
    ps = host_spec.page_size
    if granularity == "page":
        src, dst = [3, 4, 11, 0], [0, 1, 6, 4]
    else:  # a run of consecutive tokens, lone ones, one crossing into another page
        src, dst = [9, 10, 11, 12, 40, 95, 2], [0, 1, 2, 3, 15, 55, 8]
    hb = st.PageTransferBinding(host, host_spec, layout)
    db = st.PageTransferBinding(dev, dev_spec)
    load = lowlevel.PreparedPageTransfer(hb, db, src, dst, granularity=granularity)
    engine.submit(lowlevel.PageTransferGroup([load])).wait(timeout=30)
    host.zero_()  # the backup must bring every moved byte back
    back = lowlevel.PreparedPageTransfer(
        db, hb, dst, src, direction="backup", granularity=granularity
    )
    engine.submit(lowlevel.PageTransferGroup([back])).wait(timeout=30)
    got = dev.cpu().view(-1)
    hflat, oflat = host.view(-1), original.view(-1)
    want = torch.zeros_like(got)
    moved = torch.zeros_like(hflat)
    n_parts = len(host_spec.row_parts)
    for s, d in zip(src, dst, strict=True):
        for layer in range(3):
            units = range(ps) if granularity == "page" else [None]
            for k in units:
                sp, st_ = (s, k) if k is not None else divmod(s, ps)
                dp, dt = (d, k) if k is not None else divmod(d, ps)
                for part in range(n_parts):
                    n = host_spec.row_parts[part]["bytes"]
                    so = host_spec.part_offset(layout, 0, layer, sp, st_, part)
                    do = dev_spec.part_offset("layer_first", 0, layer, dp, dt, part)
                    want[do : do + n] = oflat[so : so + n]
                    moved[so : so + n] = oflat[so : so + n]
    assert torch.equal(got, want), "a part landed elsewhere, was missed, or was torn"
    assert torch.equal(hflat, moved), "the backup must restore exactly the moved bytes"


def test_a_split_page_cannot_be_moved_into_an_interleaved_pool():
    split = packed("INDEXER", 4)
    plain = st.PoolSpec("INDEXER", 3, 1, 132, "fp8_e4m3", 8, 4, planes_per_layer=1)
    a = torch.zeros(tuple(split.shape()), dtype=torch.uint8)
    b = torch.zeros(tuple(plain.shape()), dtype=torch.uint8)
    with pytest.raises(st.PlanError) as e:
        lowlevel.PreparedPageTransfer(
            st.PageTransferBinding(a, split), st.PageTransferBinding(b, plain), [0], [1]
        )
    assert e.value.field == "dst.row_format"


ITEM = {"fp8_e4m3": 1, "bf16": 2, "fp32": 4}


def reference_offset(parts, split, page_size, layers, pages, layer, page, token, part, lpf):
    """An independent model of where part `part` of a token's row sits in a one-plane pool:
    whole rows one after another, or (split) each part's rows together in part order."""
    sizes = [ITEM[d] * n for _, d, n in parts]
    row = sum(sizes)
    page_bytes = row * page_size
    flat = page * layers + layer if lpf else layer * pages + page
    before = sum(sizes[:part])
    inner = page_size * before + token * sizes[part] if split else token * row + before
    return flat * page_bytes + inner


@st_settings(max_examples=60, deadline=None)
@given(data=hyp.data())
def test_any_packed_row_moves_exactly_where_the_reference_says(data):
    kinds = data.draw(hyp.permutations(["values", "scales", "rope"]))
    n_parts = data.draw(hyp.integers(1, 3))
    parts = [
        (k, data.draw(hyp.sampled_from(sorted(ITEM))), data.draw(hyp.integers(1, 9)))
        for k in kinds[:n_parts]
    ]
    split = data.draw(hyp.booleans())
    ps = data.draw(hyp.integers(1, 5))
    layers = data.draw(hyp.integers(1, 2))
    layout = data.draw(hyp.sampled_from(["layer_first", "layer_page_first"]))
    gran = data.draw(hyp.sampled_from(["page", "token"]))
    row = sum(ITEM[d] * n for _, d, n in parts)

    def spec(pages):
        pl = "values_then_scales" if split else "interleaved"
        return st.PoolSpec("INDEXER", layers, 1, row, "fp8_e4m3", ps, pages, planes_per_layer=1,
                           row_parts=parts, page_layout=pl)  # fmt: skip

    hs, ds = spec(data.draw(hyp.integers(2, 5))), spec(data.draw(hyp.integers(2, 5)))
    per = (lambda s: s.pages) if gran == "page" else (lambda s: s.pages * ps)
    n = data.draw(hyp.integers(1, min(per(hs), per(ds))))
    src = data.draw(hyp.permutations(range(per(hs))))[:n]
    dst = data.draw(hyp.permutations(range(per(ds))))[:n]
    g = torch.Generator().manual_seed(n)
    host = torch.randint(0, 256, tuple(hs.shape(layout)), generator=g, dtype=torch.uint8)
    dev = torch.zeros(tuple(ds.shape()), dtype=torch.uint8)
    hb, db = st.PageTransferBinding(host, hs, layout), st.PageTransferBinding(dev, ds)
    t = lowlevel.PreparedPageTransfer(hb, db, src, dst, granularity=gran)
    st.TransferEngine("cpu").submit(lowlevel.PageTransferGroup([t])).wait(timeout=30)
    want = torch.zeros(dev.numel(), dtype=torch.uint8)
    hflat = host.view(-1)
    lpf = layout == "layer_page_first"
    for s, d in zip(src, dst, strict=True):
        toks = (
            [(s, k, d, k) for k in range(ps)]
            if gran == "page"
            else [(*divmod(s, ps), *divmod(d, ps))]
        )
        for sp, stok, dp, dtok in toks:
            for layer in range(layers):
                for part, (_, dt, cnt) in enumerate(parts):
                    size = ITEM[dt] * cnt
                    so = reference_offset(parts, split, ps, layers, hs.pages, layer, sp, stok,
                                          part, lpf)  # fmt: skip
                    do = reference_offset(parts, split, ps, layers, ds.pages, layer, dp, dtok,
                                          part, False)  # fmt: skip
                    assert so == hs.part_offset(layout, 0, layer, sp, stok, part)
                    want[do : do + size] = hflat[so : so + size]
    assert torch.equal(dev.view(-1), want)
