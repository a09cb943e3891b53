"""CUDA: the kernels compile with NVRTC in CI (this never skips), and the CUDA engines run the
round-trip matrix when a GPU is present (skipped otherwise, saying why)."""

import json
import subprocess
import sys

import pytest
import torch

import sparsetier as st
from sparsetier import lowlevel, testing

HAS_GPU = torch.cuda.is_available() and st.cuda_status()[0]
needs_gpu = pytest.mark.skipif(
    not HAS_GPU, reason=f"no usable CUDA GPU here: {st.cuda_status()[1]}"
)


COMPILE = """
import json
from sparsetier.cuda_libs import nvrtc_version, preload_nvrtc
path = preload_nvrtc()
if path is None:
    raise SystemExit("NVRTC not found: `make test` installs nvidia-cuda-nvrtc 13.0 into the "
                     "venv and sets SPARSETIER_NVRTC_DIR; or pip install "
                     "'nvidia-cuda-nvrtc>=13.0,<13.1'")
from sparsetier import lowlevel
print(json.dumps({"path": str(path), "version": nvrtc_version(),
                  "ptx": lowlevel.compile_cuda_kernels("sm_90")}))
"""


def test_kernels_compile_with_nvrtc_13_0_for_sm_90():
    # A fresh interpreter: torch, once imported, has already loaded its own NVRTC, and a
    # process holds one libnvrtc.so.13.
    r = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert tuple(out["version"]) == (13, 0), (
        f"{out['path']} is NVRTC {out['version']}; the GPU machine's driver is CUDA 13.0"
    )
    ptx = out["ptx"]
    assert ".target sm_90" in ptx
    assert ".entry sparsetier_copy_ops(" in ptx
    # The device resolver's kernel compiles too: a layer is two launches, the marks of every
    # object it reads (a thread a cell), then a warp a cell, the misses claimed with a CAS and
    # copied from host over unified addressing.
    assert ".entry sparsetier_mark(" in ptx
    assert ".entry sparsetier_resolve(" in ptx
    # Its step boundaries: the core's mirror changes applied, the read marks as a bitmap.
    assert ".entry sparsetier_mirror_apply(" in ptx
    assert ".entry sparsetier_marks_read(" in ptx
    assert "atom.global.cas.b32" in ptx, "the claim of a missing entry is an atomic CAS"
    resolve = ptx[ptx.index(".entry sparsetier_resolve(") :]
    # It counts read amplification's token terms (64-bit) as the reference does.
    assert "atom.global.add.u64" in resolve, "the needed-token counts are 64-bit atomics"
    assert "ld.v4.u32" in ptx or "ld.global.v4.u32" in ptx, "16-byte vector loads expected"
    # Rows aligned to 8 or 4 bytes only (132-byte Indexer-K rows) move in words, not bytes.
    assert "ld.global.u64" in ptx or "ld.u64" in ptx, "8-byte word loads expected"
    assert "ld.global.u32" in ptx or "ld.u32" in ptx, "4-byte word loads expected"


CUBIN = """
import json, sys
from sparsetier.cuda_libs import preload_nvrtc
if preload_nvrtc() is None:
    raise SystemExit("NVRTC not found")
from sparsetier import lowlevel
d = sys.argv[1]
out = []
for arch in ("sm_90", "sm_80", "sm_90"):
    c = lowlevel.kernel_cubin(arch, d)
    out.append({"arch": c["arch"], "elf": c["image"][:4] == b"\\x7fELF", "size": len(c["image"]),
                "path": str(c["path"]), "from_cache": c["from_cache"]})
open(out[0]["path"], "wb").write(b"not a cubin")  # a damaged cache file is compiled again
c = lowlevel.kernel_cubin("sm_90", d)
out.append({"from_cache": c["from_cache"], "elf": c["image"][:4] == b"\\x7fELF"})
r = lowlevel.kernel_cubin("sm_90", d, kernel="resolve")  # the device resolver: its own file
out.append({"elf": r["image"][:4] == b"\\x7fELF", "path": str(r["path"])})
print(json.dumps(out))
"""


