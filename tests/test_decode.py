"""The indexer and sparse attention against float64 references, and the decode runtime:
tiering is bit-exact, and prefetch hides what the overlap window covers."""

import gc
import math
import time

import numpy as np
import pytest
import torch
from scheduler_support import small_scheduler

import sparsetier as st
from sparsetier import testing
from sparsetier.attention import attend, sparse_attention
from sparsetier.indexer import SparseIndexer, select_blocks
from sparsetier.tools.model import ModelConfig, TinySparseModel
from sparsetier.tools.runtime import DecodeRuntime


def rope64(x, pos, theta=10_000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv[None]
    shape = [ang.shape[0]] + [1] * (x.dim() - 2) + [d // 2]
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_indexer_matches_float64_reference(zero_centered):
    torch.manual_seed(0)
    idx = SparseIndexer(32, heads=3, head_dim=16, zero_centered=zero_centered)
    with torch.no_grad():
        idx.gamma_k.uniform_(-0.5, 0.5) if zero_centered else idx.gamma_k.uniform_(0.5, 1.5)
    hidden = torch.randn(40, 32)
    pos = torch.arange(40)
    k = idx.key(hidden, pos)
    assert k.dtype == torch.bfloat16
    h64 = hidden.double()
    k64 = h64 @ idx.wk.weight.double().T
    k64 = k64 / torch.sqrt(k64.pow(2).mean(-1, keepdim=True) + 1e-6)
    g = idx.gamma_k.double()
    k64 = rope64(k64 * ((1 + g) if zero_centered else g), pos)
    torch.testing.assert_close(k.double(), k64, atol=0.05, rtol=0.02)
    s = idx.scores(hidden[-2:], pos[-2:], k)
    q64 = rope64((h64[-2:] @ idx.wq.weight.double().T).view(2, 3, 16), pos[-2:])
    w64 = h64[-2:] @ idx.ww.weight.double().T
    ref = torch.einsum("th,ths->ts", w64, torch.relu(torch.einsum("thd,sd->ths", q64, k.double())))
    torch.testing.assert_close(s.double(), ref, atol=0.1, rtol=0.05)


def test_selection_keeps_sink_and_window_and_takes_top_blocks():
    scores = torch.zeros(100)
    scores[37] = 9.0  # block 2 (of 16-token blocks) scores highest
    scores[70] = 5.0  # block 4
    sel = select_blocks(scores, pos=99, block_size=16, topk=4, window=1, reduce="max")
    assert sel.blocks.tolist() == [0, 2, 4, 6]  # sink, top-2, local window (the last block)
    sel = select_blocks(scores, pos=99, block_size=16, topk=2, window=1, reduce="max")
    assert sel.blocks.tolist() == [0, 6]  # sink and window are never dropped
    mean = select_blocks(scores, pos=99, block_size=16, topk=3, window=1, reduce="mean")
    assert mean.blocks.tolist() == [0, 2, 6]
    with pytest.raises(st.ConfigError):
        select_blocks(scores, 99, 16, 3, 1, "median")


def test_nan_in_indexer_input_raises():
    idx = SparseIndexer(8, heads=1, head_dim=8)
    pool = torch.zeros((1, 1, 4, 4, 1, 8), dtype=torch.bfloat16)
    with pytest.raises(st.ConfigError) as e:
        idx.store_key(
            torch.full((1, 8), float("nan")), torch.tensor([0]), torch.tensor([0]), pool, 0
        )
    assert e.value.field == "hidden"


@pytest.mark.parametrize("resolve", ["host", "device"])
def test_a_request_whose_logits_are_nan_fails_alone(resolve):
    # On a GPU the layers do not stop the host to check their keys for NaN: the runtime checks
    # each step's logits in the copy it makes anyway, and fails only the rows with a NaN; the
    # others are served as before, and a slot the failed request leaves with NaN rows is never
    # read into another's sum (masked rows read zeros).
    def runtime():
        m = TinySparseModel(ModelConfig(seed=3))
        return DecodeRuntime(m, page_size=8, device_slots=400, host_pages=200,
                             indexer_pages=80, topk=4, resolve=resolve)  # fmt: skip

    rt, ref = runtime(), runtime()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (30 + 9 * r,), generator=g) for r in range(3)]
    for r in (rt, ref):
        for rid, p in enumerate(prompts):
            r.add_request(rid, p, 4)
        r.step()
    logits = rt.model.logits

    def poisoned(x):
        out = logits(x).clone()
        out[1, 3] = float("nan")
        return out

    rt.model.logits = poisoned
    rec = rt.step()
    rt.model.logits = logits
    assert rec.failed == [1] and [f[1:] for f in rt.failures] == [(1, "NaN logits")]
    ref.step()
    ref.abort(1)  # (the same batches from here on: outputs depend on the batch's rows)
    for r in (rt, ref):
        r.step()
    for rid in (0, 2):
        a, b = rt.finish_request(rid), ref.finish_request(rid)
        assert all(torch.equal(x, y) for x, y in zip(a.outputs, b.outputs, strict=True))
    finish_all(rt)


