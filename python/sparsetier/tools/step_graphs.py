"""A device-resolved decode step replayed as a graph (`DecodeRuntime(graphs=True)`).

A step whose layers the device resolver maps (`resolve="device"`) asks the host nothing
between its layers, so its whole forward, embedding to logits, the resolver's launches
included, can be captured once and replayed in later steps. Shapes are fixed per graph: a
graph serves steps of one batch size whose history fits its width (the longest request's
tokens rounded up to a power of two), over fixed input buffers (the batch's state and its
Indexer-K page rows) that each step writes before the replay.

Each (batch size, width) is first run eagerly over the graph's shapes (the warm-up a capture
needs), captured the next time, and replayed after that. The resolver's launches captured in
a graph name its buffers; when those move (`DeviceResolver.graph_epoch`) the graph is captured
again, and a replay the resolver refuses (`will_replay`) runs eagerly instead: nothing changes
when it refuses.

The backend is a CUDA graph on a GPU. On the CPU, test builds record the resolver's launches
and run the torch ops eagerly (`sparsetier.testing.emulate_step_graphs`), so that everything
but the capture itself is checked here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sparsetier.errors import ConfigError

#: The narrowest history a graph scores (tokens).
MIN_WIDTH = 256


@dataclass
class StepGraph:
    """One captured step: its input buffers, its output, and the epoch of its launches."""

    rows: int
    width: int
    epoch: int | None
    state: torch.Tensor  # [rows, 3 + layers] int64
    idx: torch.Tensor  # [rows, width // page_size] int64
    handle: Any = None
    logits: torch.Tensor | None = None


class CudaGraphs:
    """Captures with torch CUDA graphs (on a private stream; the resolver's launches are
    captured there, not run) and replays on the current stream."""

    def capture(self, forward, rids: np.ndarray) -> tuple[Any, torch.Tensor]:
        """Captures `forward(None)` (the resolver's own launches, captured): the graph and
        its logits buffer."""
        graph = torch.cuda.CUDAGraph()
        # (thread_local: the transfer engine's threads may call CUDA meanwhile.)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = forward(None)
        return graph, logits

    def replay(self, handle: Any, forward, rids: np.ndarray, failed: dict) -> torch.Tensor | None:
        """Replays the graph on the current stream (its logits land in the capture's
        buffer: None)."""
        handle.replay()
        return None


class StepGraphs:
    """The graphs of a runtime's device-resolved steps, keyed by (batch size, width)."""

    def __init__(self, runtime, backend=None) -> None:
        if runtime.resolver is None:
            raise ConfigError.of("graphs", "True", "resolve='device' (the host path plans a layer)")
        self.rt = runtime
        self.backend = backend if backend is not None else CudaGraphs()
        self.graphs: dict[tuple[int, int], StepGraph] = {}
        self.warm: set[tuple[int, int]] = set()
        self.captures = self.replays = self.eager = self.refused = 0

    def stats(self) -> dict:
        """Steps captured (each also replayed), replayed, run eagerly over a graph's shapes
        (warm-ups, and replays refused), and replays the resolver refused."""
        return {
            "captures": self.captures,
            "replays": self.replays,
            "eager": self.eager,
            "refused": self.refused,
            "graphs": len(self.graphs),
        }

    def width(self, t_hist: int) -> int:
        """The history a step of `t_hist` tokens scores: a power of two, whole pages."""
        w = max(MIN_WIDTH, 1 << (t_hist - 1).bit_length())
        ps = self.rt.ps
        return -(-w // ps) * ps

    def step(
        self,
        rids: np.ndarray,
        state: np.ndarray,
        idx_tbl: torch.Tensor,
        t_hist: int,
        failed: dict[int, str],
    ) -> torch.Tensor:
        """One granted device step: its logits [B, vocab], from a replay when a graph of its
        shapes is captured and current (requests whose copies failed go into `failed`)."""
        rt = self.rt
        # (Every request's Indexer-K pages within the width, whatever they cover.)
        n, width = len(rids), self.width(max(t_hist, idx_tbl.shape[1] * rt.ps))
        key = (n, width)
        g = self.graphs.get(key)
        epoch = rt.resolver.graph_epoch
        if g is None and key not in self.warm:
            # The first step of these shapes runs eagerly over them: a capture's warm-up.
            self.warm.add(key)
            return self._eager(rids, state, idx_tbl, width, failed)
        if g is None or g.epoch != epoch:
            g = self._new(n, width, epoch)
            self._write(g, state, idx_tbl)
            g.handle, g.logits = self.backend.capture(self._body(g, rids), rids)
            self.graphs[key] = g
            self.captures += 1
        else:
            self._write(g, state, idx_tbl)
            self.replays += 1
        try:
            rt.resolver.will_replay(range(len(rt.model.layers)), n)
        except ConfigError:
            # Nothing changed: this step runs eagerly, and the graph is captured again.
            self.graphs.pop(key, None)
            self.refused += 1
            return self._eager(rids, state, idx_tbl, width, failed)
        out = self.backend.replay(g.handle, self._body(g, rids), rids, failed)
        return g.logits if out is None else out

    def _new(self, n: int, width: int, epoch: int | None) -> StepGraph:
        rt = self.rt
        layers = len(rt.model.layers)
        state = torch.zeros((n, 3 + layers), dtype=torch.long, device=rt.device)
        idx = torch.zeros((n, width // rt.ps), dtype=torch.long, device=rt.device)
        return StepGraph(n, width, epoch, state, idx)

    def _write(self, g: StepGraph, state: np.ndarray, idx_tbl: torch.Tensor) -> None:
        """The step's inputs into the graph's buffers (queued on the stream)."""
        g.state.copy_(self.rt._table(state), non_blocking=True)
        g.idx.copy_(_padded(idx_tbl, g.idx.shape[1]))

    def _eager(self, rids, state, idx_tbl, width: int, failed: dict) -> torch.Tensor:
        """The step run eagerly over a graph's shapes."""
        self.eager += 1
        rt = self.rt
        pages = _padded(idx_tbl, width // rt.ps)
        return rt._forward(rt._table(state), pages, width, rt._resolve_fn(rids, failed, True))

    def _body(self, g: StepGraph, rids: np.ndarray):
        """The step as a graph holds it, over its buffers; `resolve(layer, sel)` is the
        backend's (None: the runtime's, whose launches a capture captures)."""
        rt = self.rt

        def forward(resolve):
            # (A CUDA kernel has no copy to fail: nothing goes into `failed`.)
            resolve = resolve or rt._resolve_fn(rids, {}, True)
            return rt._forward(g.state, g.idx, g.width, resolve)

        return forward


def _padded(idx_tbl: torch.Tensor, pages: int) -> torch.Tensor:
    """Indexer-K page rows widened to `pages` (page 0 past a request's: never scored, its
    tokens are past the query's position)."""
    return torch.nn.functional.pad(idx_tbl, (0, pages - idx_tbl.shape[1]))


__all__ = ["CudaGraphs", "StepGraph", "StepGraphs"]
