"""``SparsetierOffloadingWorker``: vLLM's worker-side block mover, on sparsetier's engines.

vLLM hands the worker its KV caches as ``CanonicalKVCaches``: block tensors
``(num_blocks, page_size_bytes)`` and, per KV-cache group, which tensor each layer uses and
how many bytes of a block. The worker keeps one host pool per tensor,
``(num_chunks, page_size_bytes * blocks_per_chunk)`` (pinned when a GPU engine copies), and
runs each job as one submission of the Rust ``BlockMover`` on a copy engine: ``kernel`` or
``direct`` for CUDA tensors, ``cpu`` for CPU tensors. Copies follow the work queued on torch's
current stream; a failed copy is reported as a failed job, never as done.
"""

from __future__ import annotations

import logging

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from sparsetier import _checks
from sparsetier._core import BlockMover, TransferEngine
from sparsetier.errors import ConfigError

logger = logging.getLogger(__name__)

IO_BACKENDS = ("auto", "cpu", "kernel", "direct")


def check_engine_options(io_backend: str, copy_threads: object, sm_limit: object) -> None:
    """The io_backend is known, and an engine option goes with an io_backend that uses it, as
    the engine itself requires (under "auto", the option of the engine not picked is
    ignored): the spec checks it when the config is read, the worker before it allocates."""
    if io_backend not in IO_BACKENDS:
        raise ConfigError.of("io_backend", io_backend, "one of " + ", ".join(IO_BACKENDS))
    for option, value, engine in (("copy_threads", copy_threads, "cpu"),
                                  ("sm_limit", sm_limit, "kernel")):  # fmt: skip
        if value is not None and io_backend not in (engine, "auto"):
            raise ConfigError.of(option, value, f"unset: only for io_backend {engine} or auto")


def _spec_ids(spec: LoadStoreSpec, field: str):
    if not isinstance(spec, CPULoadStoreSpec):
        raise ConfigError.of(field, type(spec).__name__, "a CPULoadStoreSpec (chunk ids)")
    return spec.block_ids


class SparsetierOffloadingWorker(OffloadingWorker):
    """Moves blocks between vLLM's KV caches and sparsetier's host pools (module docs)."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_chunks: int,
        *,
        io_backend: str = "auto",
        copy_threads: int | None = None,
        sm_limit: int | None = None,
    ) -> None:
        # Checked before anything is allocated.
        check_engine_options(io_backend, copy_threads, sm_limit)
        blocks_per_chunk = _checks.count("blocks_per_chunk", blocks_per_chunk, 1)
        num_chunks = _checks.count("num_chunks", num_chunks, 1)
        for option, value in (("copy_threads", copy_threads), ("sm_limit", sm_limit)):
            if value is not None:
                _checks.count(option, value, 1)
        device_tensors = []
        for i, t in enumerate(kv_caches.tensors):
            view = t.tensor.view(torch.int8)
            if view.dim() != 2 or view.shape[1] != t.page_size_bytes:
                view = view.view(-1, t.page_size_bytes)
            device_tensors.append(view)
            if view.device != device_tensors[0].device:
                raise ConfigError.of(
                    f"kv_caches.tensors[{i}].device", view.device, "one device for every tensor"
                )
        if not device_tensors:
            raise ConfigError.of("kv_caches.tensors", "[]", "at least one tensor")
        on_gpu = device_tensors[0].is_cuda
        if io_backend == "auto":
            io_backend = "kernel" if on_gpu else "cpu"
        gpu_engine = io_backend != "cpu"
        if gpu_engine != on_gpu:
            raise ConfigError.of(
                "io_backend",
                io_backend,
                "'kernel' or 'direct' for CUDA tensors, 'cpu' for CPU tensors",
            )
        self.io_backend = io_backend
        self.host_tensors = [
            torch.zeros(
                (num_chunks, v.shape[1] * blocks_per_chunk),
                dtype=torch.int8,
                pin_memory=gpu_engine,
            )
            for v in device_tensors
        ]
        groups = [
            [(ref.tensor_idx, ref.page_size_bytes) for ref in refs]
            for refs in kv_caches.group_data_refs
        ]
        kwargs = {"threads": copy_threads or 2} if io_backend == "cpu" else {}
        if io_backend == "kernel" and sm_limit is not None:
            kwargs["sm_limit"] = sm_limit
        if gpu_engine:
            kwargs["device"] = device_tensors[0].device.index or 0
        engine = TransferEngine(io_backend, **kwargs)
        # Expedited loads (waited on within the step) get their own engine and stream, so
        # they never queue behind regular transfers.
        expedited = TransferEngine(io_backend, **kwargs)
        self.engines = (engine, expedited)
        self._shut_down = False
        self._mover = BlockMover(
            device_tensors,
            self.host_tensors,
            groups,
            blocks_per_chunk,
            num_chunks,
            engine,
            expedited,
        )

    def _check_running(self) -> None:
        if self._shut_down:
            raise ConfigError.of("worker", "shut down", "a worker before its shutdown()")

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self._check_running()
        self._mover.submit(
            job_id,
            True,
            src_spec.block_ids,
            src_spec.group_sizes,
            src_spec.block_indices,
            _spec_ids(dst_spec, "dst_spec"),
        )
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        self._check_running()
        if not isinstance(expedited, bool):
            raise ConfigError.of("expedited", repr(expedited), "True or False")
        self._mover.submit(
            job_id,
            False,
            dst_spec.block_ids,
            dst_spec.group_sizes,
            dst_spec.block_indices,
            _spec_ids(src_spec, "src_spec"),
            expedited,
        )
        return True

    def get_finished(self) -> list[TransferResult]:
        results = []
        for job_id, ok, size, seconds, error in self._mover.finished():
            if not ok:
                logger.warning("sparsetier offload job %d failed: %s", job_id, error)
                results.append(TransferResult(job_id=job_id, success=False))
                continue
            results.append(
                TransferResult(
                    job_id=job_id, success=True, transfer_size=size, transfer_time=seconds
                )
            )
        return results

    def wait(self, job_ids: set[int]) -> None:
        self._mover.wait(list(job_ids))

    def shutdown(self) -> None:
        self._shut_down = True
        self._mover.shutdown()

    @property
    def pending_jobs(self) -> int:
        """Jobs submitted and not yet reported by ``get_finished``."""
        return self._mover.pending