@pytest.mark.parametrize("mode", ["block", "token"])
def test_an_exception_inside_a_layer_leaves_no_plan_open(monkeypatch, mode):
    # An error in a layer's attention (an out-of-memory, a Ctrl-C) after its plan: the plan is
    # finished all the same. Before, it stayed open, its id lost: it held its pins, and the
    # core refused to end any later step ("plans: 1 still open").
    from sparsetier.tools import runtime as runtime_mod

    m = TinySparseModel(ModelConfig(seed=3))
    rt = DecodeRuntime(m, page_size=8, device_slots=400, host_pages=200, indexer_pages=80,
                       topk=4 if mode == "block" else 16, selection=mode)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    for rid in range(2):
        rt.add_request(rid, torch.randint(0, 512, (30 + 9 * rid,), generator=g), 4)
    rt.step()
    real, calls = runtime_mod.sparse_attention_batched, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # the step's second layer
            raise RuntimeError("out of memory (injected)")
        return real(*a, **k)

    monkeypatch.setattr(runtime_mod, "sparse_attention_batched", failing)
    with pytest.raises(RuntimeError, match="injected"):
        rt.step()
    monkeypatch.setattr(runtime_mod, "sparse_attention_batched", real)
    rt.scheduler.end_step()
    # (The step's tokens were appended in the core and not taken: its requests are aborted,
    # not finished over tokens they do not hold.)
    for rid in list(rt.requests):
        rt.abort(rid)
    finish_all(rt)


def test_rows_attention_masks_never_reach_the_output_even_as_nan():
    # A slot's rows past a query's position (or a slot a failed request left) may hold NaN:
    # masked out, they must not reach the sum through a zero weight.
    from sparsetier.attention import sparse_attention_batched

    g = torch.Generator().manual_seed(2)
    pool = torch.randn((2, 1, 4, 8, 2, 16), generator=g)
    clean = pool.clone()
    pool[:, 0, 1, 5:] = float("nan")  # rows past position 12 in slot 1 (page 1)
    clean[:, 0, 1, 5:] = 0.0
    q = torch.randn((1, 4, 16), generator=g)
    sel = torch.tensor([[0, 1]])
    table = torch.tensor([[2, 1]], dtype=torch.int32)
    pos = torch.tensor([12])
    out = sparse_attention_batched(q, pool, table, sel, pos, 8, 8)
    assert torch.isfinite(out).all()
    assert torch.equal(out, sparse_attention_batched(q, clean, table, sel, pos, 8, 8))
    k, v = pool[0, 0, 1], pool[1, 0, 1]
    mask = torch.arange(8) <= 4
    assert torch.isfinite(attend(q[0], k, v, mask)).all()


def test_sparse_attention_with_every_block_equals_dense():
    torch.manual_seed(1)
    bs, n_blocks, hkv, d = 8, 5, 2, 16
    pool = torch.randn(2, 1, 12, bs, hkv, d).to(torch.bfloat16)
    slots = torch.tensor([7, 2, 9, 0, 4])  # blocks 0..4 live in these slots
    pos = n_blocks * bs - 3
    q = torch.randn(4, d)  # GQA: 4 query heads over 2 KV heads
    out = sparse_attention(q, pool, slots, torch.arange(n_blocks), pos, bs)
    k = pool[0, 0, slots].reshape(-1, hkv, d).double()[: pos + 1]
    v = pool[1, 0, slots].reshape(-1, hkv, d).double()[: pos + 1]
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    p = torch.softmax(torch.einsum("hd,shd->hs", q.double(), kk) / math.sqrt(d), -1)
    torch.testing.assert_close(
        out.double(), torch.einsum("hs,shd->hd", p, vv), atol=1e-5, rtol=1e-5
    )
    full = attend(q, k.float(), v.float(), torch.ones(pos + 1, dtype=torch.bool))
    torch.testing.assert_close(out, full)


SYSTEM = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(5))


