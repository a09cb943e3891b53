"""The prefix cache from Python: every common token container (zero-copy or one narrowing),
result objects instead of dicts, defaults that cannot trap, and both evictable figures."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

import sparsetier as st

SEQ = np.random.default_rng(0).integers(1, 32000, size=40)


def containers(seq: np.ndarray) -> dict[str, object]:
    return {
        "numpy uint32": seq.astype(np.uint32),
        "numpy int64": seq.astype(np.int64),
        "numpy int32": seq.astype(np.int32),
        "numpy uint64": seq.astype(np.uint64),
        "array q": array("q", seq.tolist()),
        "array i": array("i", seq.tolist()),
        "array I": array("I", seq.tolist()),
        "torch int64": torch.from_numpy(seq.astype(np.int64)),
        "torch int32": torch.from_numpy(seq.astype(np.int32)),
        "bytes": seq.astype("<u4").tobytes(),
        "bytearray": bytearray(seq.astype("<u4").tobytes()),
        "memoryview": memoryview(seq.astype("<u4").tobytes()),
        "list": seq.tolist(),
        "strided numpy": np.repeat(seq, 2)[::2],
    }


@pytest.mark.parametrize("kind", list(containers(SEQ)))
def test_every_token_container_gives_the_same_answers(kind):
    toks = containers(SEQ)[kind]
    ref = st.HiCache(4, 64)
    m = ref.match_prefix(SEQ.astype(np.uint32), alloc=True)
    ref.insert(SEQ.astype(np.uint32), m, unlock=m.device_node)
    c = st.HiCache(4, 64)
    m = c.match_prefix(toks, alloc=True)
    r = c.insert(toks, m, unlock=m.device_node)
    assert r.prefix_len == 0
    # Each container finds what the uint32 one inserted, and vice versa.
    assert c.match_prefix(SEQ.astype(np.uint32)).device_len == 40
    assert ref.match_prefix(toks).device_len == 40
    assert c.match_prefix(toks[: len(toks) // 2] if kind != "memoryview" else toks).device_len


@pytest.mark.parametrize(
    ("toks", "value"),
    [
        (np.array([1, -1], dtype=np.int64), "-1"),
        (array("q", [1, 2**32]), str(2**32)),
        (torch.tensor([5, -7]), "-7"),
        ([3, 2**40], str(2**40)),
    ],
)
def test_tokens_out_of_range_name_the_value(toks, value):
    c = st.HiCache(1, 8)
    # match_prefix reads only as far as it matches (a list is converted whole and refused
    # there); insert refuses the value and inserts nothing: the new pages stay the caller's.
    if isinstance(toks, list):
        with pytest.raises(st.OutOfRangeError):
            c.match_prefix(toks, alloc=True)
        m = None
    else:
        m = c.match_prefix(toks, alloc=True)
    pages = c.alloc_device(len(toks)) if m is None else m.pages
    with pytest.raises(st.OutOfRangeError) as e:
        c.insert(toks, pages)
    assert e.value.field == "tokens" and str(e.value.value) == value
    c.free_device(pages)
    if m is not None:
        c.unlock(m.device_node)
    assert c.stats()["device_free"] == c.stats()["device_capacity"]
    c.validate()
    # A plain lookup reads only as far as it matches: an id no token can have ends the match.
    if not isinstance(toks, list):
        assert c.match_prefix(toks).device_len == 0


def test_bad_token_containers_are_refused():
    c = st.HiCache(1, 8)
    with pytest.raises(st.ConfigError) as e:
        c.match_prefix(b"abc")  # not whole uint32s
    assert e.value.field == "tokens"
    with pytest.raises(st.ConfigError):
        c.match_prefix(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(st.ConfigError):
        c.match_prefix("hello")


def test_results_are_objects_that_still_read_like_dicts():
    c = st.HiCache(2, 16)
    toks = np.arange(1, 9, dtype=np.uint32)
    m = c.match_prefix(toks, alloc=True)
    assert isinstance(m, st.PrefixMatch)
    assert (m.device_len, m["device_len"], m.host_len) == (0, 0, 0)
    assert len(m.new_pages) == 4 and len(m.device_pages) == 0
    assert list(m.pages) == list(m["new_pages"])
    assert "new_pages" in m and "storage_pages" not in m
    assert set(m.to_dict()) == {
        "device_len", "host_len", "device_pages", "device_node", "last_node", "new_pages"
    }  # fmt: skip
    with pytest.raises(KeyError):
        m["nope"]
    r = c.insert(toks, m, lock=True, unlock=m.device_node)
    assert isinstance(r, st.PrefixInsert)
    assert (r.prefix_len, r["prefix_len"], len(r.duplicates)) == (0, 0, 0)
    m2 = c.match_prefix(toks)
    assert m2.new_pages is None and "new_pages" not in m2
    assert list(m2.device_pages) == list(m.pages)
    # The page views share the result's buffer (no copy) and outlive their result.
    pages = m2.device_pages
    assert pages.base is not None
    del m2
    assert list(pages) == list(m.pages)
    c.unlock(r.last_node)


def test_writing_into_a_view_does_not_change_what_insert_takes():
    c = st.HiCache(1, 8)
    m = c.match_prefix(np.arange(1, 4), alloc=True)
    given = list(m.pages)
    m.pages[0] = -5  # the view is the caller's
    c.insert(np.arange(1, 4), m, unlock=m.device_node)
    assert list(c.match_prefix(np.arange(1, 4)).device_pages) == given
    c.validate()


def test_a_device_only_cache_evicts_by_default():
    c = st.HiCache(1, 8)
    for i in range(4):
        toks = np.arange(10 * i + 1, 10 * i + 5)
        m = c.match_prefix(toks, alloc=True)
        c.insert(toks, m, unlock=m.device_node)
    # 16 of 8 pages were needed: the cache evicted unbacked leaves on its own.
    assert c.evict_device(100) > 0
    with pytest.raises(st.ConfigError) as e:
        st.HiCache(1, 8, drop_unbacked=False)
    assert e.value.field == "drop_unbacked"


def test_both_evictable_figures():
    c = st.HiCache(1, 32)
    a = np.arange(1, 9)
    m = c.match_prefix(a, alloc=True)
    c.insert(a, m, unlock=m.device_node)
    b = np.concatenate([a[:4], np.arange(100, 104)])  # shares 4 pages with a: a is split
    m = c.match_prefix(b, alloc=True)
    r = c.insert(b, m, lock=True, unlock=m.device_node)
    s = c.stats()
    # Unlocked: a's own tail (4 pages). Locked: the shared head and b's tail.
    assert s["device_evictable_total"] == 4
    assert s["device_evictable_now"] == 4
    c.unlock(r.last_node)
    s = c.stats()
    assert s["device_evictable_total"] == 12, "every unlocked page, as SGLang counts"
    assert s["device_evictable_now"] == 8, "the leaves only: the shared head waits for them"
    c.validate()


@settings(max_examples=200, deadline=None)
@given(
    ps=hst.sampled_from([1, 2, 4]),
    seqs=hst.lists(hst.lists(hst.integers(0, 5), min_size=0, max_size=24), min_size=1, max_size=6),
    query=hst.lists(hst.integers(0, 5), max_size=24),
    big=hst.booleans(),
)
def test_int64_lookups_match_uint32_lookups(ps, seqs, query, big):
    """Lookups compared in int64 (no narrowing pass) find exactly what uint32 ones find,
    splits included, on two caches that saw the same inserts."""
    off = 2**32 - 8 if big else 0  # ids near the top of the range too
    a, b = st.HiCache(ps, 512), st.HiCache(ps, 512)
    for s in seqs:
        toks = np.array(s, dtype=np.int64) + off
        for c in (a, b):
            m = c.match_prefix(toks.astype(np.uint32), alloc=True)
            c.insert(toks.astype(np.uint32), m, unlock=m.device_node)
    q = np.array(query, dtype=np.int64) + off
    ma, mb = a.match_prefix(q.astype(np.uint32)), b.match_prefix(array("q", q.tolist()))
    assert (ma.device_len, list(ma.device_pages)) == (mb.device_len, list(mb.device_pages))
    a.validate()
    b.validate()


def test_a_match_whose_pages_went_back_is_checked_again():
    """`insert(tokens, match)` trusts a match's pages only while the cache has freed no device
    page since the match: pages freed (or evicted) in between are refused, nothing changes."""
    toks = np.arange(1, 9, dtype=np.uint32)
    c = st.HiCache(2, 16)
    m = c.match_prefix(toks, alloc=True)
    c.free_device(m.new_pages)
    with pytest.raises(st.ConfigError) as e:
        c.insert(toks, m)
    assert e.value.field == "device_pages"
    c.unlock(m.device_node)
    assert c.stats()["device_free"] == c.stats()["device_capacity"]
    c.validate()
    # A matched path evicted after its unlock: its pages are no longer the match's to give.
    m = c.match_prefix(toks, alloc=True)
    c.insert(toks, m, unlock=m.device_node)
    again = c.match_prefix(toks[:4])
    assert again.device_len == 4
    assert c.evict_device(16) == 4
    with pytest.raises(st.ConfigError):
        c.insert(toks[:4], again)
    c.validate()
    # Another cache's match is checked against this cache's pages.
    other = st.HiCache(2, 16)
    om = other.match_prefix(toks, alloc=True)
    c2 = st.HiCache(2, 16)
    with pytest.raises(st.ConfigError):
        c2.insert(toks, om)
    assert c2.stats()["device_free"] == c2.stats()["device_capacity"]


def test_evicted_pages_go_straight_to_the_allocation():
    """`alloc` that must evict hands the evicted pages on (they never pass the free list): the
    surplus of a whole evicted node is freed, the pages stay conserved, and an allocation that
    cannot be met even so leaves what it evicted evicted and allocates nothing."""
    c = st.HiCache(1, 8)
    a = np.arange(1, 7)
    m = c.match_prefix(a, alloc=True)
    c.insert(a, m, unlock=m.device_node)  # a: 6 pages, unlocked
    b = np.arange(100, 105)
    m = c.match_prefix(b, alloc=True)  # 2 free, 5 needed: a's leaf (6 pages) goes
    s = c.stats()
    assert c.match_prefix(a).device_len == 0
    assert len(set(m.new_pages)) == 5
    assert s["device_outstanding"] == 5 and s["device_free"] == 3
    r = c.insert(b, m, lock=True, unlock=m.device_node)
    assert list(c.match_prefix(b).device_pages) == list(m.new_pages)
    c.validate()
    # b is locked: 3 free pages cannot become 4, and nothing stays allocated.
    with pytest.raises(st.OutOfPagesError):
        c.match_prefix(np.arange(200, 204), alloc=True)
    s = c.stats()
    assert (s["device_free"], s["device_outstanding"], s["device_in_tree"]) == (3, 0, 5)
    c.unlock(r.last_node)
    # Now b (5 pages) is evicted for 4 new ones: one of its pages is spare and freed.
    m = c.match_prefix(np.arange(200, 204), alloc=True)
    s = c.stats()
    assert (s["device_free"], s["device_outstanding"], s["device_in_tree"]) == (4, 4, 0)
    c.free_device(m.new_pages)
    c.unlock(m.device_node)
    c.validate()
