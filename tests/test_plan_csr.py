"""Ragged rows planned as CSR (`StepScheduler.plan_csr`: row offsets + entries, no padding)
against the same rows padded (`plan`): the same pages read, the same counts, the table in the
rows' form, retries and failed rows reported in it too; bad CSR input as typed errors."""

import numpy as np
import pytest
from scheduler_support import end_steps_alike, small_scheduler

import sparsetier as st
from sparsetier import testing

PS = 4


def _scheduler():
    s = small_scheduler(PS, 40, 96, 2, {0: 30, 1: 21, 2: 41})
    testing.evict_device(s, 1000)  # everything on host: the plans load
    return s


def _rows(rng, lens, unit):
    """Ragged rows: 0 to 5 entries (block mode, blocks of `unit`) or 0 to 9 tokens, sorted."""
    rows = []
    for b, n in enumerate(lens):
        entries = -(-n // unit)
        want = int(rng.integers(0, 6 if unit > 1 else 10))
        if b == 0:
            want = max(want, 1)  # a plan names at least one page
        rows.append(sorted(rng.choice(entries, size=min(want, entries), replace=False).tolist()))
    return rows


def _padded(rows):
    k = max(1, max(len(r) for r in rows))
    return np.array([r + [-1] * (k - len(r)) for r in rows], dtype=np.int64)


def _csr(rows):
    offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    entries = np.array([e for r in rows for e in r], dtype=np.int64)
    return offsets, entries


def _same_cells(rows, padded_table, csr_table, ppe):
    """The CSR table holds, entry by entry, what the padded table holds for that entry."""
    assert csr_table.ndim == 1
    assert len(csr_table) == sum(len(r) for r in rows) * ppe
    n = 0
    for b, r in enumerate(rows):
        for j in range(len(r)):
            assert list(csr_table[n * ppe : (n + 1) * ppe]) == list(
                padded_table[b, j * ppe : (j + 1) * ppe]
            )
            n += 1


def plan_alike(unit, keep, seed, plan_both) -> None:
    """Two schedulers fed the same ragged rows, six steps of two layers each:
    `plan_both(a, b, layer, rows)` plans the layer on each and returns their tables; both are
    made ready and finished, and every step's counts must agree."""
    rng = np.random.default_rng(seed)
    a, b = _scheduler(), _scheduler()
    a.keep_selections = b.keep_selections = keep
    for step in range(6):
        a.append([0, 1, 2])
        b.append([0, 1, 2])
        lens = [a.request_len(r) for r in (0, 1, 2)]
        for layer in range(2):
            (pa, _), (pb, _) = plan_both(a, b, layer, _rows(rng, lens, unit))
            fa, _ = a.ready(pa)
            fb, _ = b.ready(pb)
            assert not fa and not fb
            a.finish(pa)
            b.finish(pb)
        end_steps_alike(a, b, ("selected", "pages", "bytes_needed", "loaded", "ready"), step)
    a.validate()
    b.validate()


@pytest.mark.parametrize(("unit", "keep"), [(PS, True), (PS, False), (1, True), (2 * PS, True)])
def test_csr_rows_plan_as_their_padded_rows(unit, keep):
    ppe = max(1, unit // PS)

    def plan_both(a, b, layer, rows):
        pa, ta = a.plan(layer, [0, 1, 2], _padded(rows), unit)
        offsets, entries = _csr(rows)
        pb, tb = b.plan_csr(layer, [0, 1, 2], offsets, entries, unit)
        assert tb.dtype == np.int32
        # The same pages are resident for every entry (the slots may differ: evictions
        # follow when write-throughs landed).
        _same_cells(rows, ta >= 0, tb >= 0, ppe)
        return (pa, ta), (pb, tb)

    plan_alike(unit, keep, 5, plan_both)


def test_a_retry_and_a_failed_row_come_back_in_the_rows_form():
    a, b = _scheduler(), _scheduler()
    rows = [[0, 3], [], [1, 2, 9]]  # row 1 selects nothing at this layer
    offsets, entries = _csr(rows)
    for s in (a, b):
        s.append([0, 1, 2])
    # A load failing once is retried: the moved cells are patched into a new table.
    testing.inject_faults(a, "load", 1, 0)
    testing.inject_faults(b, "load", 1, 0)
    pa, ta = a.plan(0, [0, 1, 2], _padded(rows), PS)
    pb, tb = b.plan_csr(0, [0, 1, 2], offsets, entries, PS)
    assert ta.shape == (3, 3) and tb.shape == (5,)
    (fa, na), (fb, nb) = a.ready(pa), b.ready(pb)
    assert not fa and not fb
    assert na is not None and nb is not None and nb.ndim == 1
    _same_cells(rows, na >= 0, nb >= 0, 1)
    assert (nb >= 0).all()
    a.finish(pa)
    b.finish(pb)
    # Loads failing twice fail their rows: those rows' cells are -1, the others' are not.
    testing.inject_faults(a, "load", 2, 1)
    testing.inject_faults(b, "load", 2, 1)
    pa, _ = a.plan(1, [0, 1, 2], _padded(rows), PS)
    pb, _ = b.plan_csr(1, [0, 1, 2], offsets, entries, PS)
    (fa, na), (fb, nb) = a.ready(pa), b.ready(pb)
    assert [f[:2] for f in fa] == [f[:2] for f in fb] and fb
    failed = {f[0] for f in fb}
    n = 0
    for r, row in enumerate(rows):
        for _ in row:
            assert (nb[n] == -1) == (r in failed), (r, nb)
            n += 1
    _same_cells(rows, na >= 0, nb >= 0, 1)
    a.finish(pa)
    b.finish(pb)
    for s in (a, b):
        s.end_step()
        s.drain()
        s.validate()


def test_bad_csr_input_is_a_typed_error_naming_the_field():
    s = _scheduler()
    s.append([0, 1, 2])
    entries = np.array([0, 1, 2], dtype=np.int64)
    cases = [
        (np.array([0, 3], dtype=np.int64), entries, None, st.ConfigError, "offsets"),
        (np.array([1, 1, 2, 3], dtype=np.int64), entries, None, st.ConfigError, "offsets[0]"),
        (np.array([0, 2, 1, 3], dtype=np.int64), entries, None, st.ConfigError, "offsets[2]"),
        (np.array([0, 1, 2, 2], dtype=np.int64), entries, None, st.ConfigError, "offsets[3]"),
        ([[0, 1], [2, 3]], entries, None, st.ConfigError, "offsets"),
        (np.array([0, 1, 2, 3]), [[0, 1, 2]], None, st.ConfigError, "entries"),
        (np.array([0, 1, 2, 3]), np.array([0, 1, 99]), None, st.OutOfRangeError, "entries[2]"),
        (np.zeros(4, dtype=np.int64), np.zeros(0, dtype=np.int64), None, st.ConfigError,
         "entries"),  # every row empty: nothing to read
    ]  # fmt: skip
    for offsets, ent, counts, exc, field in cases:
        with pytest.raises(exc) as e:
            s.plan_csr(0, [0, 1, 2], offsets, ent, 1 if field.startswith("ent") else PS, counts)
        assert e.value.field == field, (offsets, e.value)
    ok = np.array([0, 1, 2, 3], dtype=np.int64)
    counted = [
        (np.array([1, 1], dtype=np.int32), st.ConfigError, "counts"),
        (np.array([1, -1, 1], dtype=np.int32), st.OutOfRangeError, "counts[1]"),
        (np.array([1, 1, 1], dtype=np.int64), st.ConfigError, "counts"),
        (np.array([1, 9, 1], dtype=np.int32), st.OutOfRangeError, "counts[1]"),
    ]
    for counts, exc, field in counted:
        with pytest.raises(exc) as e:
            s.plan_csr(0, [0, 1, 2], ok, entries, PS, counts)
        assert e.value.field == field, (counts, e.value)
    s.validate()
    plan, table = s.plan_csr(0, [0, 1, 2], ok, entries, PS, np.array([4, 2, 1], dtype=np.int32))
    assert table.shape == (3,)
    s.ready(plan)
    s.finish(plan)
    s.validate()
