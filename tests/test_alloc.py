"""The page allocator through the binding: all-or-nothing, typed errors, and a stateful test
against a reference model."""

import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sparsetier import AllocatorError, ConfigError, OutOfPagesError, OutOfRangeError
from sparsetier.lowlevel import PageAllocator


def test_alloc_is_all_or_nothing():
    a = PageAllocator(10, reserve_pages=2)
    assert a.capacity == 8
    got = a.alloc(5)
    assert got.dtype == np.int64
    assert sorted(got.tolist()) == [2, 3, 4, 5, 6]
    with pytest.raises(OutOfPagesError) as e:
        a.alloc(4)
    assert (e.value.requested, e.value.free, e.value.capacity) == (4, 3, 8)
    assert a.free_count == 3
    a.validate()


def test_double_free_and_foreign_pages_are_refused_without_change():
    a = PageAllocator(10, reserve_pages=1)
    got = a.alloc(4)
    with pytest.raises(AllocatorError) as e:
        a.free([got[0], got[0]])
    assert e.value.value == got[0]
    with pytest.raises(AllocatorError):
        a.free([0])  # reserved
    with pytest.raises(AllocatorError):
        a.free([10])  # beyond the buffer
    with pytest.raises(OutOfRangeError):
        a.free([-1])
    assert a.used_count == 4
    a.free(torch.from_numpy(got))  # torch tensors and lists work too
    assert a.used_count == 0
    with pytest.raises(AllocatorError):
        a.free(got[:1])
    a.validate()


@pytest.mark.parametrize(("pages", "reserve"), [(0, 0), (-1, 0), (4, 4), (4, -1), (2**40, 0)])
def test_bad_construction(pages, reserve):
    with pytest.raises(ConfigError):
        PageAllocator(pages, reserve)


def test_bad_alloc_count():
    with pytest.raises(ConfigError) as e:
        PageAllocator(4).alloc(-1)
    assert e.value.field == "n"
    with pytest.raises(ConfigError):
        PageAllocator(4).free(np.zeros((2, 2), dtype=np.int64))


TOTAL, RESERVE = 32, 1


class AllocatorMachine(RuleBasedStateMachine):
    """Reference: a set of free pages and a set of allocated ones."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(TOTAL, RESERVE)
        self.free_set = set(range(RESERVE, TOTAL))
        self.held: set[int] = set()

    @rule(n=st.integers(0, TOTAL + 2))
    def allocate(self, n):
        if n > len(self.free_set):
            with pytest.raises(OutOfPagesError):
                self.alloc.alloc(n)
            return
        got = self.alloc.alloc(n).tolist()
        assert len(set(got)) == n
        assert set(got) <= self.free_set
        self.free_set -= set(got)
        self.held |= set(got)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_some(self, data):
        pages = data.draw(st.lists(st.sampled_from(sorted(self.held)), unique=True, min_size=1))
        self.alloc.free(np.array(pages, dtype=np.int64))
        self.held -= set(pages)
        self.free_set |= set(pages)

    @rule(page=st.integers(0, TOTAL + 4))
    def free_bad(self, page):
        if page in self.held:
            return
        with pytest.raises(AllocatorError):
            self.alloc.free([page])

    @invariant()
    def conservation(self):
        self.alloc.validate()
        assert self.alloc.free_count + self.alloc.used_count == self.alloc.capacity
        assert self.alloc.used_count == len(self.held)
        assert all(self.alloc.is_allocated(p) for p in self.held)
        assert not any(self.alloc.is_allocated(p) for p in self.free_set)


TestAllocatorMachine = AllocatorMachine.TestCase
