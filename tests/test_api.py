"""The public surface: what `sparsetier` exports is what `docs/api.md` lists, the library
never imports its tools, and the names that moved keep working one release with a warning."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import sparsetier
from sparsetier import lowlevel

DOCS = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def _documented(section: str) -> set[str]:
    """The names listed in `docs/api.md` under the heading `section` (each `` `name` `` in the
    first cell of a table row)."""
    text = DOCS.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start : end if end > 0 else len(text)]
    cells = re.findall(r"^\| ([^|]*) \|", body, re.M)
    return {n for cell in cells for n in re.findall(r"`([A-Za-z_]\w*)`", cell)} - {"Name"}


def test_the_top_level_exports_what_the_api_document_lists():
    assert set(sparsetier.__all__) == _documented("sparsetier")
    for name in sparsetier.__all__:
        assert hasattr(sparsetier, name), name


def test_the_low_level_module_exports_what_the_api_document_lists():
    assert set(lowlevel.__all__) == _documented("sparsetier.lowlevel")
    assert not set(lowlevel.__all__) & set(sparsetier.__all__)


def test_the_test_hooks_are_what_the_api_document_lists():
    from sparsetier import testing

    assert set(testing.__all__) == _documented("sparsetier.testing")
    for name in testing.__all__:
        assert callable(getattr(testing, name)), name


def test_a_scheduler_shows_its_directory_read_only():
    from scheduler_support import small_scheduler

    s = small_scheduler(4, 16, 32, 2, {1: 8})
    view = s.residency
    assert view.stats()["objects"] == 4
    assert view.state((1, 0, 0, 0))["device"] == "Ready"
    view.validate()
    for call in ("evict", "allocate", "release", "resolve", "backup", "drop_namespace"):
        assert not hasattr(view, call), call
    with pytest.warns(DeprecationWarning, match="StepScheduler.residency"):
        s.directory.stats()


def test_the_library_never_imports_its_tools():
    code = (
        "import sys, sparsetier, sparsetier.lowlevel, sparsetier.l3, sparsetier.vllm; "
        "print([m for m in sys.modules if m.startswith('sparsetier.tools')])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("name", sorted(lowlevel.__all__))
def test_a_moved_name_still_works_one_release_with_a_warning(name):
    with pytest.warns(DeprecationWarning, match=f"sparsetier.lowlevel.{name}"):
        got = getattr(sparsetier, name)
    assert got is getattr(lowlevel, name)


@pytest.mark.parametrize(
    ("old", "name"), [("runtime", "DecodeRuntime"), ("model", "TinySparseModel")]
)
def test_moved_modules_still_import_one_release_with_a_warning(old, name):
    import importlib

    sys.modules.pop(f"sparsetier.{old}", None)
    with pytest.warns(DeprecationWarning, match=rf"sparsetier\.{old} moved"):
        mod = importlib.import_module(f"sparsetier.{old}")
    new = importlib.import_module(f"sparsetier.tools.{old}")
    assert getattr(mod, name) is getattr(new, name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        sparsetier.nothing  # noqa: B018


def test_the_step_calls_return_typed_results_that_still_read_as_mappings():
    import numpy as np
    from scheduler_support import small_joined, small_scheduler

    s = small_scheduler(4, 16, 32, 2, {1: 8, 2: 8})
    plan, _ = s.plan(0, [1, 2], np.array([[0, 1], [1, -1]]), 4)
    assert isinstance(plan, sparsetier.LayerPlan) and plan.layer == 0
    s.ready(plan)
    counts = s.finish(plan)
    assert isinstance(counts, sparsetier.LayerCounts)
    assert counts.ready == counts["ready"] == 3 and counts == counts.to_dict()
    rec = s.end_step()
    assert isinstance(rec, sparsetier.StepRecord)
    assert set(rec.keys()) == set(rec.to_dict()) and len(rec) == len(rec.keys())
    for key in rec:  # every field an attribute, the same value as by key
        assert getattr(rec, key) == rec[key], key
    assert rec.pages == 3 and rec.read_amplification is None  # nothing moved
    assert dict(rec) == rec.to_dict() and "pages" in rec and rec.get("nothing", 7) == 7
    with pytest.raises(KeyError):
        rec["nothing"]
    assert isinstance(s.totals(), sparsetier.StepRecord)
    j = small_joined()
    adm = j.admit(5, np.arange(1, 9))
    assert isinstance(adm, sparsetier.Admission) and adm.matched_pages == 0
    assert adm == {
        "matched_pages": 0,
        "device_pages": 0,
        "restored_pages": 0,
        "full_restore_objects": 0,
    }


def test_a_plan_id_as_an_int_works_one_release_with_a_warning():
    import numpy as np
    from scheduler_support import small_scheduler

    s = small_scheduler(4, 16, 32, 2, {1: 8})
    plan, _ = s.plan(0, [1], np.array([[0, 1]]), 4)
    with pytest.warns(DeprecationWarning, match="LayerPlan"):
        s.ready(plan.id)
    s.finish(plan)
    other = small_scheduler(4, 16, 32, 2, {1: 8})
    p2, _ = other.plan(0, [1], np.array([[0]]), 4)
    with pytest.raises(sparsetier.ConfigError):
        s.finish(p2)  # another scheduler's plan: refused, nothing changes
    other.finish(p2)


def test_the_l3_protocol_is_low_level_and_its_old_names_warn(tmp_path):
    from l3_support import stack

    s = stack("file", tmp_path)
    l3 = lowlevel.L3Protocol(s.hicache)
    assert l3.take_writes() == []
    with pytest.warns(DeprecationWarning, match="L3Protocol"):
        assert s.hicache.take_storage_writes() == []
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        s.hicache.nothing  # noqa: B018
    s.storage.close()


def test_joined_scheduling_is_its_own_type():
    from scheduler_support import small_joined, small_scheduler

    j = small_joined()
    assert isinstance(j, sparsetier.JoinedStepScheduler) and j.is_joined
    assert isinstance(j, sparsetier.StepScheduler)
    plain = small_scheduler(4, 16, 32, 2, {1: 8})
    assert not isinstance(plain, sparsetier.JoinedStepScheduler) and not plain.is_joined
    for call in ("admit", "wait_prefix", "indexer_pages", "flush_finished", "evict_prefix"):
        assert hasattr(j, call) and not hasattr(plain, call), call
    assert plain.prefix_stats() is None and j.prefix_stats() is not None