def run(device_slots, prefetch=True, share=False, mode="block", steps=12, faults=None, aborts=None,
        layout="layer_first", kv_format="bf16", io="cpu", token_map="core",
        restart=False):  # fmt: skip
    """Three requests over a 37-token system prompt (4 whole pages of 8), `steps` decode steps.
    With `share`, a first request over the prompt runs and ends before them, so they find its
    pages in the prefix cache. `faults` maps a step to `(kind, count, layer)` armed before it;
    `aborts` maps a step to requests ended after it (a reference run replays a faulty run's
    failures this way). With `restart`, a failed request is restarted after its step (an
    aborted one too, that step's output dropped as a failure drops it), and the run goes on
    until every request has its `steps` outputs. `io` "kernel" or "direct" runs it on the
    GPU."""
    device = "cpu" if io == "cpu" else "cuda"
    m = TinySparseModel(ModelConfig(seed=3)).to(device)
    rt = DecodeRuntime(
        m, page_size=8, device_slots=device_slots, host_pages=200, indexer_pages=80,
        topk=4 if mode == "block" else 12, prefetch=prefetch, selection=mode, layout=layout,
        kv_format=kv_format, io_backend=io, device=device, token_map=token_map,
    )  # fmt: skip
    g = torch.Generator().manual_seed(5)
    if share:
        first = torch.cat([SYSTEM, torch.randint(0, 512, (11,), generator=g)])
        rt.add_request(9, first, 2)
        rt.step()
        rt.step()
        rt.finish_request(9)
    for rid in range(3):
        own = torch.randint(0, 512, (int(23 + 25 * rid),), generator=g)
        rt.add_request(rid, torch.cat([SYSTEM, own]), steps)
    outs = {}
    step = 0
    while step < steps or (restart and any(not r.done for r in rt.requests.values())):
        assert step < 4 * steps, "restarted requests must finish"
        if faults and step in faults:
            rt.inject_faults(*faults[step])
        rec = rt.step()
        for rid in (aborts or {}).get(step, []):
            outs[rid] = torch.stack(rt.requests[rid].outputs)
            rt.abort(rid)
            if restart:
                del rt.ended[rid].outputs[-1]
        if restart:
            for rid in sorted(set(rec.failed) | set((aborts or {}).get(step, []))):
                rt.restart(rid)
        step += 1
    for rid, r in rt.requests.items():
        outs[rid] = torch.stack(r.outputs)
    return rt, outs


def tree_pages(rt):
    p = rt.prefix_stats()
    return p["host_capacity"] - p["host_free"]


@pytest.mark.parametrize("mode", ["block", "token"])
@pytest.mark.parametrize(("prefetch", "share"), [(True, False), (False, False), (True, True)])
def test_tiered_decode_is_bit_identical_to_resident(prefetch, share, mode):
    tiered, a = run(40, prefetch, share, mode)
    _, b = run(400, prefetch, share, mode)
    assert sum(r.loaded for r in tiered.records) > 0, "the budget must force loads"
    assert a.keys() == b.keys()
    assert all(torch.equal(a[r], b[r]) for r in a)
    if prefetch:
        assert sum(r.prefetch_hits for r in tiered.records) > 0
    if share:
        assert tiered.prefix_stats()["hits"] == 3
    tiered.drain()
    tiered.scheduler.validate()
    for rid in list(tiered.requests):
        tiered.finish_request(rid)
    s = tiered.scheduler.stats()
    # What stays: the pages the ended requests inserted into the prefix tree, every layer
    # an object at its host page; nothing pinned.
    assert (s["objects"], s["pins"], s["handles"]) == (tree_pages(tiered) * 2, 0, 0)
    tiered.scheduler.validate()


@pytest.mark.parametrize("prefetch", [True, False])
def test_token_mode_mapped_on_the_device_decodes_as_the_core_mapping(prefetch):
    # The tokens mapped to pages by `map_tokens` (on the model's device) and planned as page
    # rows with counts: the same outputs as the all-resident run, and the same selections,
    # pages and needed bytes as the core's own mapping (the tiny model's top-k tokens are
    # distinct, so both count the same tokens).
    mapped, a = run(40, prefetch, mode="token", token_map="device")
    core, c = run(40, prefetch, mode="token")
    _, b = run(400, prefetch, mode="token", token_map="device")
    assert all(torch.equal(a[r], b[r]) and torch.equal(a[r], c[r]) for r in b)
    tm, tc = mapped.scheduler.totals(), core.scheduler.totals()
    for f in ("selected", "pages", "bytes_needed"):
        assert tm[f] == tc[f], (f, tm[f], tc[f])
    assert tm["bytes_transferred"] > 0
    finish_all(mapped)
    with pytest.raises(st.ConfigError) as e:
        run(40, mode="token", token_map="gpu")
    assert e.value.field == "token_map"


