"""What a decode-side LRU misses under the selection model (`lru_misses`), and
`bench prefix-sparse --lru-ratio`."""

import json
from collections import OrderedDict

import pytest

from sparsetier.tools.cli import main
from sparsetier.tools.lru_misses import lru_misses, lru_step
from sparsetier.tools.selection_model import SelectionModel


@pytest.mark.parametrize(("churn", "query_tokens"), [(1.0, 1), (0.3, 1), (0.3, 3), (0.1, 2)])
def test_an_empty_cache_misses_the_union_of_a_steps_tokens(churn, query_tokens):
    # With no room every selected page misses: a step's misses are the union of its query
    # tokens' pages, which the model's closed form gives (the union over a suffix of that many
    # tokens).
    m = SelectionModel(churn=churn)
    want = m.prefix_union(32768, query_tokens) * m.page_size
    got = lru_misses(m, 32768, 0, query_tokens=query_tokens, steps=1500, seed=1)
    assert got == pytest.approx(want, rel=0.02)


def test_the_cache_evicts_the_least_recently_read_page():
    cache: OrderedDict[int, None] = OrderedDict()
    assert lru_step(cache, [1, 2, 3], 3) == 3
    assert lru_step(cache, [1], 3) == 0  # 1 is now the most recent: 2 goes next
    assert lru_step(cache, [4], 3) == 1 and list(cache) == [3, 1, 4]
    assert lru_step(cache, [2, 3], 3) == 1 and list(cache) == [4, 2, 3]
    # A step selecting more than the cache holds misses what was not held when it began,
    # and leaves its last pages.
    assert lru_step(cache, [5, 6, 7, 3], 2) == 3 and list(cache) == [7, 3]
    assert lru_step(cache, [3], 0) == 0 and not cache


def test_a_budget_of_only_sinks_and_window_selects_nothing_else():
    # topk 9 pages = 1 sink + the 512-token window's 8: no Zipf draws at all.
    m = SelectionModel(topk_pages=9, churn=1.0)
    assert lru_misses(m, 32768, 0) == 9 * 64
    assert lru_misses(m, 32768, 9 * 64) == 0.0


def test_a_cache_that_holds_the_context_misses_nothing_once_warm():
    m = SelectionModel(churn=1.0)
    assert lru_misses(m, 16384, 16384, query_tokens=2) == 0.0
    # Tokens that never change what they select miss nothing once their pages are in.
    assert lru_misses(SelectionModel(churn=0.0), 32768, 4096) == 0.0
    # A context no longer than a token's selection is selected whole, every step.
    assert lru_misses(m, 64 * 30, 0) == 30 * 64


def test_misses_fall_with_room_and_rise_with_churn_and_query_tokens():
    m = SelectionModel()
    by_room = [lru_misses(m, 32768, int(r * 32768)) for r in (0.05, 0.1, 0.2, 0.5)]
    assert by_room == sorted(by_room, reverse=True) and by_room[-1] < by_room[0] / 3
    by_churn = [lru_misses(SelectionModel(churn=c), 32768, 6553) for c in (0.02, 0.1, 0.3)]
    assert by_churn == sorted(by_churn) and by_churn[0] < by_churn[-1] / 5
    by_tokens = [lru_misses(m, 32768, 6553, query_tokens=q) for q in (1, 2, 3)]
    assert by_tokens == sorted(by_tokens)


def test_the_same_seed_gives_the_same_figure():
    m = SelectionModel(churn=0.2)
    assert lru_misses(m, 65536, 13107, seed=5) == lru_misses(m, 65536, 13107, seed=5)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"context_tokens": 0}, "context_tokens"),
        ({"capacity_tokens": -1}, "capacity_tokens"),
        ({"query_tokens": 0}, "query_tokens"),
        ({"steps": 0}, "steps"),
        ({"steps": 2.5}, "steps"),
        ({"query_tokens": True}, "query_tokens"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kw, field):
    args = {"context_tokens": 8192, "capacity_tokens": 1024} | kw
    context, capacity = args.pop("context_tokens"), args.pop("capacity_tokens")
    with pytest.raises(ValueError, match=f"^{field} = "):
        lru_misses(SelectionModel(), context, capacity, **args)


def test_bench_prefix_sparse_reports_the_lru_misses(tmp_path, capsys):
    out = tmp_path / "lru.json"
    argv = ["bench", "prefix-sparse", "--prefixes", "8192", "16384", "--suffixes", "16"]
    argv += ["--churn", "0.2", "--lru-ratio", "0.2", "--lru-query-tokens", "2"]
    main([*argv, "--json", str(out)])
    text = capsys.readouterr().out
    assert "decode LRU holding 0.2 of the context, 2 query token(s) a step" in text
    lru = json.loads(out.read_text())["lru"]
    m = SelectionModel(churn=0.2)
    assert lru["ratio"] == 0.2 and lru["query_tokens"] == 2
    assert lru["misses_per_step"] == {
        str(c): lru_misses(m, c, int(0.2 * c), query_tokens=2) for c in (8192, 16384)
    }


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (["--lru-query-tokens", "2"], "lru_query_tokens"),
        (["--lru-ratio", "0"], "lru_ratio"),
        (["--lru-ratio", "1.5"], "lru_ratio"),
        (["--lru-ratio", "nan"], "lru_ratio"),
        (["--lru-ratio", "0.2", "--lru-query-tokens", "0"], "lru_query_tokens"),
    ],
)
def test_bench_prefix_sparse_refuses_bad_lru_flags(extra, field, capsys):
    argv = ["bench", "prefix-sparse", "--prefixes", "8192", "--suffixes", "16", *extra]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert field in err, err


def test_lru_misses_are_refused_with_recorded_selections(tmp_path, capsys):
    import numpy as np

    path = tmp_path / "sel.npz"
    np.savez(path, sel=np.zeros((2, 64, 4), np.int32), page_size=np.int64(16))
    argv = ["bench", "prefix-sparse", "--selections", str(path), "--lru-ratio", "0.2"]
    assert main(argv) != 0
    assert "lru_ratio" in capsys.readouterr().err
