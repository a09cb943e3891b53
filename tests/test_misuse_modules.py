"""Misuse of the Python modules' public calls (replay, token_map, kv_format, fp8, keys,
presets, indexer, attention, the Mooncake client): bad input is a typed error naming the
field, raised before anything changes, never a misread or an error from deep in numpy/torch.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from sparsetier import fp8, replay
from sparsetier.attention import attend, sparse_attention, sparse_attention_batched
from sparsetier.errors import ConfigError, OutOfRangeError
from sparsetier.indexer import select_blocks, select_from_scores
from sparsetier.keys import object_keys
from sparsetier.kv_format import kv_format
from sparsetier.presets import DEEPSEEK_V32, RowFormat, RowPart
from sparsetier.token_map import TokenMapper, map_tokens

# ---- keys ----


def test_object_keys_of_shapes_that_do_not_broadcast_name_the_argument():
    with pytest.raises(ConfigError) as e:
        object_keys([1, 2, 3], [10, 11])
    assert e.value.field == "pages"


# ---- fp8 ----


def _page(n: int = 4):
    x = torch.randn(n, 128, generator=torch.Generator().manual_seed(0))
    v, s = fp8.quantize(x)
    return torch.zeros(2, fp8.page_bytes(4, 128), dtype=torch.uint8), v, s


@pytest.mark.parametrize(
    "slots, scales, err",
    [
        ([0, 1, 2, 8], None, OutOfRangeError),  # past the pages: an IndexError, half written
        ([0, 1, 2, -1], None, OutOfRangeError),  # wrapped to the last page's last token
        ([0, 1, 2, 3], torch.float64, ConfigError),  # values written, then the scales failed
        ([0.0, 1.0, 2.0, 3.0], None, ConfigError),
        ([0, 1], None, ConfigError),
    ],
)
def test_fp8_store_refuses_bad_slots_and_scales_before_writing(slots, scales, err):
    pages, v, s = _page()
    with pytest.raises(err) as e:
        fp8.store(pages, torch.tensor(slots), v, s if scales is None else s.to(scales))
    assert e.value.field in ("slots", "scales")
    assert not pages.any(), "nothing written"


def test_fp8_gather_and_load_refuse_pages_of_another_row_size():
    pages, v, s = _page()
    fp8.store(pages, torch.arange(4), v, s)
    for call in (lambda: fp8.gather(pages, torch.tensor([1]), 64), lambda: fp8.load(pages, 64)):
        with pytest.raises(ConfigError) as e:  # gather read garbage; load a RuntimeError
            call()
        assert e.value.field == "pages"
    with pytest.raises(OutOfRangeError):
        fp8.gather(pages, torch.tensor([-1]), 128)
    # Narrow signed slots index as int64 would; uint8 ones would index as a mask.
    want = fp8.gather(pages, torch.tensor([1, 3]), 128)
    for dtype in (torch.int8, torch.int16, torch.int32):
        assert torch.equal(fp8.gather(pages, torch.tensor([1, 3], dtype=dtype), 128), want)
    with pytest.raises(ConfigError) as e:
        fp8.gather(pages, torch.tensor([1, 3], dtype=torch.uint8), 128)
    assert e.value.field == "slots"


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: fp8.quantize(torch.randn(128)), "x"),
        (lambda: fp8.quantize(torch.randn(2, 128), block=0), "block"),
        (lambda: fp8.quantize(torch.randn(2, 0)), "head_dim"),
        (lambda: fp8.page_bytes(-1, 128), "page_size"),
        (lambda: fp8.page_bytes(64.5, 128), "page_size"),
        (lambda: fp8.page_bytes(64, 200), "head_dim"),
        (
            lambda: fp8.dequantize(torch.zeros(4, 128, dtype=torch.uint8), torch.ones(1, 1)),
            "scales",
        ),
        (lambda: fp8.dequantize(torch.zeros(4, 128), torch.ones(4, 1)), "values"),
    ],
)
def test_fp8_shapes_and_sizes_are_checked(call, field):
    with pytest.raises(ConfigError) as e:
        call()
    assert e.value.field == field


# ---- token_map ----


@pytest.mark.parametrize("page_size", [True, 16.0, 2.5, "16"])
def test_map_tokens_page_size_is_an_integer(page_size):
    sel = torch.tensor([[0, 5, 17, -1]])
    for call in (lambda: map_tokens(sel, page_size), lambda: TokenMapper(page_size)(sel)):
        with pytest.raises(ConfigError) as e:
            call()
        assert e.value.field == "page_size"


def test_map_tokens_refuses_entries_below_minus_one_and_non_tensors():
    with pytest.raises(ConfigError):
        map_tokens(torch.tensor([[0, -5, 17]]), 16)  # was skipped as "none"
    with pytest.raises(ConfigError):
        map_tokens([[0, 1]], 16)  # was an AttributeError


@pytest.mark.parametrize("table", [[[7], [1]], [[7.5, 8.0], [1.0, 2.0]], [[7, 8]]])
def test_a_token_table_refuses_a_page_table_it_would_misread(table):
    tp = map_tokens(torch.tensor([[0, 5, 17, -1], [3, 3, 20, 2]]), 16)
    with pytest.raises(ConfigError) as e:  # too narrow: page 1's tokens read page 0's slot
        tp.token_table(torch.tensor(table))
    assert e.value.field == "page_table"


def test_a_token_table_of_no_selected_token_is_empty():
    tp = map_tokens(torch.zeros((2, 0), dtype=torch.int64), 16)
    assert tp.token_table(torch.zeros((2, 0), dtype=torch.int32)).shape == (2, 0)


# ---- kv_format, presets ----


@pytest.mark.parametrize(
    "args, field",
    [((-1, 64, 128), "kv_heads"), ((2, True, 128), "head_dim"), ((2, 64, 2.5), "indexer_dim")],
)
def test_an_fp8_format_of_bad_sizes_is_refused_naming_them(args, field):
    with pytest.raises(ConfigError) as e:
        kv_format("fp8", *args)
    assert e.value.field == field


def test_preset_rows_are_checked_when_made():
    for make, field in (
        (lambda: RowPart("v", "int8", 4), "dtype"),  # .bytes was a KeyError
        (lambda: RowPart("v", "fp32", -4), "count"),  # -16 bytes
        (lambda: RowPart("v", "fp32", 4.5), "count"),
        (lambda: RowFormat((RowPart("v", "fp32", 4),), page_layout="zzz"), "page_layout"),
        (lambda: DEEPSEEK_V32.kv.page_bytes(-1), "page_size"),
    ):
        with pytest.raises(ConfigError) as e:
            make()
        assert e.value.field == field


# ---- indexer ----


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"topk": -1}, "topk"),  # returned every column but the last
        ({"topk": True}, "topk"),
        ({"unit": 0}, "unit"),
        ({"unit": 8.0}, "unit"),
        ({"window": -1}, "window"),
        ({"positions": torch.tensor([39])}, "positions"),  # broadcast to both rows
        ({"positions": torch.tensor([39.0, 20.0])}, "positions"),
        ({"scores": torch.rand(40)}, "scores"),
    ],
)
def test_select_from_scores_checks_its_arguments(kw, field):
    args = {"scores": torch.rand(2, 40), "positions": torch.tensor([39, 20])}
    args |= {"mode": "block", "unit": 8, "topk": 3, "window": 1} | kw
    with pytest.raises(ConfigError) as e:
        select_from_scores(args.pop("scores"), args.pop("positions"), **args)
    assert e.value.field == field


@pytest.mark.parametrize("pos", [-1, 100, 10.5])
def test_select_blocks_position_lies_in_the_scores(pos):
    with pytest.raises(ConfigError) as e:  # -1: an empty selection; 100: the window dropped
        select_blocks(torch.rand(40), pos, 8, 3, 1, "max")
    assert e.value.field == "pos"


def test_select_blocks_names_scores_of_another_shape():
    with pytest.raises(ConfigError) as e:  # (was named as the [1, 1, S] tensor made of them)
        select_blocks(torch.rand(1, 40), 10, 8, 3, 1, "max")
    assert e.value.field == "token_scores" and "[1, 40]" in e.value.value


# ---- attention ----

HQ, HKV, D, PS = 4, 2, 8, 4


def _pool():
    return torch.randn(2, 1, 6, PS, HKV, D, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"q": torch.randn(2, 1, D)}, "q"),  # fewer heads than KV heads: an empty answer
        ({"q": torch.randn(2, 3, D)}, "q"),
        ({"positions": torch.tensor([7])}, "positions"),  # broadcast to both rows
        ({"table": torch.tensor([[0.5, 1.5], [2.5, -1.0]])}, "table"),  # truncated
        ({"table": torch.tensor([[0], [2]])}, "table"),
        ({"unit": 6}, "unit"),  # an entry straddles pages: read from its first page's slot
        ({"unit": 0}, "unit"),
        ({"page_size": 2}, "kv_pool"),
    ],
)
def test_batched_attention_refuses_what_it_would_misread(change, field):
    args = {
        "q": torch.randn(2, HQ, D),
        "kv_pool": _pool(),
        "table": torch.tensor([[0, 1], [2, -1]]),
        "selection": torch.tensor([[0, 1], [0, -1]]),
        "positions": torch.tensor([7, 3]),
        "unit": 4,
        "page_size": PS,
    } | change
    with pytest.raises(ConfigError) as e:
        sparse_attention_batched(**args)
    assert e.value.field == field


def test_single_token_attention_refuses_mismatched_inputs():
    k = v = torch.randn(5, HKV, D)
    q = torch.randn(HQ, D)
    for call, field in (
        (lambda: attend(q, k, v, torch.ones(1, dtype=torch.bool)), "mask"),  # broadcast
        (lambda: attend(torch.randn(1, D), k, v, torch.ones(5, dtype=torch.bool)), "q"),
        (lambda: sparse_attention(q, _pool(), torch.tensor([0, 1]), torch.tensor([0]), 6, PS),
         "slots"),
        (lambda: sparse_attention(q, _pool(), torch.tensor([0]), torch.tensor([0]), -1, PS),
         "pos"),
    ):  # fmt: skip
        with pytest.raises(ConfigError) as e:
            call()
        assert e.value.field == field
    # int16 slots read as int64 ones would (torch indexes with neither int16 nor int8).
    pool, blocks = _pool(), torch.tensor([0, 1])
    want = sparse_attention(q, pool, blocks, torch.tensor([0, 1]), 6, PS)
    got = sparse_attention(q, pool, blocks, torch.tensor([0, 1], dtype=torch.int16), 6, PS)
    assert torch.equal(got, want)


# ---- replay ----


@pytest.fixture(scope="module")
def trace():
    return replay.synthetic_trace(200, 256, 16)


@pytest.mark.parametrize(
    "budget, link, field",
    [
        (200, {"bandwidth_gbps": float("nan")}, "bandwidth_gbps"),  # NaN ms per step
        (200, {"bandwidth_gbps": -1.0}, "bandwidth_gbps"),
        (200, {"bandwidth_gbps": 10.0, "window_ms": -5.0}, "window_ms"),  # exposed > transfer
        (200, {"bandwidht_gbps": 10.0}, "link"),  # ignored
        (True, {}, "budget"),
        (50.5, {}, "budget"),
    ],
)
def test_replay_one_checks_budget_and_link(trace, budget, link, field):
    with pytest.raises(ConfigError) as e:
        replay.replay_one(trace, budget, "lru", 200, **link)
    assert e.value.field == field


@pytest.mark.parametrize("share", [float("nan"), float("inf"), -0.5, 0])
def test_sweep_shares_are_positive_numbers(trace, share):
    with pytest.raises(ConfigError) as e:
        replay.sweep(trace, [share, 0.5], policies=("lru",))
    assert e.value.field == "shares"


def test_sweep_takes_its_shares_from_an_iterator_too(trace):
    # The checks read the shares before the budgets do: a generator must not be spent.
    as_list = replay.sweep(trace, [0.5, 0.2], policies=("lru",))
    as_iter = replay.sweep(trace, (s for s in [0.5, 0.2]), policies=("lru",))
    assert [r.budget for r in as_iter] == [r.budget for r in as_list] and len(as_list) == 3
    with pytest.raises(ConfigError) as e:  # 0 is refused too: the message says so
        replay.sweep(trace, [-0.5], policies=("lru",))
    assert e.value.allowed == "a finite number > 0"


@pytest.mark.parametrize("rate", [float("nan"), 2.0, -1.0])
def test_budget_for_hit_rate_is_a_fraction(trace, rate):
    with pytest.raises(ConfigError) as e:  # NaN and 2 were "unreachable", -1 a budget
        replay.budget_for(trace, "lru", rate)
    assert e.value.field == "hit_rate"


def test_traces_saved_or_loaded_wrong_are_config_errors(trace, tmp_path):
    with pytest.raises(ConfigError):
        replay.save_trace(str(tmp_path / "a.npz"), {"ops": trace["ops"]})  # was a KeyError
    arrays = {k: trace[k] for k in replay.ARRAYS}
    for i, (ob, slots) in enumerate(
        [(np.array([1, 2]), np.uint64(5)), (np.float64(1.5), np.int64(200)), (1, -5)]
    ):
        path = str(tmp_path / f"t{i}.npz")
        np.savez(path, **arrays, object_bytes=ob, device_slots=slots)
        with pytest.raises(ConfigError):
            replay.load_trace(path)
    path = str(tmp_path / "obj.npz")
    np.savez(path, **{**arrays, "ops": np.array([1, 2], dtype=object)}, object_bytes=1,
             device_slots=5)  # fmt: skip
    with pytest.raises(ConfigError):  # was numpy's ValueError about pickles
        replay.load_trace(path)


# ---- the Mooncake client ----


def test_mooncake_refuses_caller_mistakes_without_going_offline(master):
    from sparsetier.l3 import MooncakeStore

    kw = {"master": master.master, "metadata_server": master.metadata_server}
    for bad, field in (
        ({"global_segment_size": 1.5e8}, "global_segment_size"),
        ({"global_segment_size": True}, "global_segment_size"),  # was "store unreachable"
        ({"master": None}, "master"),
    ):
        with pytest.raises(ConfigError) as e:
            MooncakeStore(**kw | bad)
        assert e.value.field == field
    s = MooncakeStore(**kw)
    try:
        buf = ctypes.create_string_buffer(256)
        a = ctypes.addressof(buf)
        s.register(a, 256)
        assert s.put(["k1"], [[(a, 64)]]) == [True]
        for call, field in (
            (lambda: s.put(["k2", "k3"], [[(a, 64)]]), "pages"),  # was "store unreachable"
            (lambda: s.get(["k1", "k3"], [[(a, 64)]]), "pages"),
            (lambda: s.put(["k4"], [[(a, 0)]]), "pages[0]"),
            (lambda: s.put(["k4"], [[]]), "pages[0]"),
            (lambda: s.put(["k1.m"], [[(a, 64)]]), "keys[0]"),  # k1's manifest, overwritten
            (lambda: s.exists("k1"), "keys"),  # was ["k", "1"]
            (lambda: s.remove("k1"), "keys"),  # removed "k" and "1"
            (lambda: s.register(0, 64), "address"),
        ):
            with pytest.raises(ConfigError) as e:
                call()
            assert e.value.field == field
        assert s.exists(["k1"]) == [True] and s.get(["k1"], [[(a, 64)]]) == [True]
    finally:
        s.close()