@pytest.mark.parametrize("mode", ["block", "token"])
@pytest.mark.parametrize("layout", ["layer_first", "layer_page_first"])
def test_fp8_caches_tier_bit_identically(mode, layout):
    # DeepSeek-V3.2's formats on the tiny model: FP8 K/V rows with per-head scales, Indexer-K
    # in values-then-scales pages. Prefix hits restore split Indexer-K pages.
    tiered, a = run(40, True, True, mode, layout=layout, kv_format="fp8")
    _, b = run(400, True, True, mode, layout=layout, kv_format="fp8")
    assert tiered.device_kv.dtype == torch.uint8 and tiered.kv_spec.page_layout == "interleaved"
    assert tiered.scheduler.totals()["bytes_transferred"] > 0
    assert tiered.prefix_stats()["hits"] == 3
    assert all(torch.equal(a[r], b[r]) for r in a)
    # A K row of 2 heads x 16 dims: 32 FP8 values + 2 fp32 scales = 40 B (64 B in bf16); an
    # Indexer-K row: 16 values + 1 scale = 20 B, the scales after all the page's values.
    assert tiered.kv_spec.token_bytes == 40
    assert tiered.indexer_pool.shape[-1] == 20
    finish_all(tiered)


def test_a_step_makes_one_plan_per_layer_for_the_whole_batch():
    rt, _ = run(40, steps=3)
    for rec in rt.records:
        assert rec.requests == 3 and rec.layers == 2  # plans finished: one per layer
        assert rec.load_submissions <= 2 + 2  # one per layer with misses (+ a prefetch each)
    # Between steps only the next step's first prefetch is outstanding, and only when layer 0
    # predicted pages it does not keep (kept pages are the prediction, held already); whether
    # it did depends on which backups had landed when a plan made room. Drain releases it.
    st = rt.scheduler.stats()
    assert st["prefetches_outstanding"] <= 1
    assert st["prefetches_outstanding"] == 1 or st["kept_pins"] > 0
    assert st["plans_outstanding"] == 0
    rt.drain()
    assert rt.directory.stats()["handles"] == 0


def test_a_plan_that_makes_room_after_its_rows_dropped_kept_pages_starts_over():
    # The second plan of layer 1 keeps none of the pages the first kept, and finds the device
    # full of pages not yet written through: making room gives every kept page back, those it
    # dropped included, so it must start over rather than give them back again at finish.
    # (Found by test_misuse.py's pair of threads planning and appending.)
    s = small_scheduler(4, 32, 128, 2, {1: 8, 2: 8})
    for _ in range(22):  # 30 tokens each: 8 pages x 2 layers x 2 requests fill the device
        s.append([1, 2])
    for layer, sel in [(0, [[3, 1, 1], [3, 1, 1]]), (1, [[2, 1, 5], [5, 5, 4]])]:
        p, _ = s.plan(layer, [1, 2], np.array(sel), 4)
        s.ready(p)
        s.finish(p)
    for _ in range(3):  # some find no room: kept pages are not evictable
        try:
            s.append([1, 2])
        except st.OutOfPagesError:
            pass
    p, _ = s.plan(1, [1, 2], np.array([[0, 4, 3], [-1, -1, 1]]), 4)
    s.ready(p)
    s.finish(p)
    s.validate()
    assert s.stats()["pins"] == s.stats()["kept_pins"]


def test_token_mode_maps_tokens_to_pages_and_reports_read_amplification():
    rt, _ = run(40, prefetch=False, mode="token")
    tot = rt.scheduler.totals()
    assert tot["selected"] > tot["pages"]  # several selected tokens share a page
    assert tot["bytes_transferred"] > 0
    # Whole pages moved for a few selected tokens each: more bytes moved than needed.
    assert tot["read_amplification"] > 1.0
    assert tot["bytes_needed_of_transferred"] <= tot["bytes_transferred"]


def test_block_mode_read_amplification_is_one():
    rt, _ = run(40, prefetch=False)
    tot = rt.scheduler.totals()
    assert tot["bytes_transferred"] > 0
    assert tot["read_amplification"] == pytest.approx(1.0)


def finish_all(rt):
    for rid in list(rt.requests):
        rt.finish_request(rid)
    rt.drain()
    rt.scheduler.validate()
    s = rt.scheduler.stats()
    assert (s["pins"], s["handles"], s["device_quarantined"], s["transfers_in_flight"]) == (
        0, 0, 0, 0,
    )  # fmt: skip
    assert s["device_used"] + s["device_free"] == s["device_capacity"]
    return s


def needs_engine(io):
    """Skips (saying why) a CUDA engine's case where no GPU is."""
    if io != "cpu" and not (torch.cuda.is_available() and st.cuda_status()[0]):
        pytest.skip(f"the {io} engine needs a CUDA GPU: {st.cuda_status()[1]}")


# Faults go through each engine's own hook: the CUDA engines copy the layers before the
# failed one and fail the rest, as a launch that failed part-way (run by gpu-check.sh).
ENGINES = ["cpu", "kernel", "direct"]


