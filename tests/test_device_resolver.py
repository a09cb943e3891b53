"""The device resolver (`DecodeRuntime(resolve="device")`): a decode step calls into the core a
fixed number of times however many layers the model has, the demo stays exact through it in
block and token modes, with faults, and the resolver refuses misuse with typed errors before
anything changes. The runtime's hypothesis machines (`test_runtime_stateful.py`) drive the
same path against a host-planned resident twin."""

import numpy as np
import pytest
import torch

import sparsetier as sp
from sparsetier import testing
from sparsetier.tools import demo, runtime
from sparsetier.tools.model import ModelConfig, TinySparseModel
from sparsetier.tools.runtime import DecodeRuntime


class Counting:
    """Forwards to a scheduler, counting the calls made through it."""

    def __init__(self, inner):
        self._inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*a, **k):
            self.calls.append(name)
            return attr(*a, **k)

        return call


def run_device_demo(monkeypatch, cfg: demo.DemoConfig, hook) -> tuple[dict, list]:
    """Runs the demo with `hook(rt)` called on each of its runtimes with a device resolver
    (as soon as it is built); checks that it ends exact, with nothing pinned, held, leaked,
    quarantined or in flight, with prefix hits and loads. Returns the run and those
    runtimes."""
    init = runtime.DecodeRuntime.__init__
    devices = []

    def hooked(self, *a, **k):
        init(self, *a, **k)
        if self.resolver is not None:
            hook(self)
            devices.append(self)

    monkeypatch.setattr(runtime.DecodeRuntime, "__init__", hooked)
    r = demo.run_demo(cfg, progress=False)
    t = r["totals"]
    assert t["correct"], demo.format_summary(r)
    assert (t["end_pins"], t["end_handles"], t["end_device_leaked"]) == (0, 0, 0), t
    assert t["end_quarantined_slots"] == t["end_transfers_in_flight"] == 0, t
    assert t["prefix_hits"] > 0  # prefix hits took the device path too
    assert t["loaded"] > 0  # and misses were served from host
    return r, devices


def _runtime(layers: int, resolve: str, selection: str = "block") -> DecodeRuntime:
    model = TinySparseModel(ModelConfig(layers=layers, seed=5))
    return DecodeRuntime(
        model, page_size=8, device_slots=80 * layers, host_pages=120, indexer_pages=60,
        topk=3 if selection == "block" else 10, selection=selection, resolve=resolve,
    )  # fmt: skip


def _calls_per_step(layers: int, resolve: str, selection: str = "block") -> list[list[str]]:
    rt = _runtime(layers, resolve, selection)
    g = torch.Generator().manual_seed(1)
    for rid in range(3):
        rt.add_request(rid, torch.randint(0, 512, (40 + 9 * rid,), generator=g), 6)
    counting = Counting(rt.scheduler)
    rt.scheduler = counting
    per_step = []
    for _ in range(5):
        counting.calls.clear()
        rt.step()
        per_step.append(list(counting.calls))
    rt.scheduler = counting._inner
    return per_step


@pytest.mark.parametrize("selection", ["block", "token"])
def test_a_device_step_calls_the_core_a_fixed_number_of_times_not_per_layer(selection):
    # append, begin_device_step, end_step, whatever the layers (and, for a request whose
    # token starts a page, its new Indexer-K page: per page, not per layer).
    two, five = _calls_per_step(2, "device", selection), _calls_per_step(5, "device", selection)
    assert two == five
    for calls in two:
        core = [c for c in calls if c != "indexer_pages"]
        assert core == ["append", "begin_device_step", "end_step"], calls
    # The host path calls per layer (plan, ready, finish), so the count can tell them apart.
    host2, host5 = _calls_per_step(2, "host", selection), _calls_per_step(5, "host", selection)
    assert [len(c) for c in host2] != [len(c) for c in host5]


