"""The selection model's closed form against a simulation of the process it describes, and
`sparsetier bench prefix-sparse` end to end."""

import itertools
import json

import numpy as np
import pytest

from sparsetier.tools import bench_prefix_sparse as bps
from sparsetier.tools.cli import main
from sparsetier.tools.selection_model import SelectionModel, _draws_for


def _zipf(m: SelectionModel, prefix: int) -> tuple[int, int, int, np.ndarray]:
    """(sinks, window pages, draws a token's budget holds, the Zipf law over the rest)."""
    pages = -(-prefix // m.page_size)
    sinks = min(m.sink_pages, pages)
    window = min(m.window_pages, pages - sinks)
    rest = pages - sinks - window
    p = 1.0 / np.arange(1, rest + 1) ** m.zipf_s
    return sinks, window, m.topk_pages - m.sink_pages - m.window_pages, p / p.sum()


def _simulate(m: SelectionModel, prefix: int, suffix: int, trials: int, seed: int) -> float:
    """Mean union size over `trials` runs of the process itself, token by token: sinks, the
    window reaching into the prefix, and the first token's Poisson number of Zipf draws; each
    later token keeps each of its predecessor's draws but with probability `churn`, and draws
    anew as many as it dropped in expectation."""
    rng = np.random.default_rng(seed)
    sinks, window, d, p = _zipf(m, prefix)
    lam = _draws_for(p, d)
    sizes = []
    for _ in range(trials):
        held = rng.poisson(lam)
        drawn = held
        for _ in range(suffix - 1):
            held = rng.binomial(held, 1 - m.churn)
            new = rng.poisson(lam * m.churn)
            held += new
            drawn += new
        sizes.append(sinks + window + np.unique(rng.choice(p.size, size=drawn, p=p)).size)
    return float(np.mean(sizes))


@pytest.mark.parametrize(
    ("churn", "prefix", "suffix"), [(1.0, 8192, 16), (0.1, 32768, 256), (0.3, 16384, 64)]
)
def test_the_closed_form_matches_a_simulation_of_the_model(churn, prefix, suffix):
    m = SelectionModel(churn=churn)
    want = _simulate(m, prefix, suffix, trials=300, seed=1)
    assert m.prefix_union(prefix, suffix) == pytest.approx(want, rel=0.01)


@pytest.mark.parametrize("zipf_s", [0.9, 1.1, 1.5])
def test_a_token_selects_its_whole_budget(zipf_s):
    """A top-k names k pages: so does one token of the model, in expectation (Zipf draws with
    replacement alone would name fewer, their duplicates merging)."""
    m = SelectionModel(zipf_s=zipf_s)
    _, _, d, p = _zipf(m, 32768)
    rng = np.random.default_rng(2)
    lam = _draws_for(p, d)
    named = [np.unique(rng.choice(p.size, size=rng.poisson(lam), p=p)).size for _ in range(2000)]
    assert np.mean(named) == pytest.approx(d, rel=0.02)
    assert m.prefix_union(32768, 1) == pytest.approx(m.topk_pages, rel=1e-6)


def test_the_model_is_near_top_k_sets_redrawn_without_replacement():
    """What the module's docs say of the Poisson draws against top-k sets: a token holds k
    distinct pages (Gumbel top-k of the Zipf law) and redraws a `churn` share of them among
    the pages it does not hold. The model names a few per cent fewer pages."""
    m = SelectionModel()
    sinks, window, d, p = _zipf(m, 32768)
    rng = np.random.default_rng(3)
    sizes = []
    for _ in range(40):
        held = set(np.argpartition(-(np.log(p) + rng.gumbel(size=p.size)), d)[:d].tolist())
        union = set(held)
        for _ in range(255):
            k = rng.binomial(d, m.churn)
            if k:
                held -= set(rng.choice(sorted(held), size=k, replace=False).tolist())
                free = np.setdiff1d(np.arange(p.size), sorted(held))
                g = np.log(p[free]) + rng.gumbel(size=free.size)
                new = free[np.argpartition(-g, k)[:k]].tolist()
                held |= set(new)
                union |= set(new)
        sizes.append(sinks + window + len(union))
    ratio = m.prefix_union(32768, 256) / np.mean(sizes)
    assert 0.9 < ratio < 1.0


def test_the_union_grows_with_the_suffix_up_to_every_prefix_page():
    m = SelectionModel()
    pages = 32768 // 64
    u = [m.prefix_union(32768, s) for s in (1, 16, 256, 4096, 10**6)]
    assert u == sorted(u) and u[-1] == pytest.approx(pages, rel=1e-3)
    # One token: its sinks, the window's pages in the prefix, and at most its draws.
    assert 1 + 8 < u[0] <= 32 + 1e-6
    assert m.prefix_union(0, 100) == m.prefix_union(32768, 0) == 0.0
    # A prefix no longer than sinks + window + draws is selected whole.
    assert SelectionModel().prefix_union(64 * 30, 1) == 30.0


def _simulate_overlap(m: SelectionModel, context: int, trials: int, seed: int) -> float:
    """Mean share of a token's pages its successor selects too, over `trials` runs of the
    process: the successor keeps each draw but with probability `churn` and makes a Poisson
    number of new ones, `churn` times a token's mean."""
    rng = np.random.default_rng(seed)
    sinks, window, d, p = _zipf(m, context)
    lam = _draws_for(p, d)
    shares = []
    for _ in range(trials):
        first = rng.choice(p.size, size=rng.poisson(lam), p=p)
        kept = first[rng.random(first.size) >= m.churn]
        second = np.concatenate([kept, rng.choice(p.size, size=rng.poisson(lam * m.churn), p=p)])
        shared = np.intersect1d(first, second).size
        shares.append((sinks + window + shared) / m.topk_pages)
    return float(np.mean(shares))


@pytest.mark.parametrize(("churn", "zipf_s"), [(0.1, 1.1), (0.5, 0.9), (1.0, 1.1), (0.3, 1.5)])
def test_the_adjacent_overlap_matches_a_simulation_of_the_model(churn, zipf_s):
    m = SelectionModel(churn=churn, zipf_s=zipf_s)
    want = _simulate_overlap(m, 65536, trials=3000, seed=4)
    assert m.adjacent_overlap(65536) == pytest.approx(want, rel=0.01)


def test_a_measured_overlap_sets_the_churn():
    m = SelectionModel()
    for overlap in (0.5, 0.6, 0.8, 0.95, 1.0):
        c = m.with_overlap(overlap, 65536)
        assert c.adjacent_overlap(65536) == pytest.approx(overlap, abs=1e-6)
        assert c.zipf_s == m.zipf_s and c.window == m.window
    assert m.with_overlap(m.adjacent_overlap(32768), 32768).churn == pytest.approx(m.churn)
    # Less overlap than independent tokens have (the sinks, the window and the Zipf law's head
    # are shared by any two) is no churn of this model.
    floor = SelectionModel(churn=1.0).adjacent_overlap(65536)
    for bad in (floor - 0.01, 1.01, float("nan")):
        with pytest.raises(ValueError, match="overlap = "):
            m.with_overlap(bad, 65536)
    with pytest.raises(ValueError, match="context_tokens"):
        m.with_overlap(0.9, 0)
    # A context the sinks, the window and one token's draws cover: every page is shared.
    assert m.adjacent_overlap(64 * 30) == 1.0


def test_bench_prefix_sparse_takes_a_measured_overlap(tmp_path, capsys):
    out = tmp_path / "ps.json"
    main(["bench", "prefix-sparse", "--prefixes", "32768", "--suffixes", "256", "--overlap",
          "0.6", "--overlap-context", "32768", "--json", str(out)])  # fmt: skip
    assert "share 60.0% of their pages over 32768 tokens" in capsys.readouterr().out
    model = json.loads(out.read_text())["config"]["model"]
    assert model["adjacent_overlap"] == pytest.approx(0.6)
    assert model["churn"] == pytest.approx(SelectionModel().with_overlap(0.6, 32768).churn)
    assert main(["bench", "prefix-sparse", "--overlap", "0.3"]) != 0
    assert "overlap = 0.3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "prefix-sparse", "--overlap", "0.6", "--churn", "0.2"])
    # Recorded selections are not the model's: its knobs are refused with them.
    npz = tmp_path / "sel.npz"
    np.savez(npz, sel=np.zeros((1, 8, 1), dtype=np.int32), page_size=64)
    for flag in ("--overlap", "--churn"):
        assert main(["bench", "prefix-sparse", "--selections", str(npz), flag, "0.6"]) != 0
        assert f"{flag[2:]} = 0.6" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"zipf_s": 0}, "zipf_s"), ({"churn": 1.5}, "churn"), ({"topk_pages": 4}, "sink_pages"),
     ({"page_size": 0}, "page_size"), ({"zipf_s": float("nan")}, "zipf_s"),
     ({"zipf_s": 300.0}, "zipf_s")],
)  # fmt: skip
def test_bad_parameters_are_refused_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SelectionModel(**kw)


