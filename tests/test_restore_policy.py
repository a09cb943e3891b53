"""The core's restore policy (`restore=` of the joined scheduler and `DecodeRuntime`): what a
prefix hit restores of its matched pages' main KV, decided per admission; the decisions and
their outcomes in `prefix_stats()`, and outputs unchanged whatever it restores."""

import pytest
import torch

import sparsetier as sp
from sparsetier.tools import demo
from sparsetier.tools.model import ModelConfig, TinySparseModel
from sparsetier.tools.runtime import DecodeRuntime

MODEL = TinySparseModel(ModelConfig(layers=3, seed=9))
_g = torch.Generator().manual_seed(21)
SYSTEM = torch.randint(0, 512, (96,), generator=_g)
PROMPTS = [torch.cat([SYSTEM, torch.randint(0, 512, (n,), generator=_g)]) for n in (40, 40, 40)]
# Unrelated prompts, one per filler (no prefix in common with any other).
FILLERS = [torch.randint(0, 512, (200,), generator=_g) for _ in range(8)]


def _runtime(restore: str, device_slots: int = 100) -> DecodeRuntime:
    return DecodeRuntime(
        MODEL, page_size=8, device_slots=device_slots, host_pages=200, indexer_pages=80,
        topk=4, prefetch=False, restore=restore,
    )  # fmt: skip


def _serve(rt: DecodeRuntime, rid: int, prompt: torch.Tensor, steps: int = 3):
    """Admits `prompt` after an unrelated request went through (on a small device it pushes
    the cached pages' KV off it) and every cached page's Indexer-K left the device (so a hit
    restores from host); decodes it to the end and finishes it (its pages inserted)."""
    filler = 1000 + rid
    rt.add_request(filler, FILLERS[rid], 2)
    while not rt.requests[filler].done:
        rt.step()
    rt.finish_request(filler)
    rt.drain()
    rt.scheduler.evict_prefix(10**6, 0)
    adm = rt.add_request(rid, prompt, steps)
    while not rt.requests[rid].done:
        rt.step()
    rt.drain()
    return adm, rt.finish_request(rid)


def test_a_full_restore_loads_the_prefix_once_and_changes_no_output():
    full, ref = _runtime("full"), _runtime("indexer", device_slots=5000)
    outs = {}
    for name, rt in (("full", full), ("ref", ref)):
        _serve(rt, 0, PROMPTS[0])
        adm, r = _serve(rt, 1, PROMPTS[1])
        outs[name] = (adm, r.outputs)
        if name == "full":
            full_req = r
        rt.drain()
        rt.scheduler.validate()
    adm, _ = outs["full"]
    assert adm["restored_pages"] > 0
    # Every layer of every page restored from host that was off the device, loaded once at
    # admission (some of the first request's KV was still on the device).
    assert 0 < adm["full_restore_objects"] <= adm["restored_pages"] * 3
    px = full.scheduler.prefix_stats()
    assert (px["restores_full"], px["restores_indexer_only"]) == (1, 0), px
    # (Objects still on the device at admission may leave it and load later, on this device.)
    object_bytes = full.kv_spec.page_bytes * full.kv_spec.planes_per_layer
    assert px["prefix_kv_bytes_first"] >= adm["full_restore_objects"] * object_bytes
    # The decision predicted the objects off the device; its own loads, making room on this
    # small device, can push more of the prefix off before their layer loads: the error.
    pred, loaded = px["restore_objects_predicted"], px["restore_objects_loaded"]
    assert 0 < pred <= loaded == adm["full_restore_objects"], px
    assert px["restore_model_abs_error"] == loaded - pred
    assert outs["ref"][0]["full_restore_objects"] == 0
    # Per request: the decision, its predictions and what it loaded over its life, each object
    # once (the full restore's, and those still on the device at admission and loaded later).
    st = full_req.restore
    assert st["choice"] == "full" and st["absent"] == pred, st
    assert st["loaded"] * object_bytes == px["prefix_kv_bytes_first"], st
    assert st["predicted_full"] == pred and st["coverage"] is None
    assert all(torch.equal(a, b) for a, b in zip(outs["full"][1], outs["ref"][1], strict=True))
    s = full.scheduler.stats()
    assert (s["pins"], s["handles"]) == (0, 0), s


