"""The decode runtime on a GPU: device pools in CUDA memory, pinned host pools, the `kernel`
and `direct` engines, slot tables on the device and stream waits on torch's current stream.
Tiered decoding must be bit-identical to the all-resident run on the same GPU, and nothing may
stay pinned or in flight afterwards. Skipped (saying why) without a GPU; `scripts/gpu-check.sh`
runs it on the device machine."""

import pytest
import torch

import sparsetier as st
from sparsetier.model import ModelConfig, TinySparseModel
from sparsetier.runtime import DecodeRuntime

GPU = torch.cuda.is_available() and st.cuda_status()[0]
pytestmark = pytest.mark.skipif(not GPU, reason=f"no usable CUDA GPU here: {st.cuda_status()[1]}")

SYSTEM = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(5))


def run(device_slots, io, mode="block", prefetch=True, share=False, layout="layer_first",
        steps=10, kv_format="bf16"):  # fmt: skip
    """Three requests over a shared 37-token prompt; with `share`, a first request over the
    prompt ends before them so they hit the prefix cache."""
    m = TinySparseModel(ModelConfig(seed=3)).to("cuda")
    rt = DecodeRuntime(
        m, page_size=8, device_slots=device_slots, host_pages=200, indexer_pages=80,
        topk=4 if mode == "block" else 12, prefetch=prefetch, selection=mode, layout=layout,
        io_backend=io, device="cuda", kv_format=kv_format,
    )  # fmt: skip
    g = torch.Generator().manual_seed(5)
    if share:
        rt.add_request(9, torch.cat([SYSTEM, torch.randint(0, 512, (11,), generator=g)]), 2)
        rt.step()
        rt.step()
        rt.finish_request(9)
    for rid in range(3):
        own = torch.randint(0, 512, (int(23 + 25 * rid),), generator=g)
        rt.add_request(rid, torch.cat([SYSTEM, own]), steps)
    for _ in range(steps):
        rt.step()
    torch.cuda.synchronize()
    return rt, {rid: torch.stack(r.outputs).cpu() for rid, r in rt.requests.items()}


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


@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_a_prefix_hit_restores_indexer_k_on_the_gpu(kv_format):
    rt, _ = run(40, "kernel", share=True, steps=3, kv_format=kv_format)
    for rid in list(rt.requests):
        rt.finish_request(rid)
    rt.drain()
    rt.scheduler.evict_prefix(1000, 0)
    rt.directory.evict(1000)
    prompt = torch.cat([SYSTEM, torch.randint(0, 512, (20,), generator=torch.Generator())])
    adm = rt.add_request(7, prompt, 2)
    assert adm == {"matched_pages": 4, "device_pages": 0, "restored_pages": 4}
    rt.step()
    fresh = DecodeRuntime(
        TinySparseModel(ModelConfig(seed=3)).to("cuda"), page_size=8, device_slots=400,
        host_pages=200, indexer_pages=80, topk=4, io_backend="kernel", device="cuda",
        kv_format=kv_format,
    )  # fmt: skip
    fresh.add_request(7, prompt, 2)
    fresh.step()
    assert fresh.requests[7].fed == rt.requests[7].fed
    torch.testing.assert_close(fresh.requests[7].outputs[0], rt.requests[7].outputs[0])
    finish_all(rt)