@pytest.mark.parametrize(
    ("selection", "faults", "kernel"),
    [
        ("block", False, False),
        ("token", False, False),
        ("block", True, False),
        ("block", False, True),
        ("token", False, True),
        ("token", True, True),
    ],
)
def test_demo_through_the_device_resolver_is_exact(monkeypatch, selection, faults, kernel):
    # With `kernel`, the CUDA kernel's own source (cuda/resolve.cu compiled for the CPU in test
    # builds), its cells racing on 4 threads, in place of the reference. It takes no copy
    # faults (a failed copy on a GPU is a sticky error), so the armed load faults fail
    # host-planned loads (prefill) instead.
    def hook(rt):
        if kernel:
            testing.use_host_kernel(rt, 4)

    cfg = demo.DemoConfig(
        requests=8, steps=24, selection=selection, faults=faults, resolve="device"
    )
    r, devices = run_device_demo(monkeypatch, cfg, hook)
    t = r["totals"]
    # Decode steps went through the resolver (not planned on the host instead).
    assert devices and all(d.scheduler.device_stats()["steps"] > 0 for d in devices)
    if not faults:
        # The prefills' evictions met objects the last device step had read, and passed them
        # over (the device's hits never reach the directory's LRU otherwise). (With faults the
        # conversations end early: a handful, timing-dependent.)
        assert t["device_second_chances"] > 0, t["device_second_chances"]
    if faults and not kernel:
        # The load faults failed the resolver's copies (one retried, one failed twice), and
        # every armed load fault fired.
        assert t["failed_loads"] >= 3 and t["retried_loads"] >= 2, t
        assert "loads" not in t["faults_unused"], t["faults_unused"]


@pytest.mark.parametrize(("selection", "kernel"), [("block", False), ("token", True)])
def test_fp8_rows_through_the_device_resolver_are_exact(monkeypatch, selection, kernel):
    # DeepSeek-V3.2's packed FP8 rows and values-then-scales Indexer-K pages: the resolver
    # copies whole pages, whatever their rows hold; the demo checks every logit bit for bit.
    def hook(rt):
        if kernel:
            testing.use_host_kernel(rt, 4)

    cfg = demo.DemoConfig(
        requests=8, steps=24, selection=selection, resolve="device", kv_format="fp8"
    )
    r, devices = run_device_demo(monkeypatch, cfg, hook)
    assert r["totals"]["kv_format"] == "fp8"
    assert devices and all(d.scheduler.device_stats()["steps"] > 0 for d in devices)


@pytest.mark.parametrize("selection", ["block", "token"])
def test_objects_a_restore_was_still_loading_enter_the_mirror_once_they_land(
    monkeypatch, selection
):
    # A full restore's loads are not waited for: at the next grant some are still in flight.
    # Each must enter the mirror once it lands (validate, after every step: every object of a
    # running request on the device is named where the directory has it), or the device
    # copies it in again into a slot of its own, and the device holds it twice.
    def hook(rt):
        step = rt.step

        def checked():
            rec = step()
            rt.scheduler.validate()
            return rec

        rt.step = checked

    # (The default conversations: their later turns restore from host.)
    cfg = demo.DemoConfig(selection=selection, restore="full", resolve="device")
    r, devices = run_device_demo(monkeypatch, cfg, hook)
    assert r["totals"]["restores_full"] > 0, r["totals"]
    assert devices and all(d.scheduler.device_stats()["steps"] > 0 for d in devices)


def test_the_device_path_resolves_decode_steps_and_its_record_counts_them():
    rt = _runtime(2, "device")
    g = torch.Generator().manual_seed(2)
    for rid in range(2):
        rt.add_request(rid, torch.randint(0, 512, (60,), generator=g), 5)
    for _ in range(5):
        rt.step()
    d = rt.scheduler.device_stats()
    assert d["steps"] == 5 and d["fallbacks"] == 0, d
    t = rt.scheduler.totals()
    assert t["pages"] == t["ready"] + t["loaded"] > 0, t
    rt.drain()
    for rid in range(2):
        rt.finish_request(rid)
    rt.drain()
    s = rt.scheduler.stats()
    assert (s["pins"], s["handles"]) == (0, 0), s
    rt.scheduler.validate()


