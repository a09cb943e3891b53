"""Token mode's tokens mapped to pages on the selection's device (`sparsetier.token_map`),
against a per-row reference, and the plan of the mapped rows against the plan of the tokens."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as stx
from scheduler_support import end_steps_alike, small_scheduler

import sparsetier as st
from sparsetier import testing
from sparsetier.token_map import TokenMapper, map_tokens


def reference(row, ps):
    pages = {}
    for t in set(row):
        if t >= 0:
            pages[t // ps] = pages.get(t // ps, 0) + 1
    return sorted(pages.items())


@stx.composite
def selections(draw):
    b = draw(stx.integers(1, 4))
    k = draw(stx.integers(1, 12))
    ps = draw(stx.sampled_from([1, 2, 4, 8]))
    rows = []
    for _ in range(b):
        n = draw(stx.integers(0, k))
        # Tokens may repeat (a synthetic or merged selection): each counts once.
        toks = draw(stx.lists(stx.integers(0, 60), min_size=n, max_size=n))
        row = toks + [-1] * (k - n)
        rows.append(draw(stx.permutations(row)))
    return torch.tensor(rows, dtype=torch.int64), ps


@given(selections())
def test_pages_counts_and_inverse_match_a_per_row_reference(case):
    sel, ps = case
    tp = map_tokens(sel, ps)
    pages, counts = tp.to_host()
    assert pages.dtype == np.int64 and counts.dtype == np.int32
    width = pages.shape[1]
    for b, row in enumerate(sel.tolist()):
        ref = reference(row, ps)
        assert width >= len(ref)
        got = [(int(p), int(c)) for p, c in zip(pages[b], counts[b], strict=True) if c > 0]
        assert got == ref
        assert all(p == -1 for p in pages[b][len(ref) :])
        # Each token's column names its page.
        for j, t in enumerate(row):
            if t >= 0:
                assert pages[b][int(tp.inverse[b, j])] == t // ps


def test_a_token_table_gives_each_token_its_page_slot():
    sel = torch.tensor([[9, 0, 3, -1], [-1, -1, 5, 4]])
    tp = map_tokens(sel, 4)
    pages, counts = tp.to_host()
    assert pages.tolist() == [[0, 2], [1, -1]] and counts.tolist() == [[2, 1], [2, 0]]
    page_table = torch.tensor([[70, 72], [81, -1]], dtype=torch.int32)
    assert tp.token_table(page_table).tolist() == [[72, 70, 70, 70], [81, 81, 81, 81]]


def test_empty_batches_and_rows_map_to_nothing():
    for shape in ((0, 4), (2, 0), (0, 0)):
        tp = map_tokens(torch.zeros(shape, dtype=torch.int64), 4)
        pages, counts = tp.to_host()
        assert pages.shape == (shape[0], min(1, shape[1])) and not counts.any()
    pages, counts = map_tokens(torch.full((2, 3), -1), 4).to_host()
    assert pages.tolist() == [[-1], [-1]] and counts.tolist() == [[0], [0]]


def test_bad_input_is_a_typed_error():
    with pytest.raises(st.ConfigError) as e:
        map_tokens(torch.zeros(4, dtype=torch.int64), 4)
    assert e.value.field == "selection"
    with pytest.raises(st.ConfigError) as e:
        map_tokens(torch.zeros((1, 4), dtype=torch.int32), 4)
    assert e.value.field == "selection"
    with pytest.raises(st.ConfigError) as e:
        map_tokens(torch.zeros((1, 4), dtype=torch.int64), 0)
    assert e.value.field == "page_size"


def _scheduler(keep=True):
    s = small_scheduler(4, 32, 64, 2, {0: 30, 1: 21})
    s.keep_selections = keep
    testing.evict_device(s, 1000)  # everything on host: the plans load
    return s


@pytest.mark.parametrize("keep", [True, False])
def test_a_plan_of_mapped_pages_counts_as_the_plan_of_the_tokens(keep):
    rng = np.random.default_rng(3)
    a, b = _scheduler(keep), _scheduler(keep)
    for _ in range(4):
        a.append([0, 1])
        b.append([0, 1])
        lens = [a.request_len(0), a.request_len(1)]
        for layer in range(2):
            sel = torch.tensor(
                [sorted(rng.choice(n, size=6, replace=False).tolist()) for n in lens]
            )
            pa, ta = a.plan(layer, [0, 1], sel.numpy(), 1)
            tp = map_tokens(sel, 4)
            pages, counts = tp.to_host()
            pb, tb = b.plan(layer, [0, 1], pages, 4, counts)
            assert tb.shape == pages.shape
            a.ready(pa)
            b.ready(pb)
            # Each token's slot holds its page in both: the same pages, both resident.
            slots_a = torch.from_numpy(ta)
            slots_b = tp.token_table(torch.from_numpy(tb))
            assert ((slots_a >= 0) == (slots_b >= 0)).all()
            a.finish(pa)
            b.finish(pb)
        fields = ("selected", "pages", "bytes_needed", "bytes_needed_of_transferred", "loaded")
        end_steps_alike(a, b, fields)
    a.validate()
    b.validate()


def test_bad_counts_are_typed_errors_naming_the_field():
    s = _scheduler()
    s.append([0, 1])
    pages = np.array([[0, 1], [2, -1]], dtype=np.int64)
    cases = [
        (np.array([[1, 1]], dtype=np.int32), st.ConfigError, "counts.shape"),
        (np.array([[1, 5], [1, 0]], dtype=np.int32), st.OutOfRangeError, "counts[0][1]"),
        (np.array([[1, -2], [1, 0]], dtype=np.int32), st.OutOfRangeError, "counts[0][1]"),
        (np.array([[0, 1], [1, 0]], dtype=np.int32), st.OutOfRangeError, "counts[0][0]"),
        (np.array([[1, 1], [1, 0]], dtype=np.int64), st.ConfigError, "counts"),
    ]
    for counts, exc, field in cases:
        with pytest.raises(exc) as e:
            s.plan(0, [0, 1], pages, 4, counts)
        assert e.value.field == field, (counts, e.value)
    with pytest.raises(st.ConfigError) as e:
        s.plan(0, [0, 1], pages, 1, np.ones((2, 2), dtype=np.int32))
    assert e.value.field == "unit"
    s.validate()
    plan, _ = s.plan(0, [0, 1], pages, 4, np.array([[4, 2], [3, 0]], dtype=np.int32))
    s.ready(plan)
    s.finish(plan)
    s.validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: torch sees none")
def test_the_mapping_on_the_gpu_equals_the_cpu_one():
    # DeepSeek-V3.2's shape of one layer: 64 rows of top-2048 tokens over 64-token pages.
    g = torch.Generator().manual_seed(1)
    sel = torch.randint(0, 1 << 17, (64, 2048), generator=g)
    sel[3, :100] = -1
    cpu = map_tokens(sel, 64)
    gpu = map_tokens(sel.cuda(), 64)
    for a, b in zip(cpu.to_host(), gpu.to_host(), strict=True):
        assert np.array_equal(a, b)
    assert torch.equal(cpu.inverse, gpu.inverse.cpu())


def _same(a, b):
    for x, y in zip(a.to_host(), b.to_host(), strict=True):
        assert np.array_equal(x, y)
    assert torch.equal(a.inverse.cpu(), b.inverse.cpu())


@given(selections())
def test_the_mapper_maps_as_map_tokens_does(case):
    # On the CPU the mapper is `map_tokens` (graphs are a CUDA thing).
    sel, ps = case
    mapper = TokenMapper(ps)
    _same(mapper(sel), map_tokens(sel, ps))
    assert mapper.replays == 0


def test_the_mapper_refuses_what_map_tokens_refuses():
    with pytest.raises(st.ConfigError) as e:
        TokenMapper(0)
    assert e.value.field == "page_size"
    with pytest.raises(st.ConfigError) as e:
        TokenMapper(4)(torch.zeros((1, 4), dtype=torch.int32))
    assert e.value.field == "selection"


def _gpu_selection(seed, b=64, k=2048):
    g = torch.Generator().manual_seed(seed)
    sel = torch.randint(0, 1 << 17, (b, k), generator=g)
    sel[seed % b, : 100 + seed] = -1
    return sel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: torch sees none")
def test_the_graphed_mapping_on_the_gpu_equals_the_eager_one():
    mapper = TokenMapper(64)
    for seed in range(4):  # one capture, then replays over new selections
        sel = _gpu_selection(seed)
        got = mapper(sel.cuda())
        _same(got, map_tokens(sel, 64))
    assert mapper.replays == 4 and mapper.graphs
    # Another shape (a batch that shrank) is another graph; the first one still replays.
    small = _gpu_selection(7, b=5)
    _same(mapper(small.cuda()), map_tokens(small, 64))
    _same(mapper(_gpu_selection(8).cuda()), map_tokens(_gpu_selection(8), 64))
    assert mapper.replays == 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: torch sees none")
def test_a_capture_that_fails_maps_eagerly(monkeypatch):
    def refuse(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph", refuse)
    mapper = TokenMapper(64)
    sel = _gpu_selection(1)
    _same(mapper(sel.cuda()), map_tokens(sel, 64))
    assert not mapper.graphs and mapper.replays == 0