@pytest.mark.parametrize("io", ENGINES)
@pytest.mark.parametrize("prefetch", [True, False])
def test_one_failed_load_is_retried_and_every_output_stays_exact(prefetch, io):
    needs_engine(io)
    faulty, a = run(40, prefetch, faults={3: ("load", 1, None)}, io=io)
    _, b = run(400, prefetch, io=io)
    tot = faulty.scheduler.totals()
    assert tot["failed_loads"] == 1 and tot["retried_loads"] == 1
    assert not faulty.failures
    assert all(torch.equal(a[r], b[r]) for r in b)
    finish_all(faulty)


@pytest.mark.parametrize("io", ENGINES)
def test_every_load_of_a_layer_failing_fails_only_the_requests_that_needed_it(io):
    # Two failures at layer 1: the load and its retry. Requests that needed a page from host
    # at that layer fail; the others decode on, exactly as in a run where those requests were
    # ended at the same step.
    needs_engine(io)
    faulty, a = run(60, False, faults={4: ("load", 2, 1)}, io=io)
    assert faulty.scheduler.stats()["faults_armed_loads"] == 0  # both taken
    failed = sorted({rid for _, rid, _ in faulty.failures})
    assert failed, "the fault must hit a load"
    assert len(failed) < 3, "a request reading only device pages goes on"
    step = faulty.failures[0][0]
    _, b = run(400, False, aborts={step: failed}, io=io)
    assert faulty.scheduler.totals()["retried_loads"] >= 1
    survivors = [r for r in range(3) if r not in failed]
    for r in survivors:
        assert torch.equal(a[r], b[r])
    rec = faulty.records[step]
    assert rec.failed == failed and rec.failed_requests == len(failed)
    finish_all(faulty)


@pytest.mark.parametrize("io", ENGINES)
@pytest.mark.parametrize("mode", ["block", "token"])
def test_a_restarted_request_keeps_its_outputs_and_decodes_the_rest_exactly(mode, io):
    # "The runtime then ends or restarts those requests": a request whose load and retry
    # failed is restarted (its prompt and fed tokens prefilled again); it keeps the outputs it
    # had, recomputes the failed step's, and ends with all its steps. Its outputs equal a
    # resident run's that restarted it at the same step, the others' the plain resident run's.
    needs_engine(io)
    faulty, a = run(60, False, mode=mode, faults={4: ("load", 2, 1)}, restart=True, io=io)
    failed = sorted({rid for _, rid, _ in faulty.failures})
    assert failed and len(failed) < 3
    step = faulty.failures[0][0]
    _, b = run(400, False, mode=mode, aborts={step: failed}, restart=True, io=io)
    _, plain = run(400, False, mode=mode, io=io)
    for r in range(3):
        assert a[r].shape[0] == 12 and torch.equal(a[r], b[r]), r
        # Before the failure every request decoded as in a run without one.
        assert torch.equal(a[r][:step], plain[r][:step]), r
    for r in set(range(3)) - set(failed):
        assert torch.equal(a[r], plain[r]), r
    assert not faulty.ended  # each restarted, none left
    s = finish_all(faulty)
    assert (s["pins"], s["handles"]) == (0, 0)


def test_restart_takes_only_ended_requests_and_keeps_the_latest():
    m = TinySparseModel(ModelConfig(seed=3))
    rt = DecodeRuntime(m, page_size=8, device_slots=400, host_pages=200, indexer_pages=80,
                       keep_records=1)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for rid in range(2):
        rt.add_request(rid, torch.randint(0, 512, (30,), generator=g), 4)
    rt.step()
    with pytest.raises(st.ConfigError) as e:
        rt.restart(0)  # running
    assert e.value.field == "rid"
    rt.abort(0)
    rt.abort(1)
    assert list(rt.ended) == [1]  # keep_records=1: the latest only
    with pytest.raises(st.ConfigError) as e:
        rt.restart(0)
    assert e.value.field == "rid" and "[1]" in e.value.allowed
    rt.restart(1)
    assert len(rt.requests[1].outputs) == 1 and rt.requests[1].carried == 1
    assert rt.requests[1].prompt.numel() == 31  # the fed token is in the prompt now
    # Fails again at its next step (emulated: ended, that step's output dropped): the restart
    # counts what it carried, so the token fed there is fed again, not put in the prompt.
    rt.step()
    rt.abort(1)
    del rt.ended[1].outputs[-1]
    rt.restart(1)
    r = rt.requests[1]
    assert (len(r.outputs), r.carried, r.prompt.numel(), r.fed) == (1, 1, 31, [])
    # A restart that raises anything else (here its prefill) leaves it restartable as it was.
    rt.abort(1)
    prefill, calls = rt._prefill, []

    def broken(r, restoring):
        calls.append(r.rid)
        raise RuntimeError("prefill broke")

    rt._prefill = broken
    with pytest.raises(RuntimeError):
        rt.restart(1)
    rt._prefill = prefill
    assert calls == [1] and 1 not in rt.requests and len(rt.ended[1].outputs) == 1
    assert rt.scheduler.stats()["pins"] == 0
    rt.restart(1)
    while not rt.requests[1].done:
        rt.step()
    assert len(rt.requests[1].outputs) == 4
    rt.finish_request(1)
    assert rt.scheduler.stats()["pins"] == 0