def test_a_step_with_more_misses_than_its_grant_fills_earlier_layers_slots_again():
    # A grant covers one layer's cells: on a device kept nearly full of other pages, a step's
    # misses over every layer outnumber it, and later layers take the slots earlier layers
    # filled. The outputs stay the resident run's.
    tiered, ref = _miss_heavy_pair(steps=6)
    released = None
    for _ in range(6):
        tiered.step()
        ref.step()
        d = tiered.scheduler.device_stats()
        assert d["granted_victims"] <= d["granted"], d
        if d["granted_victims"] and released is None:
            # The standing grant's victims are directory objects it pins, and only it:
            # ending the grant (the run goes on after) lets go of exactly that many pins.
            pins = tiered.scheduler.stats()["pins"]
            tiered.scheduler.drain()
            after = tiered.scheduler.device_stats()
            assert after["granted"] == after["granted_victims"] == 0, after
            released = pins - tiered.scheduler.stats()["pins"]
            assert released == d["granted_victims"], (released, d)
    assert released, "a step left victims standing in the grant"
    d = tiered.scheduler.device_stats()
    assert d["refills"] > 0 and d["steps"] > 0, d
    for rid in range(3):
        a, b = tiered.finish_request(rid), ref.finish_request(rid)
        assert all(torch.equal(x, y) for x, y in zip(a.outputs, b.outputs, strict=True))
    tiered.drain()
    tiered.scheduler.validate()


def _miss_heavy_pair(layers: int = 4, steps: int = 10, selection: str = "block"):
    """A device-resolved runtime on a device too small for its requests' pages (most steps
    miss at every layer), its all-resident twin, and three requests of `steps` in both."""
    model = TinySparseModel(ModelConfig(layers=layers, seed=5))
    topk = 4 if selection == "block" else 24
    kw = dict(page_size=8, host_pages=200, indexer_pages=100, topk=topk, selection=selection)
    tiered = DecodeRuntime(model, device_slots=100, resolve="device", **kw)
    ref = DecodeRuntime(model, device_slots=2000, **kw)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (150,), generator=g) for _ in range(3)]
    for rt in (tiered, ref):
        for rid, p in enumerate(prompts):
            rt.add_request(rid, p, steps)
    return tiered, ref


def test_a_failed_device_copy_is_retried_once_then_fails_only_the_requests_that_needed_it():
    # The resident twin steps in lockstep and ends the same request after the same step (as
    # the demo's replay does), so both run the same batches.
    tiered, ref = _miss_heavy_pair()
    both = (tiered, ref)
    for rt in both:
        rt.step()
    # One failed copy: retried at once, nothing fails.
    tiered.inject_faults("load", 1)
    rec, _ = (rt.step() for rt in both)
    assert (rec.failed_loads, rec.retried_loads, rec.failed_requests) == (1, 1, 0), rec.core
    assert rec.failed == []
    # A copy and its retry fail at layer 1 (at the first step that misses there): the request
    # whose cell missed fails for that step; the others are served.
    tiered.inject_faults("load", 2, layer=1)
    for _ in range(4):
        rec, _ = (rt.step() for rt in both)
        if rec.failed:
            break
    assert rec.failed, "the armed faults never fired"
    assert rec.failed_loads == 2 and rec.failed_requests == len(rec.failed) == 1
    assert tiered.scheduler.stats()["faults_armed_loads"] == 0
    lost = rec.failed[0]
    assert lost in tiered.ended and lost not in tiered.requests
    tiered.scheduler.validate()
    ref.abort(lost)
    del ref.ended[lost].outputs[-1]
    # The failed request restarts and, like the others, decodes what the resident run does.
    for rt in both:
        rt.restart(lost)
    while any(not r.done for r in tiered.requests.values()):
        for rt in both:
            rt.step()
    for rid in range(3):
        a, b = tiered.finish_request(rid), ref.finish_request(rid)
        assert len(a.outputs) == len(b.outputs) == 10
        assert all(torch.equal(x, y) for x, y in zip(a.outputs, b.outputs, strict=True))
    tiered.drain()
    tiered.scheduler.validate()
    s = tiered.scheduler.stats()
    assert (s["pins"], s["handles"]) == (0, 0), s