def test_auto_restores_indexer_k_only_until_it_learns_that_a_suffix_reads_the_whole_prefix():
    rt = _runtime("auto")
    _serve(rt, 0, PROMPTS[0])
    adm1, r1 = _serve(rt, 1, PROMPTS[1])  # no sample yet: Indexer-K only
    assert adm1["restored_pages"] > 0 and adm1["full_restore_objects"] == 0
    assert r1.restore["choice"] == "indexer" and r1.restore["coverage"] is None, r1.restore
    assert 0 < r1.restore["loaded"] <= r1.restore["absent"] * 2, r1.restore
    px = rt.scheduler.prefix_stats()
    assert (px["restores_indexer_only"], px["restores_full"]) == (1, 0), px
    # The tiny model's prefill selects nearly every block: the next such hit restores whole.
    adm2, r2 = _serve(rt, 2, PROMPTS[2])
    px = rt.scheduler.prefix_stats()
    assert px["restores_full"] == 1 and adm2["full_restore_objects"] > 0, (px, adm2)
    # Decided from the first request's coverage: per page, what it loaded of what was off
    # the device (a page loaded more than that counts as whole), so at most the totals' ratio.
    want = r1.restore["loaded"] / r1.restore["absent"]
    assert r2.restore["choice"] == "full" and 0.5 < r2.restore["coverage"] <= want + 1e-12
    # What the Indexer-K-only request loaded was its sample; the full one's prediction held.
    assert px["restore_objects_loaded"] > 0 and px["restore_objects_if_full"] > 0
    assert px["restore_objects_if_indexer"] > 0  # the second's prediction had a sample
    rt.scheduler.validate()