@pytest.mark.parametrize("io", ENGINES)
def test_a_failed_backup_is_retried_and_costs_nothing_else(io):
    needs_engine(io)
    faulty, a = run(40, faults={0: ("backup", 1, None)}, io=io)
    _, b = run(400, io=io)
    assert faulty.scheduler.totals()["failed_backups"] == 1
    assert all(torch.equal(a[r], b[r]) for r in b)
    s = finish_all(faulty)
    assert s["host_writing"] == 0


@pytest.mark.parametrize("fault", [(3, "load", 1, None), (4, "load", 2, 1), (0, "backup", 1, None)])
def test_a_copy_worker_that_panics_fails_the_copy_as_a_failure_would(fault):
    # A bug in the copy path (the cpu engine's worker panics on the copy): the engine catches
    # it and fails what the copy had not written, and the runtime treats it as a failed copy:
    # one panic is retried, a load and its retry panicking fail the requests that needed
    # them, with the panic's message; every other output equals the all-resident run's (with
    # the failed requests ended at the same step), and nothing stays pinned or quarantined.
    step, kind, count, layer = fault
    rt, a = run(60, False, faults={step: (kind, count, layer, None, True)})
    stats = rt.scheduler.stats()
    assert stats["faults_armed_loads"] + stats["faults_armed_backups"] == 0  # all taken
    assert stats["copy_panics_injected"] == count
    tot = rt.scheduler.totals()
    assert tot["failed_loads" if kind == "load" else "failed_backups"] >= count
    failed = sorted({rid for _, rid, _ in rt.failures})
    assert all("copy worker panicked" in why for *_, why in rt.failures)
    assert bool(failed) == (count == 2), rt.failures  # a retry that works fails nobody
    aborts = {rt.failures[0][0]: failed} if failed else None
    _, b = run(400, False, aborts=aborts)
    assert set(a) == set(b) - set(failed) and all(torch.equal(a[r], b[r]) for r in a)
    finish_all(rt)


def test_an_internal_error_is_typed_and_the_scheduler_refuses_every_later_call():
    # A bug inside the core (injected: the next plan panics after pinning and submitting its
    # loads) reaches Python as InternalError, a SparsetierError, never as pyo3's
    # PanicException (a BaseException); the scheduler and its directory, whose state may be
    # half-changed, refuse every later call, and dropping them neither hangs nor crashes.
    rt = DecodeRuntime(TinySparseModel(ModelConfig(seed=3)), page_size=8, device_slots=40,
                       host_pages=200, indexer_pages=80)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    for rid in range(3):
        rt.add_request(rid, torch.randint(0, 512, (40 + 9 * rid,), generator=g), 8)
    rt.step()
    directory = testing.directory_of(rt.scheduler)
    rt.inject_faults("internal")
    with pytest.raises(st.InternalError) as e:
        rt.step()
    assert isinstance(e.value, st.SparsetierError)
    assert e.value.detail == "injected internal fault in plan"
    assert "scheduler.rs" in e.value.site
    calls = (rt.scheduler.stats, rt.scheduler.end_step, rt.scheduler.validate, rt.step,
             lambda: rt.scheduler.residency)  # fmt: skip
    for call in calls:
        with pytest.raises(st.InternalError) as later:
            call()
        assert "unusable after an earlier internal error" in later.value.detail
        assert "injected internal fault in plan" in later.value.detail
    with pytest.raises(st.InternalError):
        directory.stats()
    # Constants are still read (they cannot be broken).
    assert rt.scheduler.layers == rt.model.c.layers
    # Another scheduler is untouched.
    other, _ = run(40, False, steps=2)
    finish_all(other)
    rt = directory = calls = None
    gc.collect()


def test_injected_panics_are_checked():
    rt, _ = run(400, False, steps=1)
    for kwargs in (
        {"kind": "load", "delay": 0.01, "panic": True},
        {"kind": "restore", "panic": True},
        {"kind": "internal", "count": 2},
        {"kind": "internal", "panic": True},
    ):
        with pytest.raises(st.ConfigError) as e:
            rt.inject_faults(**kwargs)
        assert e.value.field in ("panic", "count/layer/delay/panic"), kwargs
    with pytest.raises(st.ConfigError) as e:
        rt.inject_faults("bug")
    assert "internal" in e.value.allowed
    assert rt.scheduler.stats()["faults_armed_loads"] == 0
    finish_all(rt)


def test_budget_too_small_is_a_config_error():
    with pytest.raises(st.ConfigError) as e:
        run(5)
    assert e.value.field == "device_slots"