def test_a_failed_copy_in_token_mode_fails_every_row_that_reads_it_and_spends_no_grant():
    # Token rows name a page many times: the cells after a failed copy fail without another
    # try, its slot serves the next miss, and the grant (one layer's cells) is still enough.
    tiered, _ = _miss_heavy_pair(selection="token")
    tiered.step()
    tiered.inject_faults("load", 2, layer=0)
    for _ in range(4):
        rec = tiered.step()  # no InternalError (an overflow would be one)
        if rec.failed:
            break
    assert rec.failed and rec.failed_requests == len(rec.failed), rec.core
    assert rec.failed_loads == 2 and rec.retried_loads == 1, rec.core
    tiered.drain()
    tiered.scheduler.validate()


def test_copy_faults_a_device_step_did_not_take_stay_armed():
    # Every page fits on the device: device steps copy nothing and hand the faults back.
    rt = _runtime(2, "device")
    g = torch.Generator().manual_seed(2)
    for rid in range(2):
        rt.add_request(rid, torch.randint(0, 512, (60,), generator=g), 5)
    rt.inject_faults("load", 3, layer=1)
    for _ in range(3):
        rec = rt.step()
        assert rec.loaded == rec.failed_loads == 0 and rec.failed == [], rec.core
    assert rt.scheduler.device_stats()["steps"] == 3
    assert rt.scheduler.stats()["faults_armed_loads"] == 3


def _small_device_run(
    slots: int, pages: tuple[int, int], topk: int, selection: str, steps: int, check=lambda rt: None
) -> DecodeRuntime:
    """Three 70-token requests decoded `steps` steps through the device resolver on `slots`
    device slots (host and Indexer-K `pages`), `check(rt)` after each step, and their outputs
    compared with a resident host-planned run's. Returns the device runtime, its requests
    finished."""
    model = TinySparseModel(ModelConfig(layers=2, seed=5))

    def runtime(n: int, resolve: str) -> DecodeRuntime:
        return DecodeRuntime(
            model, page_size=8, device_slots=n, host_pages=pages[0], indexer_pages=pages[1],
            topk=topk, selection=selection, resolve=resolve,
        )  # fmt: skip

    small, ref = runtime(slots, "device"), runtime(400, "host")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (70,), generator=g) for _ in range(3)]
    for rt in (small, ref):
        for rid, p in enumerate(prompts):
            rt.add_request(rid, p, steps)
    for _ in range(steps):
        small.step()
        check(small)
        ref.step()
    for rid in range(3):
        a, b = small.finish_request(rid), ref.finish_request(rid)
        assert all(torch.equal(x, y) for x, y in zip(a.outputs, b.outputs, strict=True))
    return small


def test_a_device_too_small_for_the_grant_plans_those_steps_on_the_host():
    # 34 slots for 3 requests reading 10 blocks a layer: most steps cannot be granted the 30
    # slots a layer's cells need.
    small = _small_device_run(34, (120, 60), 10, "block", 4)
    d = small.scheduler.device_stats()
    assert d["fallbacks"] >= 1 and d["steps"] + d["fallbacks"] == 4, d


@pytest.mark.parametrize("selection", ["block", "token"])
def test_a_step_planned_on_the_host_keeps_no_victim_the_device_may_take(selection):
    # 56 slots for 3 requests reading 10 blocks (30 tokens) a layer: some steps are granted,
    # some plan on the host, and a step the device could not grant leaves what it took
    # granted, victims among them. A kept selection of such a step must not hold one: the
    # next device step may evict it under the kept list ("held, but device Absent").
    topk = 10 if selection == "block" else 30
    small = _small_device_run(
        56, (200, 80), topk, selection, 8, check=lambda rt: rt.scheduler.validate()
    )
    d = small.scheduler.device_stats()
    assert d["fallbacks"] >= 1 and d["steps"] >= 2, d
    _ends_clean(small)


