"""The decode runtime on a GPU: device pools in CUDA memory, pinned host pools, the `kernel`
and `direct` engines, slot tables on the device and stream waits on torch's current stream.
Tiered decoding must be bit-identical to the all-resident run on the same GPU, and nothing may
stay pinned or in flight afterwards (prefix restores on the GPU: test_decode.py's restore test
with io="kernel"). Skipped (saying why) without a GPU; `scripts/gpu-check.sh`
runs it on the device machine."""

import pytest
import torch
from test_decode import finish_all
from test_decode import run as decode_run

import sparsetier as st

GPU = torch.cuda.is_available() and st.cuda_status()[0]
pytestmark = pytest.mark.skipif(not GPU, reason=f"no usable CUDA GPU here: {st.cuda_status()[1]}")


def run(device_slots, io, mode="block", prefetch=True, share=False, layout="layer_first",
        steps=10, kv_format="bf16", token_map="core"):  # fmt: skip
    """test_decode's three requests over a shared prompt, on the GPU; outputs on the CPU."""
    rt, outs = decode_run(device_slots, prefetch, share, mode, steps, layout=layout,
                          kv_format=kv_format, io=io, token_map=token_map)  # fmt: skip
    torch.cuda.synchronize()
    return rt, {rid: o.cpu() for rid, o in outs.items()}


CASES = [
    ("kernel", "block", True, False, "layer_first", "bf16"),
    ("kernel", "block", False, False, "layer_first", "bf16"),
    ("kernel", "token", True, False, "layer_first", "bf16"),
    ("kernel", "token", False, False, "layer_page_first", "bf16"),
    ("kernel", "block", True, True, "layer_page_first", "bf16"),
    ("direct", "block", True, False, "layer_first", "bf16"),
    ("direct", "token", True, True, "layer_first", "bf16"),
    # DeepSeek-V3.2's formats: FP8 rows with scales, Indexer-K in values-then-scales pages.
    ("kernel", "block", True, True, "layer_page_first", "fp8"),
    ("kernel", "token", False, True, "layer_first", "fp8"),
    ("direct", "block", True, True, "layer_first", "fp8"),
]


@pytest.mark.parametrize(
    ("io", "prefetch", "share"), [("kernel", True, True), ("direct", False, False)]
)
def test_token_mode_mapped_on_the_gpu_is_bit_identical_to_resident(io, prefetch, share):
    # Tokens mapped to pages on the GPU (`map_tokens`), the core planning page rows.
    tiered, a = run(40, io, "token", prefetch, share, token_map="device")
    _, b = run(400, io, "token", prefetch, share, token_map="device")
    assert sum(r.loaded for r in tiered.records) > 0
    assert all(torch.equal(a[r], b[r]) for r in b)
    assert not tiered.failures
    finish_all(tiered)


@pytest.mark.parametrize(("io", "mode", "prefetch", "share", "layout", "kv_format"), CASES)
def test_tiered_decode_on_the_gpu_is_bit_identical_to_resident(io, mode, prefetch, share,
                                                               layout, kv_format):  # fmt: skip
    tiered, a = run(40, io, mode, prefetch, share, layout, kv_format=kv_format)
    _, b = run(400, io, mode, prefetch, share, layout, kv_format=kv_format)
    assert tiered.device_kv.is_cuda and tiered.host_kv.is_pinned()
    assert sum(r.loaded for r in tiered.records) > 0, "the budget must force loads"
    assert a.keys() == b.keys()
    bad = [r for r in a if not torch.equal(a[r], b[r])]
    assert not bad, f"requests {bad} decoded other tokens than the all-resident run"
    if share:
        assert tiered.prefix_stats()["hits"] == 3
    assert not tiered.failures
    finish_all(tiered)


def _resolved_runtime(mode, device_slots, resolve):
    from sparsetier.tools.model import ModelConfig, TinySparseModel
    from sparsetier.tools.runtime import DecodeRuntime

    m = TinySparseModel(ModelConfig(seed=3)).to("cuda")
    return DecodeRuntime(
        m, page_size=8, device_slots=device_slots, host_pages=200, indexer_pages=80,
        topk=4 if mode == "block" else 12, selection=mode, io_backend="kernel",
        device="cuda", resolve=resolve,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["block", "token"])
def test_device_resolver_kernel_on_the_gpu_matches_all_resident(mode):
    # resolve="device" on CUDA pools: each layer's top-k is mapped by the kernel on torch's
    # stream, the misses copied from pinned host memory by the kernel itself.
    tiered = _resolved_runtime(mode, 60, "device")
    ref = _resolved_runtime(mode, 4000, "host")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (40 + 25 * r,), generator=g) for r in range(3)]
    for rt in (tiered, ref):
        for rid, p in enumerate(prompts):
            rt.add_request(rid, p, 10)
        for _ in range(10):
            rt.step()
    d = tiered.scheduler.device_stats()
    assert d["steps"] >= 5, d
    tiered.scheduler.validate()  # reads the device's mirror back and compares
    for rid in range(3):
        a, b = tiered.finish_request(rid), ref.finish_request(rid)
        assert all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a.outputs, b.outputs, strict=True))
    tiered.scheduler.validate()


def test_device_resolved_layers_never_sync_with_the_host():
    import numpy as np

    rt = _resolved_runtime("block", 400, "device")
    for rid in range(3):
        rt.add_request(rid, torch.arange(40 + 8 * rid) % 512, 6)
    rt.step()
    rids = np.arange(3, dtype=np.int64)
    rt.scheduler.append(rids)
    assert rt.scheduler.begin_device_step(rids, 4)
    sel = torch.tensor([[0, 1, 2, -1]] * 3, dtype=torch.int32, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        tables = [rt.resolver.resolve(li, rids, sel) for li in range(len(rt.model.layers))]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    rt.scheduler.end_step()
    for t in tables:
        assert t.is_cuda and t.dtype == torch.int32
        assert (t[:, :3] >= 0).all() and (t[:, 3] == -1).all()
    rt.scheduler.validate()


def test_device_resolved_decode_steps_keep_their_layers_free_of_host_syncs():
    # Whole runtime steps: every op between the first layer's projections and the logits
    # (KV and Indexer-K writes, the indexer's top-k, the resolver, attention) runs under
    # torch's sync debug mode "error", so any of torch's host syncs in a layer fails (the
    # resolver's own driver calls queue work and read nothing back).
    rt = _resolved_runtime("block", 60, "device")
    for rid in range(3):
        rt.add_request(rid, torch.arange(40 + 8 * rid) % 512, 8)
    layer0, logits = rt.model.layers[0], rt.model.logits
    qkv = layer0.qkv

    def strict_qkv(*a, **k):
        torch.cuda.set_sync_debug_mode("error")
        return qkv(*a, **k)

    def lenient_logits(x):
        torch.cuda.set_sync_debug_mode(0)
        return logits(x)

    layer0.qkv, rt.model.logits = strict_qkv, lenient_logits
    try:
        for _ in range(6):
            rt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        del layer0.qkv, rt.model.logits  # (the classes' methods again)
    d = rt.scheduler.device_stats()
    assert d["steps"] == 6 and d["fallbacks"] == 0, d  # every step's layers on the device
    assert not rt.failures
    finish_all(rt)
