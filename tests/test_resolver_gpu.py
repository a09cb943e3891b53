"""The device resolver kernel's GPU check (`sparsetier.tools.resolver_gpu`, part `resolver` of
`scripts/gpu-check.sh`): here its own logic runs over the kernel's source on CPU threads (the
grant as the core makes it, the log's calls filled with NOT_YET, steps of several layers), and
its checks catch a cell that reads another object; on a GPU (skipped without one) the kernel
itself runs under the same checks."""

import pytest
import torch

import sparsetier as st
from sparsetier import testing
from sparsetier.tools import resolver_gpu as rg

HAS_GPU = torch.cuda.is_available() and st.cuda_status()[0]
SMALL = {"rows": 8, "context": 4096, "layers": 3, "steps": 6, "warmup": 1}


@pytest.mark.parametrize("tokens", [False, True])
def test_the_gpu_check_runs_on_the_kernels_source_on_cpu_threads(tokens):
    r = rg.run(rg.ResolverGpuConfig(device="cpu", tokens=tokens, **SMALL))
    s = r["summary"]
    assert s["checked"] and s["cells_per_layer"] == 8 * (32 * 64 if tokens else 32)
    # Once the grant has grown to the misses (the core's rule: twice the last step's), about a
    # tenth of each row's pages are new each step.
    later = [m for step in r["steps"][2:] for m in step["misses"]]
    assert 0 < max(later) < 8 * 32


def _wrap_launches(monkeypatch, before=None, after=None):
    """The check's kernel, with `before(t)` / `after(t)` around each of its launches."""
    real = testing.ResolveKernel

    class Wrapped:
        def __init__(self, *a, **k):
            self.k = real(*a, **k)

        def launch(self, stream, t, **kw):
            if before:
                before(t)
            self.k.launch(stream, t, **kw)
            if after:
                after(t)

    for name in (n for n in dir(real) if n.isupper()):  # the ABI's constants
        setattr(Wrapped, name, getattr(real, name))
    monkeypatch.setattr(testing, "ResolveKernel", Wrapped)


def test_the_gpu_check_catches_a_cell_that_reads_another_object(monkeypatch):
    # The real kernel, then two cells of different objects swap slots.
    def swap(t):
        table = t["table"]
        table[0], table[1] = table[1].clone(), table[0].clone()

    _wrap_launches(monkeypatch, after=swap)
    with pytest.raises(AssertionError, match="read another object"):
        rg.run(rg.ResolverGpuConfig(device="cpu", **SMALL))


def test_the_kernel_launch_refuses_a_bad_buffer_before_launching():
    with pytest.raises(st.OutOfRangeError):
        testing.ResolveKernel("cpu", threads=0)
    k = testing.ResolveKernel("cpu")
    with pytest.raises(st.ConfigError) as e:
        k.launch(0, {"sel": torch.zeros(4, dtype=torch.int64)}, k=2, layers=1, layer=0,
                 page_size=4, tokens=False, call=1)  # fmt: skip
    assert e.value.field == "sel.dtype"


def test_a_graph_is_for_a_gpu_and_a_capture_launch_for_a_graph():
    with pytest.raises(ValueError, match="graph"):
        rg.run(rg.ResolverGpuConfig(device="cpu", graph=True, **SMALL))
    with pytest.raises(st.ConfigError) as e:
        testing.ResolveKernel("cpu").launch(0, {}, k=1, layers=1, layer=0, page_size=4,
                                            tokens=False, call=1, capture=True)  # fmt: skip
    assert e.value.field == "capture"


@pytest.mark.skipif(not HAS_GPU, reason=f"no usable CUDA GPU here: {st.cuda_status()[1]}")
@pytest.mark.parametrize(("tokens", "graph"), [(False, False), (True, False), (False, True)])
def test_the_kernel_on_the_gpu_passes_the_same_checks(tokens, graph):
    # With `graph`, the layers' launches are captured in a CUDA graph and replayed each step.
    r = rg.run(rg.ResolverGpuConfig(device="cuda", tokens=tokens, graph=graph, **SMALL))
    assert r["summary"]["checked"]


def test_the_kernel_launch_refuses_cursors_past_what_they_index(monkeypatch):
    # A step's cursors (st) as the kernel would find them: a deferral count above the grant
    # entries gone through would write past the deferred list, so the launch refuses it.
    def corrupt(t):
        t["st"][testing.ResolveKernel.ST_DEF_LEN] = 1 << 20

    _wrap_launches(monkeypatch, before=corrupt)
    with pytest.raises(st.OutOfRangeError) as e:
        rg.run(rg.ResolverGpuConfig(device="cpu", **SMALL))
    assert e.value.field == "st[ST_DEF_LEN]"


def test_the_kernel_launch_refuses_a_table_over_the_selection(monkeypatch):
    # The layer's first launch writes the table before the second reads the selection: a
    # table over the selection's memory (resolving in place) would change the selection read.
    def in_place(t):
        t["table"] = t["sel"]

    _wrap_launches(monkeypatch, before=in_place)
    with pytest.raises(st.ConfigError) as e:
        rg.run(rg.ResolverGpuConfig(device="cpu", **SMALL))
    assert e.value.field == "table"