@pytest.mark.parametrize("kernel", [False, True])
def test_resolver_misuse_is_refused_before_anything_changes(kernel):
    # The same refusals with the CUDA kernel's source in the reference's place.
    rt = _runtime(2, "device")
    rt.add_request(0, torch.arange(30) % 512, 4)
    res = rt.resolver
    with pytest.raises(sp.OutOfRangeError) as e:
        testing.use_host_kernel(res, 0)
    assert e.value.field == "threads"
    if kernel:
        testing.use_host_kernel(res, 4)
    rids = np.array([0], dtype=np.int64)
    sel = np.array([[0, 1, -1]], dtype=np.int32)
    # No step granted.
    with pytest.raises(sp.ConfigError) as e:
        res.resolve(0, rids, sel)
    assert e.value.field == "step"
    rt.scheduler.append(rids)
    with pytest.raises(sp.ConfigError) as e:
        rt.scheduler.begin_device_step(np.array([0, 0]), 3)
    assert e.value.field == "rids"
    # A host layer plan left open: its pins are not the grant's to count.
    plan, _ = rt.scheduler.plan(0, rids, np.array([[0, 1]], np.int64), rt.unit)
    with pytest.raises(sp.ConfigError) as e:
        rt.scheduler.begin_device_step(rids, 3)
    assert e.value.field == "plans"
    assert not res.step_open
    rt.scheduler.finish(plan)
    assert rt.scheduler.begin_device_step(rids, 3)
    with pytest.raises(sp.ConfigError) as e:
        rt.scheduler.begin_device_step(rids, 3)
    assert e.value.field == "step"
    with pytest.raises(sp.OutOfRangeError) as e:
        res.resolve(2, rids, sel)
    assert e.value.field == "layer"
    for bad, field in [
        # Fewer rows than requests (more are padding: test_resolver_capture.py).
        (lambda: res.resolve(0, rids, np.zeros((0, 3), np.int32)), "selection.shape"),
        (lambda: res.resolve(0, rids, sel.astype(np.int64)), "selection"),
        (lambda: res.resolve(0, rids, np.array([[0, 9, -1]], np.int32)), "selection"),
        (lambda: res.resolve(0, np.array([7]), sel), "rids"),
        # One request twice: the step's grant and log were sized for its rows once each.
        (lambda: res.resolve(0, np.array([0, 0]), np.zeros((2, 3), np.int32)), "rids"),
    ]:
        with pytest.raises(sp.ConfigError) as e:
            bad()
        assert e.value.field == field, (field, e.value)
    # The resolver cannot change how it resolves in the middle of a step.
    with pytest.raises(sp.ConfigError) as e:
        testing.use_host_kernel(res, 2)
    assert e.value.field == "step"
    # Rows wider than the step was granted for: its log and grant would not cover them.
    with pytest.raises(sp.ConfigError) as e:
        res.resolve(0, rids, np.array([[0, 1, -1, -1]], np.int32))
    assert e.value.field == "selection.shape"
    table = res.resolve(0, rids, sel)
    assert table.dtype == np.int32 and table.shape == (1, 3) and table[0, 2] == -1
    # Each layer once a step: a second call could refill a slot a cell of the first read.
    with pytest.raises(sp.ConfigError) as e:
        res.resolve(0, rids, sel)
    assert e.value.field == "layer"
    rt.scheduler.end_step()
    assert not res.step_open
    rt.scheduler.validate()


