"""Test hooks: fault injection, evictions a test arranges, and the Rust loops the soak and the
benchmarks time. A serving engine never calls these.

They exist only in a build with the ``testing`` cargo feature (``make build`` and the GPU check
build with it; a release wheel does not). Without it, importing this module raises
``ImportError`` saying how to build one.
"""

from __future__ import annotations

from typing import Any

from sparsetier import _core

try:
    from sparsetier._core import _testing as _hooks  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - the release build
    raise ImportError(
        "sparsetier was built without its test hooks: build with the `testing` cargo feature "
        "(`maturin develop --release --features testing,host-kernel`; `make build` does)"
    ) from None

__all__ = [
    "ResolveKernel",
    "bench_resolve",
    "bench_serve",
    "contained_panic",
    "directory_of",
    "emulate_step_graphs",
    "evict_device",
    "fail_device_read_backs",
    "inject_alloc_failures",
    "inject_copy_fault",
    "inject_faults",
    "run_soak",
    "use_host_kernel",
]

run_soak = _hooks.run_soak
bench_resolve = _hooks.bench_resolve
bench_serve = _hooks.bench_serve
contained_panic = _hooks.contained_panic


def inject_faults(
    target: Any,
    kind: str,
    count: int = 1,
    layer: int | None = None,
    delay: float | None = None,
    panic: bool = False,
) -> None:
    """Arms `count` failures of the next `kind` submissions (`load`, `backup`, `restore`) of a
    `StepScheduler` (or of a `DecodeRuntime`'s), at `layer` only if given; `delay` (seconds,
    cpu engine) holds the copies back instead, `panic` (cpu engine) makes the copy worker panic
    on them; kind `internal` makes the next plan panic inside the core, as a bug would."""
    scheduler = getattr(target, "scheduler", target)
    scheduler._inject_faults(kind, count, layer, delay, panic)


def inject_alloc_failures(cache: _core.HiCache, count: int = 1) -> None:
    """The next `count` device allocations of `cache` fail with `OutOfPagesError`."""
    cache._inject_alloc_failures(count)


def inject_copy_fault(
    engine: _core.TransferEngine,
    nth: int,
    *,
    layer: int | None = None,
    fail: str | None = None,
    delay: float | None = None,
    panic: str | None = None,
) -> None:
    """Arms a fault for `engine`'s submission number `nth`: exactly one of `fail` (a reason),
    `delay` (seconds, cpu engine) or `panic` (a message, cpu engine), at `layer`."""
    engine._inject_fault(nth, layer=layer, fail=fail, delay=delay, panic=panic)


def evict_device(scheduler: _core.StepScheduler, n: int) -> int:
    """Evicts at least `n` device pages `scheduler` does not pin (written through), so that its
    next plans load them: how many went."""
    return scheduler._evict_device(n)


def directory_of(scheduler: _core.StepScheduler) -> Any:
    """`scheduler`'s own residency directory, which the caller may change under it (the
    decode benchmark's per-request baseline drives it directly)."""
    return scheduler._directory()


def use_host_kernel(target: Any, threads: int = 4) -> None:
    """From `target`'s next step on (a `DeviceResolver`, or a `DecodeRuntime` with
    `resolve="device"`), its decode layers are resolved by the CUDA kernel's own source compiled
    for the CPU, on `threads` threads that race as the GPU's warps do, instead of the reference
    (builds with the `host-kernel` feature too: `make build`)."""
    resolver = getattr(target, "resolver", target)
    if not hasattr(resolver, "_use_host_kernel"):
        raise ImportError(
            "this build has no host kernel: build with `--features testing,host-kernel` "
            "(`make build` does)"
        )
    resolver._use_host_kernel(threads)


def fail_device_read_backs(target: Any, count: int = 1) -> None:
    """The next `count` device steps of `target` (a `DeviceResolver`, or a `DecodeRuntime` with
    `resolve="device"`) fail when they end, as a GPU's read-back of the step's log can: the
    step's work is done and the core learns nothing of it, so every slot the step was granted
    counts as overwritten. Needs the kernel (`use_host_kernel`, or CUDA pools)."""
    resolver = getattr(target, "resolver", target)
    resolver._fail_read_backs(count)


def emulate_step_graphs(runtime: Any, threads: int = 1) -> None:
    """Replays a CPU `DecodeRuntime`'s device-resolved steps as `graphs=True` does on a GPU,
    but for the capture itself: the resolver's kernel runs on `threads` CPU threads
    (`use_host_kernel`); a capture records its launches over fixed selection buffers, and a
    replay runs the torch ops eagerly over the graph's shapes and the recorded launches as
    they were recorded (`will_replay` first, as on a GPU). Before the first step."""
    from sparsetier.tools.step_graphs import StepGraphs

    graphs = StepGraphs(runtime, _RecordedGraphs(runtime))  # (refuses a runtime without one)
    use_host_kernel(runtime, threads)
    runtime.graphs = graphs


class _RecordedGraphs:
    """`StepGraphs`' backend on the CPU: the resolver's launches recorded and replayed."""

    def __init__(self, runtime: Any) -> None:
        self.rt = runtime

    def capture(self, forward: Any, rids: Any) -> tuple[Any, None]:
        import numpy as np
        import torch

        res, tokens = self.rt.resolver, self.rt.mode == "token"
        bufs: dict[int, Any] = {}
        tables: dict[int, Any] = {}

        def resolve(li: int, sel: Any) -> tuple[Any, None]:
            # The launch reads this buffer at every replay, as a graph's reads its input.
            bufs[li] = np.ascontiguousarray(sel.to(torch.int32).numpy())
            tables[li] = res.resolve(li, rids, bufs[li], tokens)  # recorded, not run
            return torch.from_numpy(tables[li]), None

        res._record_launches(True)
        try:
            forward(resolve)  # (its outputs are a capture's: nothing ran)
        finally:
            res._record_launches(False)
        return (bufs, tables), None

    def replay(self, handle: Any, forward: Any, rids: Any, failed: dict) -> Any:
        import numpy as np
        import torch

        bufs, tables = handle
        res, n = self.rt.resolver, len(rids)

        def resolve(li: int, sel: Any) -> tuple[Any, None]:
            np.copyto(bufs[li], sel.to(torch.int32).numpy())
            res._replay_recorded([li], n)
            self.rt._failed_cells(li, rids, tables[li], failed)
            return torch.from_numpy(tables[li].copy()), None

        return forward(resolve)


# The device resolver's kernel, launched on torch tensors: `ResolveKernel(device)` on a CUDA
# device, or `ResolveKernel("cpu", threads)` on CPU threads (`host-kernel` builds); its
# `launch(stream, tensors, ...)` checks every buffer first (`sparsetier.tools.resolver_gpu`).
ResolveKernel = _hooks.ResolveKernel