def test_kernel_compiles_to_a_cubin_per_arch_cached_on_disk(tmp_path):
    # The engine loads a cubin for the device's own compute capability (PTX fails to load
    # under an NVRTC newer than the driver); compiled once per (source, NVRTC, arch).
    r = subprocess.run(
        [sys.executable, "-c", CUBIN, str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, r.stderr
    first, other, again, damaged, resolve = json.loads(r.stdout)
    assert first["elf"] and other["elf"] and first["size"] > 0
    assert (first["from_cache"], other["from_cache"], again["from_cache"]) == (False, False, True)
    assert first["path"] == again["path"] != other["path"]
    assert "sm_90" in first["path"] and "nvrtc13.0" in first["path"]
    assert damaged == {"from_cache": False, "elf": True}
    assert resolve["elf"] and "resolve-sm_90" in resolve["path"]


def test_bad_arch_is_refused():
    with pytest.raises(st.ConfigError):
        lowlevel.compile_cuda_kernels("sm_21")
    with pytest.raises(st.ConfigError) as e:
        lowlevel.kernel_cubin("compute_90")
    assert e.value.field == "arch"


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present: the missing-driver path cannot happen")
@pytest.mark.parametrize("backend", ["kernel", "direct"])
def test_cuda_engine_without_driver_raises_typed_error(backend):
    with pytest.raises(st.CudaUnavailableError) as e:
        st.TransferEngine(backend)
    assert "libcuda" in e.value.what and e.value.fix


def gpu_round_trip(
    backend, layout, component, granularity, per_segment=False, dim=64, dtype="bf16", lanes=None
):
    host_spec = st.PoolSpec(component, 3, 2, dim, dtype, 16, 24)
    dev_spec = host_spec.with_pages(17)
    tdt = torch.bfloat16 if dtype == "bf16" else torch.uint8  # fp8 rows moved as raw bytes
    shape = host_spec.shape(layout)
    host = torch.randn(shape).to(tdt) if dtype == "bf16" else torch.randint(0, 255, shape).to(tdt)
    host = host.pin_memory()
    dev = torch.full(dev_spec.shape(), 7, dtype=tdt, device="cuda")
    extra = {"lanes": lanes} if lanes else {}
    engine = st.TransferEngine(backend, per_segment=per_segment, **extra)
    ps = host_spec.page_size
    if granularity == "page":
        src_u, dst_u = [3, 4, 5, 11, 20], [0, 1, 2, 9, 16]
    else:
        src_u, dst_u = [3 * ps, 3 * ps + 1, 20 * ps + 5], [7, 8, 16 * ps + 2]
    load = lowlevel.PreparedPageTransfer(
        st.PageTransferBinding(host, host_spec, layout),
        st.PageTransferBinding(dev, dev_spec),
        src_u,
        dst_u,
        granularity=granularity,
    )
    h = engine.submit(lowlevel.PageTransferGroup([load]))
    stream = torch.cuda.current_stream()
    for layer in range(3):
        h.stream_wait(layer, stream.cuda_stream)
    got = dev.cpu()
    h.wait(timeout=30)
    s = host if layout == "layer_first" else host.transpose(1, 2)
    for a, b in zip(src_u, dst_u, strict=True):
        if granularity == "page":
            assert torch.equal(got[:, :, b], s[:, :, a])
        else:
            assert torch.equal(got[:, :, b // ps, b % ps], s[:, :, a // ps, a % ps])
    back = torch.full(host_spec.shape(layout), 7, dtype=tdt).pin_memory()
    backup = lowlevel.PreparedPageTransfer(
        st.PageTransferBinding(dev, dev_spec),
        st.PageTransferBinding(back, host_spec, layout),
        dst_u,
        src_u,
        direction="backup",
        granularity=granularity,
    )
    engine.submit(lowlevel.PageTransferGroup([backup])).wait(timeout=30)
    b = back if layout == "layer_first" else back.transpose(1, 2)
    for a, d in zip(src_u, dst_u, strict=True):
        if granularity == "page":
            assert torch.equal(b[:, :, a], s[:, :, a]), d
        else:  # token-granularity backups land row by row
            assert torch.equal(b[:, :, a // ps, a % ps], s[:, :, a // ps, a % ps]), d


@needs_gpu
@pytest.mark.parametrize("backend", ["kernel", "direct"])
@pytest.mark.parametrize("layout", ["layer_first", "layer_page_first"])
@pytest.mark.parametrize("component", ["KV", "INDEXER"])
@pytest.mark.parametrize("granularity", ["page", "token"])
def test_gpu_round_trip(backend, layout, component, granularity):
    gpu_round_trip(backend, layout, component, granularity)


@needs_gpu
@pytest.mark.parametrize("backend", ["kernel", "direct"])
@pytest.mark.parametrize("granularity", ["page", "token"])
def test_gpu_round_trip_of_132_byte_rows(backend, granularity):
    # An FP8 Indexer-K row with its scale: 132 bytes, not a multiple of 16.
    gpu_round_trip(backend, "layer_page_first", "INDEXER", granularity, dim=132, dtype="fp8_e4m3")


@needs_gpu
@pytest.mark.parametrize("lanes", [4, 32, 512])
@pytest.mark.parametrize("granularity", ["page", "token"])
def test_kernel_round_trip_at_any_lane_count(lanes, granularity):
    # Threads per op follow the op length by default; a forced count, from 4 threads on a
    # 64 KiB page to a whole block on a 132-byte row, must copy the same bytes.
    gpu_round_trip("kernel", "layer_first", "KV", granularity, dim=128, lanes=lanes)
    gpu_round_trip(
        "kernel", "layer_page_first", "INDEXER", granularity, dim=132, dtype="fp8_e4m3",
        lanes=lanes,
    )  # fmt: skip


@needs_gpu
@pytest.mark.parametrize("backend", ["kernel", "direct"])
def test_copies_follow_torchs_queued_writes(backend):
    # A backup submitted right after torch queued the write of its source must copy the
    # written values: the engine orders its copies after torch's current stream.
    spec = st.PoolSpec("KV", 2, 8, 128, "bf16", 64, 512)
    dev = torch.zeros(spec.shape(), dtype=torch.bfloat16, device="cuda")
    host = torch.zeros(spec.shape(), dtype=torch.bfloat16).pin_memory()
    e = st.TransferEngine(backend)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(20):  # long enough that an unordered copy would race it
            dev.mul_(0.0).add_(3.0)
        t = lowlevel.PreparedPageTransfer(
            st.PageTransferBinding(dev, spec), st.PageTransferBinding(host, spec),
            list(range(512)), list(range(512)), direction="backup",
        )  # fmt: skip
        e.submit(lowlevel.PageTransferGroup([t])).wait(timeout=60)
    assert bool((host == 3.0).all())


@needs_gpu
def test_the_raw_stream_getter_names_torchs_current_stream():
    # The engines learn torch's current stream through `torch._C._cuda_getCurrentRawStream`
    # (one C call per scheduler call) where torch has it: it must name the stream
    # `torch.cuda.current_stream()` names, on the default stream and inside a side stream.
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        pytest.skip("this torch has no raw getter: the engines use current_stream()")
    i = torch.cuda.current_device()
    assert raw(i) == torch.cuda.current_stream(i).cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert raw(i) == side.cuda_stream == torch.cuda.current_stream(i).cuda_stream
    assert raw(i) != side.cuda_stream


@needs_gpu
def test_engine_defaults_to_torchs_device_and_refuses_another():
    assert st.PageTransferBinding(
        torch.zeros(st.PoolSpec("KV", 1, 1, 8, "bf16", 4, 4).shape(), dtype=torch.bfloat16,
                    device="cuda"), st.PoolSpec("KV", 1, 1, 8, "bf16", 4, 4),
    ).device_index == torch.cuda.current_device()  # fmt: skip
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU: the other-device refusal is tested in Rust (transfer_edges)")
    spec = st.PoolSpec("KV", 1, 1, 8, "bf16", 4, 4)
    a = torch.zeros(spec.shape(), dtype=torch.bfloat16, device="cuda:1")
    host = torch.zeros(spec.shape(), dtype=torch.bfloat16).pin_memory()
    t = lowlevel.PreparedPageTransfer(
        st.PageTransferBinding(host, spec), st.PageTransferBinding(a, spec), [0], [1]
    )
    with pytest.raises(st.ConfigError) as err:
        st.TransferEngine("kernel", device=0).submit(lowlevel.PageTransferGroup([t]))
    assert err.value.field == "tensor.device"


@needs_gpu
def test_direct_per_segment_mode():
    gpu_round_trip("direct", "layer_first", "KV", "page", per_segment=True)


@needs_gpu
def test_consumer_stream_really_waits_on_the_layer_event():
    spec = st.PoolSpec("KV", 2, 8, 128, "bf16", 64, 256)
    host = torch.randn(spec.shape()).to(torch.bfloat16).pin_memory()
    dev = torch.zeros(spec.shape(), dtype=torch.bfloat16, device="cuda")
    e = st.TransferEngine("kernel", sm_limit=1)  # slow on purpose: one SM's worth of blocks
    t = lowlevel.PreparedPageTransfer(
        st.PageTransferBinding(host, spec),
        st.PageTransferBinding(dev, spec),
        list(range(256)),
        list(range(256)),
    )
    h = e.submit(lowlevel.PageTransferGroup([t]))
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        h.stream_wait(1, consumer.cuda_stream)
        snapshot = dev[:, 1].clone()  # ordered after layer 1's event on the GPU
    consumer.synchronize()
    assert torch.equal(snapshot.cpu(), host[:, 1])


@needs_gpu
@pytest.mark.parametrize("backend", ["kernel", "direct"])
@pytest.mark.parametrize("at", [0, 1])
def test_an_injected_failure_copies_the_layers_before_it_and_fails_the_rest(backend, at):
    # The CUDA engines' fault hook: the layers before the failure are copied and published,
    # it and every later layer fail (a stream wait on one raises, never lets stale data
    # through), and the next submission is not affected.
    spec = st.PoolSpec("KV", 3, 2, 64, "bf16", 16, 32)
    host = torch.randn(spec.shape()).to(torch.bfloat16).pin_memory()
    dev = torch.zeros(spec.shape(), dtype=torch.bfloat16, device="cuda")
    e = st.TransferEngine(backend)
    t = lowlevel.PreparedPageTransfer(
        st.PageTransferBinding(host, spec), st.PageTransferBinding(dev, spec),
        list(range(32)), list(range(32)),
    )  # fmt: skip
    g = lowlevel.PageTransferGroup([t])
    testing.inject_copy_fault(e, 0, layer=at, fail="injected")
    h = e.submit(g)
    consumer = torch.cuda.Stream()
    for layer in range(at, 3):
        with pytest.raises((st.TransferFailedError, st.CopyFailedError)):
            h.stream_wait(layer, consumer.cuda_stream)
    with pytest.raises(st.CopyFailedError) as err:
        h.wait(timeout=60)
    assert (err.value.layer, err.value.reason) == (at, "injected")
    for layer in range(at):
        h.wait(layer=layer, timeout=60)
    assert h.status(2) == "failed: injected" and h.finished
    torch.cuda.synchronize()
    assert torch.equal(dev[:, :at].cpu(), host[:, :at])  # [K/V, layer, page, ...]
    assert not dev[:, at:].any()
    e.submit(g).wait(timeout=60)  # submission 1: no fault armed
    assert torch.equal(dev.cpu(), host)
    # Once finished, a stream wait on the failed layer still raises.
    with pytest.raises((st.TransferFailedError, st.CopyFailedError)):
        h.stream_wait(2, consumer.cuda_stream)
    with pytest.raises(st.ConfigError) as err:
        testing.inject_copy_fault(e, 2, delay=0.01)
    assert err.value.field == "delay"
    # Nor a copy worker's panic: its copies run on the GPU, not on a thread of its own.
    with pytest.raises(st.ConfigError) as err:
        testing.inject_copy_fault(e, 2, panic="copy bug")
    assert err.value.field == "panic"