def test_host_calls_are_refused_while_a_device_step_is_open():
    # The step's later layers may read any slot the mirror names (nothing the device reads is
    # pinned): a call that could take a device slot or free a page waits for end_step.
    rt = _runtime(2, "device")
    rt.add_request(0, torch.arange(30) % 512, 4)
    rt.add_request(1, torch.arange(40) % 512, 4)
    s, res = rt.scheduler, rt.resolver
    rids = np.array([0], dtype=np.int64)
    s.append(rids)
    assert s.begin_device_step(rids, 3)
    res.resolve(0, rids, np.array([[0, 1, -1]], np.int32))
    before = (s.device_stats(), s.request_len(1))
    sel = np.array([[0, 1]], dtype=np.int64)
    for call in [
        lambda: s.append(np.array([1])),
        lambda: s.extend(1, 8),
        lambda: s.plan(1, np.array([1]), sel, 8),
        lambda: s.plan_csr(1, np.array([1]), np.array([0, 2]), np.array([0, 1]), 8),
        lambda: s.admit(5, np.arange(24) % 512),
        lambda: s.finish_request(1),
        lambda: s.finish_request(1, np.arange(40) % 512),
        lambda: s.evict_prefix(1, 1),
    ]:
        with pytest.raises(sp.ConfigError) as e:
            call()
        assert e.value.field == "step", e.value
    assert (s.device_stats(), s.request_len(1)) == before
    res.resolve(1, rids, np.array([[0, 1, -1]], np.int32))
    s.end_step()
    s.validate()
    # Once the step ends they run.
    s.extend(1, 8)
    s.finish_request(1)
    s.validate()


def test_a_forward_that_raises_ends_the_device_step():
    rt = _runtime(2, "device")
    rt.add_request(0, torch.arange(30) % 512, 4)

    def broken(*args, **kwargs):
        raise RuntimeError("the model failed")

    forward, rt._forward = rt._forward, broken
    with pytest.raises(RuntimeError, match="the model failed"):
        rt.step()
    assert not rt.resolver.step_open
    rt.scheduler.validate()
    rt._forward = forward
    rec = rt.step()  # the next step runs, on the device
    assert rec.requests == 1 and rt.scheduler.device_stats()["steps"] == 2
    rt.scheduler.validate()


def test_resolve_device_is_refused_where_it_cannot_run():
    model = TinySparseModel(ModelConfig(layers=2))
    kw = dict(page_size=8, device_slots=80, host_pages=40, indexer_pages=20, topk=3)
    with pytest.raises(sp.ConfigError) as e:
        DecodeRuntime(model, resolve="gpu", **kw)
    assert e.value.field == "resolve"
    with pytest.raises(sp.ConfigError) as e:
        DecodeRuntime(model, resolve="device", block_size=16, **kw)
    assert e.value.field == "block_size"
    with pytest.raises(sp.ConfigError) as e:
        DecodeRuntime(model, resolve="device", selection="token", token_map="device",
                      **{**kw, "topk": 10})  # fmt: skip
    assert e.value.field == "token_map"


def test_bench_decode_resolve_device_pairs_the_two_paths_on_the_same_selections():
    from sparsetier.tools import bench_resolve
    from sparsetier.tools.bench_decode import DecodeBenchConfig

    for mode in ("block", "token"):
        cfg = DecodeBenchConfig(
            layers=3, batch=4, context_min=512, context_max=1024, steps=4, warmup=3,
            budget=0.3, mode=mode, tokens=64, token_pages=8,
        )  # fmt: skip
        for threads in (None, 2):
            # With threads: the kernel's source on CPU threads, through a GPU's protocol.
            r = bench_resolve.run(cfg, kernel_threads=threads)
            assert r["steps"] == 4 and r["device_steps"] == 7 and r["device_fallbacks"] == 0, r
            # Both sides read the same pages; the device side's loads differ only by what its
            # grant's victims and holds keep, not by more than the host side loads.
            assert r["device_loaded"] <= 2 * r["host_loaded"] + 64, r
            assert (r["boundary_device_ms"] > 0) == (threads is not None), r
            assert "device/host" in bench_resolve.format_report(r)