def test_bad_selection_mode_is_a_config_error():
    with pytest.raises(st.ConfigError) as e:
        DecodeRuntime(TinySparseModel(), device_slots=8, host_pages=8, indexer_pages=8,
                      selection="dense")  # fmt: skip
    assert e.value.field == "selection"


@pytest.mark.parametrize("load_ms", [200.0, 1.0])
def test_exposed_wait_is_what_the_overlap_window_did_not_hide(load_ms):
    # The seed's example: a load submitted before attention needs it, 20 ms of other work in
    # between. What the scheduler reports as exposed is the part of `ready` spent waiting, so
    # it is never more than `ready` took; a load still running when `ready` was called is
    # exposed, one that was done is not. Bounds come from this test's own clock around the
    # calls, never from how fast the machine is, so a loaded machine cannot make it fail.
    s = small_scheduler(4, 4, 16, 1, {0: 12})  # 3 full pages
    testing.evict_device(s, 3)  # pages 0..2 on host only
    testing.inject_faults(s, "load", 1, delay=load_ms / 1e3)
    s.append([0])
    t_plan = time.perf_counter()
    plan, _ = s.plan(0, [0], np.array([[0, 3]], dtype=np.int64), 4)
    time.sleep(0.020)  # attention of earlier work overlapping the load
    t_call = time.perf_counter()
    s.ready(plan)
    t_ret = time.perf_counter()
    exposed = s.finish(plan)["exposed_wait_ns"] / 1e9
    assert 0.0 <= exposed <= t_ret - t_call
    if t_call - t_plan < load_ms / 1e3 / 2:
        # Called well before the load could be done (it cannot end before its delay): most
        # of what `ready` waited was that load.
        assert exposed > 0.0
    rec = s.end_step()
    assert rec["exposed_wait_ns"] / 1e9 == pytest.approx(exposed)
    assert rec["transfer_ns"] >= rec["exposed_wait_ns"]


@pytest.mark.parametrize(
    ("layout", "kv_format", "io"),
    [("layer_first", "bf16", "cpu"), ("layer_page_first", "bf16", "cpu"),
     ("layer_page_first", "fp8", "cpu"), ("layer_first", "bf16", "kernel"),
     ("layer_page_first", "fp8", "kernel")],
)  # fmt: skip
def test_a_prefix_hit_restores_indexer_k_and_loads_only_selected_blocks(layout, kv_format, io):
    needs_engine(io)
    rt, _ = run(40, share=True, layout=layout, steps=4, kv_format=kv_format, io=io)
    # The three requests found the prompt's 4 pages, stored once by request 9.
    px = rt.prefix_stats()
    assert px["hits"] == 3 and px["device_hit_tokens"] + px["host_hit_tokens"] == 3 * 32
    for rid in list(rt.requests):
        rt.finish_request(rid)
    rt.drain()
    # Under pressure the prompt leaves the device, Indexer-K and KV; a new request over it
    # restores Indexer-K (every page, every layer) and loads only the KV blocks it selects.
    rt.scheduler.evict_prefix(1000, 0)
    testing.evict_device(rt.scheduler, 1000)
    prompt = torch.cat([SYSTEM, torch.randint(0, 512, (20,), generator=torch.Generator())])
    adm = rt.add_request(7, prompt, 2)
    assert adm == {
        "matched_pages": 4,
        "device_pages": 0,
        "restored_pages": 4,
        "full_restore_objects": 0,
    }
    after = rt.prefix_stats()
    # tokens x row x layers: bf16 16 dims; fp8 16 values and a scale, values-then-scales
    ik_page = 8 * (16 * 2 if kv_format == "bf16" else 16 + 4) * 2
    assert after["indexer_bytes_restored"] - px["indexer_bytes_restored"] == 4 * ik_page
    # tokens x row (2 heads x 16 dims) x K/V x layers; fp8 rows carry a scale per head
    kv_page = 8 * (2 * 16 * 2 if kv_format == "bf16" else 2 * 16 + 2 * 4) * 2 * 2
    assert after["full_restore_bytes"] - px["full_restore_bytes"] == 4 * (kv_page + ik_page)
    assert after["prefix_kv_bytes_loaded"] > px["prefix_kv_bytes_loaded"]
    rt.step()
    rt.scheduler.validate()
    # The same request in a fresh runtime, prefilled from scratch, decodes the same tokens.
    device = "cpu" if io == "cpu" else "cuda"
    fresh = DecodeRuntime(
        TinySparseModel(ModelConfig(seed=3)).to(device), page_size=8, device_slots=400,
        host_pages=200, indexer_pages=80, topk=4, layout=layout, kv_format=kv_format,
        io_backend=io, device=device,
    )  # fmt: skip
    fresh.add_request(7, prompt, 2)
    fresh.step()
    assert fresh.requests[7].fed == rt.requests[7].fed
    torch.testing.assert_close(fresh.requests[7].outputs[0], rt.requests[7].outputs[0])


