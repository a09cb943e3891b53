"""`bench prefix-sparse --measure`: prefix hits run through the core, its counters against
what the selections name, and the selection model's drawn unions against its closed form."""

import json

import numpy as np
import pytest

from sparsetier.tools import bench_prefix_measure as bpm
from sparsetier.tools.cli import main
from sparsetier.tools.selection_model import RecordedSelections, SelectionModel

PS, LAYERS, PREFIX, SUFFIX = 16, 3, 512, 40
KV_ROW, IK_ROW = 656, 132
SHAPE = (KV_ROW, IK_ROW, 16 << 10)


def _recorded() -> RecordedSelections:
    """Per layer and token, a few pages of the 32-page prefix (and -1 padding): each layer's
    union over the suffix is known."""
    rng = np.random.default_rng(5)
    tokens = PREFIX + SUFFIX
    sel = rng.integers(0, PREFIX // PS, size=(LAYERS, tokens, 4)).astype(np.int32)
    sel[:, :, 3] = -1
    sel[1, PREFIX:] = [0, 1, -1, -1]  # layer 1 reads two pages only
    return RecordedSelections(sel, PS)


def test_the_core_loads_the_pages_the_selections_name_and_restores_in_full_when_told():
    rec = _recorded()
    rows = {r.mode: r for r in bpm.measure(rec, PREFIX, SUFFIX, LAYERS, SHAPE)}
    objects = PREFIX // PS * LAYERS
    obj_bytes, ik_bytes = PS * KV_ROW, PS * IK_ROW
    named = sum(rec.layer_union(li, PREFIX, SUFFIX).size for li in range(LAYERS))
    assert rec.layer_union(1, PREFIX, SUFFIX).tolist() == [0, 1]
    full, idx, auto = rows["full"], rows["indexer"], rows["auto"]
    # Every cached page off the device at the hit; a full restore loads each, in bulk.
    for r in rows.values():
        assert r.absent_objects == objects, r
        assert r.indexer_bytes == objects * ik_bytes, r
        assert r.full_restore_bytes == objects * (obj_bytes + ik_bytes), r
    assert full.choice == "full" and full.loaded_objects == objects
    assert full.kv_bytes == objects * obj_bytes and full.full_over_moved == 1.0
    assert (full.bulk_submissions, full.on_demand) == (LAYERS, 0)
    # Indexer-K only: exactly the pages the suffix's selections named, each once.
    assert idx.choice == "indexer" and idx.loaded_objects == idx.on_demand == named
    assert idx.kv_bytes == named * obj_bytes and idx.named_objects == named
    assert idx.full_over_moved > 1.0
    # Auto, taught by one hit of these lengths (untaught it restores Indexer-K only): this
    # suffix names most of the prefix, and a bulk restore costs less.
    assert auto.choice == "full" and auto.moved_bytes == full.moved_bytes


def test_drawn_unions_average_the_closed_form():
    m = SelectionModel()
    rng = np.random.default_rng(4)
    for prefix, suffix in ((8192, 16), (32768, 256)):
        sizes = [m.sample_union(prefix, suffix, rng).size for _ in range(400)]
        assert np.mean(sizes) == pytest.approx(m.prefix_union(prefix, suffix), rel=0.02)
        u = m.sample_union(prefix, suffix, rng)
        assert np.all(np.diff(u) > 0) and u[0] == 0 and u[-1] == prefix // 64 - 1


def test_bench_prefix_sparse_measure_reports_through_the_cli(tmp_path, capsys):
    out = tmp_path / "m.json"
    main(["bench", "prefix-sparse", "--prefixes", "4096", "65536", "--suffixes", "16",
          "--layers", "2", "--measure", "--measure-max-prefix", "4096",
          "--json", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert "measured through the core" in text
    got = json.loads(out.read_text())["measured"]
    # The cells up to the limit only, under each mode.
    assert [(r["prefix"], r["mode"]) for r in got] == [(4096, m) for m in bpm.MODES]
    idx = next(r for r in got if r["mode"] == "indexer")
    assert idx["loaded_objects"] > 0 and idx["full_over_moved"] > 1.0


@pytest.mark.parametrize(
    ("args", "field"),
    [(["--measure-max-prefix", "0"], "measure_max_prefix = 0"),
     (["--prefixes", "8224", "--measure-max-prefix", "9000"], "prefixes = 8224")],
)  # fmt: skip
def test_bad_measure_arguments_are_refused_naming_the_field(capsys, args, field):
    assert main(["bench", "prefix-sparse", "--measure", *args]) == 2
    assert f"invalid {field}" in capsys.readouterr().err


def test_a_prefix_of_part_of_a_page_is_refused():
    with pytest.raises(ValueError, match="prefix = 520"):
        bpm.measure(_recorded(), 520, 8, LAYERS, SHAPE)