def test_a_prefill_whose_layer_plan_makes_room_keeps_its_chunks_later_layers():
    # Found by the resolve-paths machine: a prefix hit admitted onto a full device; its
    # prefill's layer-0 plan makes room, which once wrote the chunk's later layers through
    # unwritten and evicted them, so those layers' rows landed in slots other objects took.
    from test_resolve_paths_stateful import PROMPTS

    model = TinySparseModel(ModelConfig(layers=3, seed=7))
    kw = dict(page_size=8, host_pages=160, indexer_pages=80, topk=3, prefetch=False)
    tiered = DecodeRuntime(model, device_slots=72, resolve="device", **kw)
    ref = DecodeRuntime(model, device_slots=2000, **kw)
    both = (tiered, ref)

    def add(rid, prompt, steps):
        for rt in both:
            rt.add_request(rid, PROMPTS[prompt], steps)

    def step():
        for rt in both:
            rt.step()

    add(0, 0, 2)
    add(1, 0, 3)
    step()
    add(2, 2, 2)
    step()
    for rt in both:
        rt.finish_request(0)
    add(3, 2, 2)  # matches request 0's pages, onto a device with three slots free
    tiered.drain()
    tiered.scheduler.validate()  # (test builds: device and host copies hold the same bytes)
    step()
    for rid in (1, 2, 3):
        a, b = tiered.requests[rid], ref.requests[rid]
        assert all(torch.equal(x, y) for x, y in zip(a.outputs, b.outputs, strict=True)), rid


def _outgrown_prefix(device_slots: int) -> tuple[DecodeRuntime, torch.Tensor, torch.Generator]:
    """A 3-layer runtime (device-resolved when `device_slots` is small) and a 400-token prompt
    that outgrows a 100-slot device, so that decode steps copy the blocks they miss into the
    resolver's pool; with the generator that drew it."""
    model = TinySparseModel(ModelConfig(layers=3, seed=5))
    rt = DecodeRuntime(
        model, device_slots=device_slots, resolve="device" if device_slots < 2000 else "host",
        page_size=8, host_pages=300, indexer_pages=200, topk=4, prefetch=False, prefill_chunk=16,
    )  # fmt: skip
    g = torch.Generator().manual_seed(6)
    return rt, torch.randint(0, 512, (400,), generator=g), g


def _ends_clean(rt: DecodeRuntime) -> None:
    """Every transfer landed, the scheduler's checks hold, and nothing stays pinned."""
    rt.drain()
    rt.scheduler.validate()
    s = rt.scheduler.stats()
    assert (s["pins"], s["handles"]) == (0, 0), s


@pytest.mark.parametrize("kernel", [False, True])
def test_host_loads_adopt_what_the_resolvers_pool_holds_instead_of_copying_it_again(kernel):
    # Request 0's decode steps copy the blocks they miss into the resolver's pool (its prompt
    # outgrows the device). Request 1 extends its prompt after it ended: its prefill plans on
    # the host over request 0's pages, and the blocks the pool holds are handed to the
    # directory where they are (hits, not loads). The outputs stay the resident run's, and
    # validate() (test builds: device bytes against host copies) holds with the adopted
    # objects in the directory.
    tiered, prompt, g = _outgrown_prefix(100)
    ref, _, _ = _outgrown_prefix(2000)
    if kernel:
        testing.use_host_kernel(tiered, 2)
    outputs = {}
    for rt in (tiered, ref):
        rt.add_request(0, prompt, 8)
        for _ in range(8):
            rt.step()
        outputs[rt] = [rt.finish_request(0)]
    d0 = tiered.scheduler.device_stats()
    assert d0["pool_live"] > 0 and d0["adopted"] == 0, d0
    longer = torch.cat([prompt, torch.randint(0, 512, (30,), generator=g)])
    for rt in (tiered, ref):
        assert rt.add_request(1, longer, 4)["matched_pages"] > 0
    d1 = tiered.scheduler.device_stats()
    assert d1["adopted"] > 0, d1
    tiered.scheduler.validate()
    for rt in (tiered, ref):
        for _ in range(4):
            rt.step()
        outputs[rt].append(rt.finish_request(1))
    for a, b in zip(outputs[tiered], outputs[ref], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a.outputs, b.outputs, strict=True))
    _ends_clean(tiered)