@pytest.mark.parametrize("io", ENGINES)
def test_a_failed_indexer_restore_fails_that_request_only(io):
    needs_engine(io)
    rt, _ = run(40, share=True, steps=2, io=io)
    for rid in list(rt.requests):
        rt.finish_request(rid)
    rt.drain()
    rt.scheduler.evict_prefix(1000, 0)  # the prompt's Indexer-K is on host only
    rt.add_request(4, torch.arange(200, 260), 4)  # another request, running throughout
    prompt = torch.cat([SYSTEM, torch.arange(100, 140)])
    rt.inject_faults("restore")
    assert rt.scheduler.stats()["faults_armed_restores"] == 1
    with pytest.raises(st.RequestFailedError) as e:
        rt.add_request(6, prompt, 4)
    assert rt.scheduler.stats()["faults_armed_restores"] == 0  # taken by that restore
    assert e.value.rid == 6 and "restore" in e.value.reason
    assert 6 not in rt.requests and rt.prefix_stats()["restores_failed"] == 1
    rt.scheduler.validate()
    rt.step()  # the request still running goes on
    # The prefix is host-only again; the next request over it is served.
    assert rt.add_request(8, prompt, 2)["restored_pages"] == 4
    rt.step()
    rt.scheduler.validate()


def test_a_finished_turn_is_hit_by_the_next_turn():
    rt, _ = run(40, steps=3)
    r = rt.finish_request(1)
    turn2 = torch.cat([torch.from_numpy(r.tokens()), torch.arange(5, 25)])
    adm = rt.add_request(11, turn2, 2)
    assert adm["matched_pages"] == r.pos // 8  # every whole page of turn 1, answer included
    rt.step()
    rt.scheduler.validate()


def test_abort_between_steps_releases_everything_and_spares_sharers():
    rt, _ = run(40, share=True)
    rt.abort(0)
    with pytest.raises(st.ConfigError):
        rt.abort(0)
    for _ in range(3):
        rt.step()  # the others go on, reading the shared prompt
    for rid in list(rt.requests):
        rt.finish_request(rid)
    rt.drain()
    s = rt.directory.stats()
    assert (s["objects"], s["pins"], s["handles"]) == (tree_pages(rt) * 2, 0, 0)
    assert rt.aborted == 1
    rt.scheduler.validate()


def test_step_records_are_a_bounded_window():
    m = TinySparseModel(ModelConfig(seed=3))
    rt = DecodeRuntime(m, page_size=8, device_slots=200, host_pages=100, indexer_pages=40,
                       topk=4, keep_records=2)  # fmt: skip
    rt.add_request(0, torch.arange(1, 30), 5)
    for _ in range(4):
        rt.step()
    assert rt.steps == 4 and [r.step for r in rt.records] == [2, 3]
    assert len(rt.prefill_records) == 1
    assert rt.scheduler.totals()["requests"] == 4  # the counts stay cumulative in Rust
    with pytest.raises(st.ConfigError) as e:
        DecodeRuntime(m, device_slots=8, host_pages=8, indexer_pages=8, keep_records=0)
    assert e.value.field == "keep_records"


def test_metrics_in_prometheus_text_format():
    rt, _ = run(40, share=True, steps=3)
    text = rt.metrics_text()
    lines = {ln.split(" ")[0]: ln.split(" ")[-1] for ln in text.splitlines() if ln[:1] != "#"}
    tot = rt.scheduler.totals()
    assert float(lines["sparsetier_loaded_total"]) == tot["loaded"]
    assert float(lines["sparsetier_decode_steps_total"]) == rt.steps  # request 9's included
    assert float(lines["sparsetier_prefix_hits_total"]) == 3
    assert float(lines["sparsetier_decode_step_seconds_count"]) == rt.steps
    assert float(lines["sparsetier_prefill_seconds_count"]) == 4
    assert 'sparsetier_decode_step_seconds_bucket{le="0.1"}' in lines
    calls = ("plan", "ready", "finish", "append", "end_step")
    parts = {p: float(lines[f'sparsetier_cpu_part_ns_total{{part="{p}"}}']) for p in calls}
    assert sum(parts.values()) == float(lines["sparsetier_cpu_ns_total"]) > 0


@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_a_delay_is_refused_on_the_cuda_engines(io):
    # A GPU copy cannot be held back from the host: the runtime says so when it is armed,
    # not at the submission it would have slowed.
    needs_engine(io)
    rt, _ = run(40, steps=1, io=io)
    with pytest.raises(st.ConfigError) as e:
        rt.inject_faults("load", 1, delay=0.01)
    assert e.value.field == "delay"
    rt.step()
    finish_all(rt)