def test_a_predicted_restore_loads_its_pages_in_bulk_and_the_rest_on_demand_exactly():
    pred, ref = _runtime("predicted"), _runtime("indexer", device_slots=5000)
    outs, last = {}, {}
    for name, rt in (("pred", pred), ("ref", ref)):
        _serve(rt, 0, PROMPTS[0])
        _, r1 = _serve(rt, 1, PROMPTS[1])  # nothing learned yet: Indexer-K only
        before = rt.prefix_stats()["prefix_kv_bytes_first"]
        adm2, r2 = _serve(rt, 2, PROMPTS[2])
        outs[name], last[name] = (r1.outputs, r2.outputs), r2.restore
        if name == "pred":
            restored = adm2["restored_pages"] * 3  # the restored pages' objects, 3 layers
            first = rt.prefix_stats()["prefix_kv_bytes_first"] - before
        rt.drain()
        rt.scheduler.validate()
    px = pred.scheduler.prefix_stats()
    assert (px["restores_indexer_only"], px["restores_predicted"]) == (1, 1), px
    # The second hit: the pages predicted by position from the first's loads, in bulk (one
    # submission a layer at most), the rest as selections named them; each object once. (A
    # layer's bulk load, making room on this small device, can push a later layer's objects
    # of the same pages off it first: then it loads more than were off at admission.)
    st = last["pred"]
    assert st["choice"] == "predicted" and 0 < st["bulk_objects"] <= restored, st
    assert 0 < st["bulk_loaded"] <= restored and 0 < st["bulk_submissions"] <= 3, st
    # What it loaded, each object once, is what the prefix tier counted as its first loads.
    object_bytes = pred.kv_spec.page_bytes * pred.kv_spec.planes_per_layer
    assert st["loaded"] * object_bytes == first, (st, first)
    assert last["ref"]["choice"] == "indexer" and last["ref"]["bulk_submissions"] == 0
    for a, b in zip(outs["pred"], outs["ref"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    s = pred.scheduler.stats()
    assert (s["pins"], s["handles"]) == (0, 0), s


def test_a_full_restore_the_device_cannot_hold_is_cut_short_and_stays_exact():
    small, ref = _runtime("full", device_slots=75), _runtime("indexer", device_slots=5000)
    for rt in (small, ref):
        _serve(rt, 0, PROMPTS[0])
        # Other requests hold most of the device while the hit is admitted.
        for rid, p in ((5, PROMPTS[2]), (6, PROMPTS[2])):
            rt.add_request(rid, torch.cat([torch.tensor([7]), p]), 4)
        rt.scheduler.evict_prefix(10**6, 0)
        rt.drain()  # what is evictable then does not depend on copy timing
        rt.add_request(1, PROMPTS[1], 3)
        while any(not r.done for r in rt.requests.values()):
            rt.step()
    px = small.scheduler.prefix_stats()
    assert (px["restores_full"], px["restores_partial"]) == (1, 1), px
    for rid in (1, 5, 6):
        a, b = small.finish_request(rid), ref.finish_request(rid)
        assert all(torch.equal(x, y) for x, y in zip(a.outputs, b.outputs, strict=True)), rid
    small.drain()
    small.scheduler.validate()


def test_a_bad_restore_choice_is_refused_naming_it():
    with pytest.raises(sp.ConfigError) as e:
        _runtime("half")
    assert e.value.field == "restore" and "auto, indexer, full or predicted" in str(e.value)


@pytest.mark.parametrize("restore", ["auto", "full", "indexer", "predicted"])
def test_the_demo_is_exact_under_every_restore_choice(restore):
    r = demo.run_demo(demo.DemoConfig(restore=restore), progress=False)
    t = r["totals"]
    assert t["correct"], demo.format_summary(r)
    assert (t["end_pins"], t["end_device_leaked"]) == (0, 0), t
    decided = t["restores_full"] + t["restores_indexer_only"] + t["restores_predicted"]
    assert decided > 0
    if restore == "full":
        assert t["restores_indexer_only"] == t["restores_predicted"] == 0
    if restore == "indexer":
        assert t["restores_full"] == t["restores_predicted"] == 0
    if restore == "predicted":
        assert t["restores_full"] == 0 and t["restores_predicted"] > 0
    # Each finished request's restore, by choice: what it loaded and how.
    by = t["restore_by_choice"]
    assert sum(c["requests"] for c in by.values()) > 0
    for c in by.values():
        assert c["loaded"] >= c["on_demand"] and c["wait_s"] >= 0
    assert "restore policy" in demo.format_summary(r)


@pytest.mark.parametrize("faults", [False, True], ids=["", "faults"])
@pytest.mark.parametrize("selection", ["block", "token"])
def test_the_default_demo_moves_no_more_prefix_bytes_than_a_full_restore(selection, faults):
    # The demo runs itself again restoring every hit whole (the same conversations, budget
    # and faults): that run's prefix bytes, re-loads included, against this one's.
    r = demo.run_demo(demo.DemoConfig(selection=selection, faults=faults), progress=False)
    t = r["totals"]
    assert t["correct"], demo.format_summary(r)
    moved = t["prefix_indexer_bytes_restored"] + t["prefix_kv_bytes_loaded"]
    assert t["prefix_full_run_bytes"] >= moved, t
    assert t["prefix_restore_ratio"] >= 1.0
    if not faults:
        # A full restore that stayed resident would move less than either: the re-loads are
        # the device budget's, under any restore.
        assert t["prefix_restore_ratio_resident"] < t["prefix_restore_ratio"]
    assert "in the same run" in demo.format_summary(r)


def test_a_copy_s_fixed_cost_in_the_model_is_its_engine_s_unless_given():
    from sparsetier import _core

    def binding(spec):
        return _core.PageTransferBinding(torch.zeros(spec.shape(), dtype=torch.bfloat16), spec)

    kv = _core.PoolSpec("KV", 1, 1, 8, "bf16", 8, 16)
    kv_host = _core.PoolSpec("KV", 2, 1, 8, "bf16", 8, 16)
    ik = _core.PoolSpec("INDEXER", 2, 1, 8, "bf16", 8, 16)

    def joined(**kw):
        engine = _core.TransferEngine("cpu", threads=1)
        return _core.StepScheduler.joined(
            binding(kv), binding(kv_host), engine, indexer_device=binding(ik),
            indexer_host=binding(ik), **kw,
        )  # fmt: skip

    # The cpu engine's: a scattered copy costs it about a 16 KiB page's time.
    assert joined().prefix_stats()["restore_copy_overhead"] == 16384
    assert joined(restore_copy_overhead=0).prefix_stats()["restore_copy_overhead"] == 0
    with pytest.raises(sp.OutOfRangeError) as e:
        joined(restore_copy_overhead=-1)
    assert e.value.field == "restore_copy_overhead"