def test_a_step_whose_read_back_fails_leaves_the_core_whole_and_the_run_exact():
    # A GPU's read-back of a step's log can fail (cuMemcpyDtoHAsync): the step's work is done
    # and the core learns nothing of it. The step ends with CudaError; every slot of its grant
    # counts as overwritten (victims evicted, slots back in the pool empty, the mirror sent
    # whole at the next step), and the run goes on exact, with nothing leaked.
    tiered, ref = _miss_heavy_pair(steps=8)
    testing.use_host_kernel(tiered, 2)
    for rt in (tiered, ref):
        for _ in range(3):
            rt.step()
    testing.fail_device_read_backs(tiered, 1)
    with pytest.raises(sp.CudaError, match="read-back"):
        tiered.step()
    ref.step()
    tiered.scheduler.validate()
    d = tiered.scheduler.device_stats()
    assert d["granted"] == 0 and d["pool"] > 0, d
    for rt in (tiered, ref):
        for _ in range(4):
            rt.step()
    tiered.scheduler.validate()
    assert tiered.scheduler.device_stats()["steps"] >= 7
    for rid in range(3):
        a, b = tiered.finish_request(rid), ref.finish_request(rid)
        assert all(torch.equal(x, y) for x, y in zip(a.outputs, b.outputs, strict=True)), rid
    _ends_clean(tiered)


def test_a_step_whose_read_back_fails_still_ends_and_keeps_its_faults_armed():
    rt = _runtime(2, "device")
    testing.use_host_kernel(rt, 2)
    g = torch.Generator().manual_seed(2)
    rt.add_request(0, torch.randint(0, 512, (60,), generator=g), 5)
    rt.step()
    before = rt.records[-1].core["step"]
    testing.fail_device_read_backs(rt, 1)
    # Handed to the step (the kernel takes no copy faults), and armed again after it.
    testing.inject_faults(rt, "load", 1)
    steps = rt.steps
    with pytest.raises(sp.CudaError, match="read-back"):
        rt.step()
    assert rt.scheduler.stats()["faults_armed_loads"] == 1
    rt.step()
    # The failed step ended in the core (a step's number went by), and in the runtime.
    assert rt.records[-1].core["step"] == before + 2
    assert rt.steps == steps + 2 and rt.records[-1].step == steps + 1
    rt.scheduler.validate()


def test_read_back_faults_need_the_kernel():
    rt = _runtime(2, "device")
    with pytest.raises(sp.ConfigError, match="resolver"):
        testing.fail_device_read_backs(rt, 1)


def test_a_host_plan_whose_rows_share_a_pooled_object_adopts_it_once():
    # Two requests on the same prefix: a host plan's rows name the same objects (the plan
    # dedups within a row only). An object the resolver's pool holds is adopted once, the
    # plan reads it, and the pool and the directory agree afterwards (found by a review:
    # the second adoption of the slot was refused half-way, leaving it in both).
    rt, prompt, _ = _outgrown_prefix(100)
    rt.add_request(0, prompt, 8)
    for _ in range(8):
        rt.step()
    rt.finish_request(0)
    rt.add_request(1, prompt[:200], 2)
    rt.add_request(2, prompt[:200], 2)
    before = rt.scheduler.device_stats()
    assert before["pool_live"] > 0, before
    rids = np.array([1, 2], dtype=np.int64)
    blocks = np.tile(np.arange(24, dtype=np.int32), (2, 1))
    for layer in range(3):
        plan, _ = rt.scheduler.plan(layer, rids, blocks, rt.unit)
        bad, _ = rt.scheduler.ready(plan, None)
        assert not bad
        rt.scheduler.finish(plan)
    after = rt.scheduler.device_stats()
    assert after["adopted"] > before["adopted"], (before, after)
    rt.scheduler.validate()
    for _ in range(2):
        rt.step()
    for rid in (1, 2):
        rt.finish_request(rid)
    _ends_clean(rt)
