"""Selections handed over as int32 (half the bytes of torch.topk's int64, and what top-k
kernels of sparse-attention engines often return): `plan` and `plan_csr` read them as they
are, and plan them exactly as the same rows in int64; other dtypes are typed errors."""

import numpy as np
import pytest
from test_plan_csr import PS, _csr, _padded, _scheduler, plan_alike

import sparsetier as st


@pytest.mark.parametrize(
    ("unit", "keep", "csr"),
    [(PS, True, False), (PS, True, True), (1, True, False), (1, True, True), (1, False, True),
     (2 * PS, True, False)],
)  # fmt: skip
def test_int32_rows_plan_as_their_int64_rows(unit, keep, csr):
    ppe = max(1, unit // PS)  # table cells an entry

    def plan_both(a, b, layer, rows):
        if csr:
            offsets, entries = _csr(rows)
            pa, ta = a.plan_csr(layer, [0, 1, 2], offsets, entries, unit)
            pb, tb = b.plan_csr(layer, [0, 1, 2], offsets, entries.astype(np.int32), unit)
            assert len(tb) == len(entries) * ppe
        else:
            sel = _padded(rows)
            pa, ta = a.plan(layer, [0, 1, 2], sel, unit)
            pb, tb = b.plan(layer, [0, 1, 2], sel.astype(np.int32), unit)
        # The same pages are resident for every entry (the slots may differ: evictions follow
        # when write-throughs landed).
        assert ta.shape == tb.shape and tb.dtype == np.int32
        assert ((ta >= 0) == (tb >= 0)).all()
        return (pa, ta), (pb, tb)

    plan_alike(unit, keep, 7, plan_both)


def test_other_dtypes_are_typed_errors_naming_the_field():
    s = _scheduler()
    s.append([0, 1, 2])
    rows = np.array([[0, 1], [1, 2], [2, 3]], dtype=np.int64)
    for bad in (rows.astype(np.float64), rows.astype(np.int16), rows.astype(np.uint32)):
        with pytest.raises(st.ConfigError) as e:
            s.plan(0, [0, 1, 2], bad, PS)
        assert e.value.field == "selection"
        assert "int32" in str(e.value) and "int64" in str(e.value)
    # A strided selection (int32, not C-contiguous) is read by value, as its copy would be.
    wide = np.zeros((3, 4), dtype=np.int32)
    strided = s.plan(0, [0, 1, 2], wide[:, ::2], PS)
    s.finish(strided[0])
    copied = s.plan(0, [0, 1, 2], np.ascontiguousarray(wide[:, ::2]), PS)
    assert strided[1].tolist() == copied[1].tolist()
    s.finish(copied[0])
    # Strided CSR arrays, in either dtype, and strided offsets are read by value too.
    offsets = np.array([0, 1, 2, 3], dtype=np.int64)
    for dtype in (np.int64, np.int32):
        strided = np.array([0, 9, 1, 9, 2, 9], dtype=dtype)[::2]
        plan, table = s.plan_csr(0, [0, 1, 2], offsets, strided, PS)
        s.finish(plan)
        plan, want = s.plan_csr(0, [0, 1, 2], offsets, strided.copy(), PS)
        s.finish(plan)
        assert table.tolist() == want.tolist()
    strided_offsets = np.array([0, 9, 1, 9, 2, 9, 3, 9], dtype=np.int64)[::2]
    plan, table = s.plan_csr(0, [0, 1, 2], strided_offsets, np.array([0, 1, 2], np.int32), PS)
    s.finish(plan)
    plan, want = s.plan_csr(0, [0, 1, 2], offsets, np.array([0, 1, 2], np.int32), PS)
    s.finish(plan)
    assert table.tolist() == want.tolist()
    # An int32 entry past the request is named where the caller holds it.
    offsets = np.array([0, 1, 2, 3], dtype=np.int64)
    with pytest.raises(st.OutOfRangeError) as e:
        s.plan_csr(0, [0, 1, 2], offsets, np.array([0, 1, 999], dtype=np.int32), PS)
    assert e.value.field == "entries[2]"
    with pytest.raises(st.OutOfRangeError) as e:
        s.plan(0, [0, 1, 2], np.array([[0], [999], [1]], dtype=np.int32), PS)
    assert e.value.field == "selection[1][0]"
    s.validate()
    plan, table = s.plan(0, [0, 1, 2], rows.astype(np.int32), PS)
    assert table.shape == (3, 2)
    s.ready(plan)
    s.finish(plan)
    s.validate()
