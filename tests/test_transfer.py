"""Page transfer through the Python binding with the cpu engine: round trips over torch
tensors in both layouts and directions, page and token granularity, per-layer events, fault
injection, keep-alive of tensors, and bad input."""

import gc
import weakref

import numpy as np
import pytest
import torch

import sparsetier as st
from sparsetier import lowlevel, testing

POISON = -7.0


def pools(component="KV", layers=3, pages=10, page_size=4):
    heads, dim = (1, 16) if component == "INDEXER" else (2, 8)
    return st.PoolSpec(component, layers, heads, dim, "bf16", page_size, pages)


def filled(spec, layout, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(spec.shape(layout), generator=g).to(torch.bfloat16)


def poisoned(spec, layout):
    return torch.full(spec.shape(layout), POISON, dtype=torch.bfloat16)


def view(t, layout):
    """As [plane, layer, page, token, head, dim] whatever the layout."""
    return t if layout == "layer_first" else t.transpose(1, 2)


@pytest.mark.parametrize("layout", ["layer_first", "layer_page_first"])
@pytest.mark.parametrize("component", ["KV", "INDEXER", "SWA", "DRAFT"])
@pytest.mark.parametrize("direction", ["load", "backup"])
@pytest.mark.parametrize("granularity", ["page", "token"])
@pytest.mark.parametrize("layer", [None, 1])
def test_cpu_round_trip(layout, component, direction, granularity, layer):
    host, dev = pools(component, pages=12), pools(component, pages=9)
    if direction == "load":
        src_spec, dst_spec, src_layout, dst_layout = host, dev, layout, "layer_first"
    else:
        src_spec, dst_spec, src_layout, dst_layout = dev, host, "layer_first", layout
    src = filled(src_spec, src_layout, seed=hash((layout, component, direction)) % 1000)
    dst = poisoned(dst_spec, dst_layout)
    ps = src_spec.page_size
    per = (lambda n: n) if granularity == "page" else (lambda n: n * ps)
    rng = np.random.default_rng(3)
    dst_units = rng.choice(per(dst_spec.pages), size=5, replace=False)
    src_units = np.concatenate([[0, 1], rng.integers(0, per(src_spec.pages), size=3)])
    t = lowlevel.PreparedPageTransfer(
        st.PageTransferBinding(src, src_spec, src_layout),
        st.PageTransferBinding(dst, dst_spec, dst_layout),
        src_units,
        dst_units,
        direction=direction,
        granularity=granularity,
    )
    engine = st.TransferEngine("cpu", threads=2)
    h = engine.submit(lowlevel.PageTransferGroup([t]), layer=layer)
    h.wait(timeout=10)
    assert h.finished
    want = view(poisoned(dst_spec, dst_layout), dst_layout).clone()
    s, d = view(src, src_layout), view(dst, dst_layout)
    layers = range(src_spec.layers) if layer is None else [layer]
    for a, b in zip(src_units, dst_units, strict=True):
        for ly in layers:
            if granularity == "page":
                want[:, ly, b] = s[:, ly, a]
            else:
                want[:, ly, b // ps, b % ps] = s[:, ly, a // ps, a % ps]
    assert torch.equal(d, want)  # every byte: copied rows exact, the rest still poisoned


def group_kv_indexer(layers=4):
    members, dsts = [], []
    for comp in ("KV", "INDEXER"):
        spec = pools(comp, layers=layers, pages=8)
        src, dst = filled(spec, "layer_page_first", 1), poisoned(spec, "layer_first")
        members.append(
            lowlevel.PreparedPageTransfer(
                st.PageTransferBinding(src, spec, "layer_page_first"),
                st.PageTransferBinding(dst, spec),
                [1, 2, 5],
                [0, 3, 7],
            )
        )
        dsts.append((src, dst))
    return lowlevel.PageTransferGroup(members), dsts


def test_group_events_per_layer_and_delay():
    g, pairs = group_kv_indexer()
    e = st.TransferEngine("cpu", threads=1)
    testing.inject_copy_fault(e, 0, layer=0, delay=0.03)
    h = e.submit(g)
    assert h.status(3) == "pending"  # recording is not waiting
    h.wait(layer=2)
    h.wait()
    times = h.layer_times()
    assert times == sorted(times) and times[0] >= 0.03
    for src, dst in pairs:
        s, d = view(src, "layer_page_first"), dst
        assert torch.equal(d[:, :, [0, 3, 7]], s[:, :, [1, 2, 5]])


def test_injected_failure_is_reported_and_later_layers_stay_unwritten():
    g, pairs = group_kv_indexer()
    e = st.TransferEngine("cpu")
    testing.inject_copy_fault(e, 0, layer=2, fail="injected")
    h = e.submit(g)
    with pytest.raises(st.CopyFailedError) as err:
        h.wait()
    assert (err.value.layer, err.value.reason, err.value.engine) == (2, "injected", "cpu")
    h.wait(layer=1)
    assert h.status(3) == "failed: injected"
    for _, dst in pairs:
        assert (dst[:, 2:] == POISON).all()
        assert not (dst[:, 1, [0, 3, 7]] == POISON).all()


def test_a_worker_that_panics_fails_the_copy_and_serves_on():
    # A bug in the copy path: the single worker panics at layer 2. The engine fails layers 2
    # and 3 with the panic's message (1 was written) and copies the next submission whole.
    g, pairs = group_kv_indexer()
    e = st.TransferEngine("cpu", threads=1)
    testing.inject_copy_fault(e, 0, layer=2, panic="copy bug")
    h = e.submit(g)
    with pytest.raises(st.CopyFailedError) as err:
        h.wait(timeout=10)
    assert err.value.layer == 2 and "copy worker panicked: copy bug" in err.value.reason
    h.wait(layer=1)
    for _, dst in pairs:
        assert (dst[:, 2:] == POISON).all()
    g2, pairs2 = group_kv_indexer()
    e.submit(g2).wait(timeout=10)
    for src, dst in pairs2:
        assert torch.equal(dst[:, :, [0, 3, 7]], view(src, "layer_page_first")[:, :, [1, 2, 5]])


def test_engine_keeps_tensors_alive_until_finished():
    e = st.TransferEngine("cpu", threads=1)
    testing.inject_copy_fault(e, 0, delay=1.0)
    g, pairs = group_kv_indexer()
    # (The engine holds the tensors' storages: their memory, whatever becomes of them.)
    dst = weakref.ref(pairs[0][1].untyped_storage())
    e.submit(g)  # the handle, the group and our tensors are dropped at once
    del g, pairs
    gc.collect()
    assert e.in_flight == 1
    assert dst() is not None, "a destination was freed while a transfer still writes it"
    e.submit(group_kv_indexer()[0]).wait()  # runs after the first on the single worker
    assert e.in_flight == 0
    gc.collect()
    assert dst() is None, "finished transfers must release their tensors' memory"


def test_planning_errors():
    spec = pools(pages=8)
    a, b = filled(spec, "layer_first", 0), poisoned(spec, "layer_first")
    ba, bb = st.PageTransferBinding(a, spec), st.PageTransferBinding(b, spec)
    with pytest.raises(st.PlanError) as e:
        lowlevel.PreparedPageTransfer(ba, bb, [1, 2], [3, 3])
    assert e.value.field == "dst"
    with pytest.raises(st.OutOfRangeError):
        lowlevel.PreparedPageTransfer(ba, bb, [0], [8])
    with pytest.raises(st.PlanError):
        lowlevel.PreparedPageTransfer(ba, ba, [0], [1])  # overlapping buffers
    with pytest.raises(st.ConfigError):
        lowlevel.PreparedPageTransfer(ba, bb, [0], [1], direction="sideways")
    with pytest.raises(st.ConfigError):
        lowlevel.PreparedPageTransfer(ba, bb, [0], [1], granularity="byte")
    with pytest.raises(st.OutOfRangeError):
        lowlevel.PreparedPageTransfer(ba, bb, [-1], [1])
    other = pools("INDEXER", pages=8)
    with pytest.raises(st.PlanError):
        lowlevel.PreparedPageTransfer(
            ba, st.PageTransferBinding(poisoned(other, "layer_first"), other), [0], [1]
        )
    with pytest.raises(st.PlanError):
        lowlevel.PageTransferGroup([])
    t = lowlevel.PreparedPageTransfer(ba, bb, [0, 1, 2, 6], [3, 4, 5, 0])
    assert t.stats() == (4, 2, 4 * spec.page_bytes * 2 * 3)


@pytest.mark.parametrize(
    ("tensor", "field"),
    [
        (torch.zeros(pools().shape(), dtype=torch.float16), "tensor.dtype"),
        (torch.zeros((2, 3, 10, 4, 2, 9), dtype=torch.bfloat16), "tensor.shape"),
        (torch.zeros(pools().shape(), dtype=torch.bfloat16).transpose(4, 5), "tensor.shape"),
        (torch.zeros(pools().shape(), dtype=torch.bfloat16, device="meta"), "tensor.device"),
        ([1, 2, 3], "tensor"),
    ],
)
def test_bad_tensors(tensor, field):
    with pytest.raises(st.ConfigError) as e:
        st.PageTransferBinding(tensor, pools())
    assert e.value.field == field


def test_non_contiguous_tensor_is_refused():
    spec = pools()
    t = torch.zeros([*spec.shape()[:-1], 16], dtype=torch.bfloat16)[..., ::2]
    with pytest.raises(st.ConfigError) as e:
        st.PageTransferBinding(t, spec)
    assert e.value.field == "tensor.is_contiguous()"


@pytest.mark.parametrize(
    ("backend", "option", "value"),
    [("cpu", "sm_limit", 4), ("cpu", "lanes", 32), ("cpu", "per_segment", True),
     ("cpu", "device", 0), ("kernel", "threads", 2), ("kernel", "per_segment", True),
     ("direct", "threads", 2), ("direct", "sm_limit", 4), ("direct", "lanes", 32)],
)  # fmt: skip
def test_an_option_the_engine_would_ignore_is_refused(backend, option, value):
    # Before, the cpu engine took sm_limit, lanes and per_segment and did nothing with them.
    # (Refused before any CUDA engine is made: no GPU needed.)
    with pytest.raises(st.ConfigError) as e:
        st.TransferEngine(backend, **{option: value})
    assert e.value.field == option
    assert "only for" in str(e.value) and backend in str(e.value)


def test_engine_arguments():
    with pytest.raises(st.ConfigError):
        st.TransferEngine("nixl")
    with pytest.raises(st.ConfigError):
        st.TransferEngine("cpu", threads=0)
    e = st.TransferEngine("cpu")
    with pytest.raises(st.ConfigError):
        testing.inject_copy_fault(e, 0)
    with pytest.raises(st.ConfigError):
        testing.inject_copy_fault(e, 0, fail="x", delay=1.0)
    g, _ = group_kv_indexer()
    with pytest.raises(st.OutOfRangeError):
        e.submit(g, layer=4)
    h = e.submit(g)
    with pytest.raises(st.ConfigError):
        h.wait(layer=9)
    with pytest.raises(st.ConfigError):
        h.stream_wait(0, 0)
    h.wait()