def test_bench_prefix_sparse_reports_the_grid(tmp_path, capsys):
    out = tmp_path / "ps.json"
    main(["bench", "prefix-sparse", "--prefixes", "8192", "65536", "--suffixes", "16", "100000",
          "--json", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert "full/idx-only" in text and "worst policy cost / better fixed choice" in text
    cells = json.loads(out.read_text())["cells"]
    assert [(c["prefix"], c["suffix"]) for c in cells] == [
        (8192, 16), (8192, 100000), (65536, 16), (65536, 100000)
    ]  # fmt: skip
    for c in cells:
        # Indexer-K only never moves more than a full restore, and moves as much once the
        # suffix's selections cover the whole prefix.
        assert c["idx_only_bytes"] <= c["full_bytes"] * (1 + 1e-9)
        assert c["full_over_idx_only"] == pytest.approx(c["full_bytes"] / c["idx_only_bytes"])
    assert cells[1]["full_over_idx_only"] == pytest.approx(1.0, rel=1e-3)
    # A chat turn over a long prefix: mostly Indexer-K.
    assert cells[2]["full_over_idx_only"] > 3
    # Full restore: every token's KV and Indexer-K, every layer.
    assert cells[0]["full_bytes"] == 8192 * 61 * (656 + 132)
    # The core's policy, taught this suffix length, picks the cheapest choice in every cell: a
    # chat turn the predicted pages (the sink page and the window's 8 at the prefix's end, in
    # bulk; the rest on demand), a suffix that reads the whole prefix a full restore.
    for c in cells:
        assert c["policy_seen_cost"] == c["best_cost"], c
    assert (cells[2]["policy_seen"], cells[3]["policy_seen"]) == ("predicted", "full")
    assert cells[2]["pred_pages"] == 1 + 7  # page 0; the last 7 (8 share a class with 7 more)
    # The same bytes as Indexer-K only (those pages are always selected), fewer copies.
    assert cells[2]["pred_bytes"] == pytest.approx(cells[2]["idx_only_bytes"])
    assert cells[2]["pred_copies"] < cells[2]["idx_only_copies"]
    assert cells[2]["pred_cost"] < cells[2]["idx_only_cost"]


def test_bench_prefix_sparse_refuses_bad_parameters_naming_them(capsys):
    # The command reports a ConfigError as a usage error naming the field.
    for argv, field in ((["--topk", "100"], "topk = 100"), (["--churn", "2"], "churn = 2")):
        assert main(["bench", "prefix-sparse", *argv]) != 0
        err = capsys.readouterr().err
        assert field in err and "allowed" in err, err


def test_run_is_pure_arithmetic_of_the_model():
    cfg = bps.PrefixSparseConfig(prefixes=(4096,), suffixes=(8,))
    (c,) = bps.run(cfg)
    u = cfg.model.prefix_union(4096, 8)
    assert c.idx_only_bytes == pytest.approx(4096 * 61 * 132 + u * 64 * 61 * 656)
    assert c.idx_only_copies == pytest.approx((64 + u) * 61)


def test_recorded_selections_replay_through_the_bench(tmp_path, capsys):
    from sparsetier.tools.selection_model import RecordedSelections

    # Two layers, 40 tokens of 4-token pages, top-2 pages: layer 0 reads pages 0 and 1, layer 1
    # page 0 and the query's own page.
    t = np.arange(40)
    sel = np.stack([np.stack([np.zeros(40), np.ones(40)], 1),
                    np.stack([np.zeros(40), t // 4], 1)]).astype(np.int32)  # fmt: skip
    rec = RecordedSelections(sel, 4)
    # A 20-token prefix (5 pages) and 8 suffix tokens (pages 5 and 6): layer 0 names prefix
    # pages {0, 1}, layer 1 {0} (its own pages are past the prefix).
    assert rec.prefix_union(20, 8) == 1.5
    # Per page: page 0 in both layers, page 1 in one of two.
    assert rec.page_probs(20, 8).tolist() == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert rec.covers(32, 8) and not rec.covers(33, 8)
    path = tmp_path / "sel.npz"
    np.savez(path, sel=sel, page_size=4)
    out = tmp_path / "ps.json"
    main(["bench", "prefix-sparse", "--selections", str(path), "--prefixes", "20", "36",
          "--suffixes", "8", "--json", str(out)])  # fmt: skip
    assert "recorded selections (40 tokens)" in capsys.readouterr().out
    cells = json.loads(out.read_text())["cells"]
    assert [(c["prefix"], c["suffix"]) for c in cells] == [(20, 8)]  # 36 + 8 is past the end
    assert cells[0]["union_pages"] == 1.5
    with pytest.raises(ValueError, match="sel"):
        RecordedSelections(np.zeros((2, 3)), 4)


def test_token_selections_become_the_pages_they_fall_in():
    from sparsetier.tools.selection_model import RecordedSelections

    rng = np.random.default_rng(4)
    tok = rng.integers(-1, 300, size=(3, 50, 20))
    rec = RecordedSelections.from_tokens(tok, 16)
    for li in range(3):
        for t in range(50):
            want = np.unique(tok[li, t][tok[li, t] >= 0] // 16)
            got = rec.sel[li, t]
            assert sorted(got[got >= 0].tolist()) == want.tolist()
    with pytest.raises(ValueError, match="token_sel"):
        RecordedSelections.from_tokens(np.zeros((2, 3)), 16)


def test_a_recordings_adjacent_overlap_is_the_mean_share_of_pages_kept():
    from sparsetier.tools.selection_model import RecordedSelections

    rng = np.random.default_rng(5)
    sel = rng.integers(-1, 60, size=(2, 9000, 6)).astype(np.int32)  # (two chunks of rows)
    sel[0, 100] = -1  # a token that selected nothing: no pair of its own
    want = []
    for layer in sel:
        for a, b in itertools.pairwise(layer[50:]):
            a, b = np.unique(a[a >= 0]), np.unique(b[b >= 0])
            if a.size:
                want.append(np.intersect1d(a, b).size / a.size)
    assert RecordedSelections(sel, 64).adjacent_overlap(50) == pytest.approx(np.mean(want))
    with pytest.raises(ValueError, match="context_tokens"):
        RecordedSelections(sel, 64).adjacent_overlap(8999)


def test_token_selections_replay_through_the_bench_with_their_overlap(tmp_path, capsys):
    # What an engine dumps of DSA's indexer: token indices. Each token here selects the 8
    # tokens before it, so adjacent tokens share their pages but at page boundaries.
    t = np.arange(64)
    tok = np.stack([np.maximum(t[:, None] - np.arange(1, 9)[None, :], -1)]).astype(np.int32)
    path = tmp_path / "tok.npz"
    np.savez(path, token_sel=tok, page_size=4)
    out = tmp_path / "ps.json"
    argv = ["bench", "prefix-sparse", "--selections", str(path), "--prefixes", "32",
            "--suffixes", "8", "--overlap-context", "32", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "recorded selections (64 tokens; adjacent tokens share" in capsys.readouterr().out
    model = json.loads(out.read_text())["config"]["model"]
    # From token 32 on, a token's 8 tokens span 2 or 3 pages, and its successor drops at most
    # one of them.
    assert 0.5 < model["adjacent_overlap"] < 1.0


def test_page_probs_are_one_for_sinks_and_the_window_and_alike_in_the_middle():
    m = SelectionModel()  # 1 sink page, a 512-token window: the prefix's last 8 pages
    for suffix in (1, 64, 4096):
        p = m.page_probs(32768, suffix)
        assert p.shape == (512,)
        assert p[0] == 1.0 and (p[-8:] == 1.0).all()
        # The middle pages are alike (a layer's ranking of them is not positional), and
        # less likely than the positional ones.
        mid = p[1:-8]
        assert np.ptp(mid) == 0 and mid[0] < 1.0
    # A longer suffix covers more of the middle.
    assert m.page_probs(32768, 4096)[100] > m.page_probs(32768, 64)[100]


def test_the_policy_binding_refuses_what_would_mislead_it():
    from sparsetier import ConfigError
    from sparsetier._core import RestorePolicy

    pol = RestorePolicy()
    with pytest.raises(ConfigError) as e:
        pol.decide([2, 2], 2, 16, 0)  # no bytes an object: every page would pass break-even
    assert e.value.field == "object_bytes"
    with pytest.raises(ConfigError) as e:
        pol.learn(16, [2, 2], [1])
    assert e.value.field == "loaded"
    assert pol.decide([2, 2], 2, 16, 1024)["choice"] == "indexer"  # nothing learned yet


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda p: p.decide([2, -1], 2, 16, 1024), "absent[1]"),
        (lambda p: p.decide([2, 2**32], 2, 16, 1024), "absent[1]"),
        (lambda p: p.decide([2.5, 2], 2, 16, 1024), "absent"),
        (lambda p: p.decide([2, 2], -2, 16, 1024), "layers"),
        (lambda p: p.decide([2, 2], 2, -16, 1024), "suffix"),
        (lambda p: p.decide([2, 2], 2, 16, -1), "object_bytes"),
        (lambda p: p.decide([2, 2], 2, 16, 1024, first=-1), "first"),
        (lambda p: p.learn(-16, [2, 2], [1, 1]), "suffix"),
        (lambda p: p.learn(16, [2, 2], [1, -1]), "loaded[1]"),
        (lambda p: p.learn(16, [2, 2], [1, 1], first=2**40), "first"),
        (lambda p: p.coverage(-1), "suffix"),
        # Counts no prefix has: more loaded than were off the device, more objects a page
        # than layers, no layer.
        (lambda p: p.learn(16, [2, 2], [1, 3]), "loaded[1]"),
        (lambda p: p.decide([2, 3], 2, 16, 1024), "absent[1]"),
        (lambda p: p.decide([0, 0], 0, 16, 1024), "layers"),
    ],
)
def test_the_policy_binding_names_a_bad_count(call, field):
    # Negative or oversized counts are ConfigErrors naming the field (and the index), never
    # a bare OverflowError or TypeError, and the policy learns nothing from the call.
    from sparsetier import ConfigError
    from sparsetier._core import RestorePolicy

    pol = RestorePolicy()
    with pytest.raises(ConfigError) as e:
        call(pol)
    assert e.value.field == field
    assert pol.coverage(16) is None
    for overhead in (-1, 2**32):  # (within u32, as the joined scheduler's)
        with pytest.raises(ConfigError) as e:
            RestorePolicy(copy_overhead=overhead)
        assert e.value.field == "copy_overhead"
