"""Token mode's selections as pages, mapped where they were selected (the GPU).

DSA-style token mode selects top-k tokens (2048 at DeepSeek-V3.2's shape) per request per
layer. The core plans pages, so each row's tokens must become its distinct pages, with how many
selected tokens each page holds (for the bytes needed and read amplification). The core does
that itself from token rows (the runtime's default, `token_map="core"`); `map_tokens` does it
with batched tensor ops on the device the indexer ran on (`token_map="device"`), and the core
then plans page rows about 16x narrower, with counts (`StepScheduler.plan(..., counts)`).

On a GPU the core's part of a step halves, but the ~20 small ops a layer cost more CPU to
launch than the core's own mapping saves (benches/RESULTS.md, "Token mode mapped on the GPU"). So
`TokenMapper`, what the runtime and `bench decode` call, captures those ops once per shape as
a CUDA graph and replays it: one launch a layer (on the CPU it is `map_tokens`); where a
capture fails it says so once and maps eagerly.

`map_tokens` is batched over the whole `[B, K]` selection (a sort, a scan and two scatters):
no loop over requests or tokens, no sync. `to_host` then copies the pages and counts of the
columns rows use to the CPU (the plan needs them there, as it needed the tokens), and
`inverse` stays on the device to turn the per-page slot table back into a per-token one.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from sparsetier._checks import count, describe
from sparsetier.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class MappedTokens:
    """One layer's token selection as page rows (all `[B, K]`, on the selection's device)."""

    pages: torch.Tensor  # int32: each row's distinct pages ascending, then -1
    counts: torch.Tensor  # int32: distinct selected tokens in that page, then 0
    inverse: torch.Tensor  # int64: per selected token, its page's column (0 for -1 tokens)
    width: torch.Tensor  # 0-dim int64: the most pages a row has (at least 1)

    def to_host(self) -> tuple[np.ndarray, np.ndarray]:
        """`(pages int64 [B, P], counts int32 [B, P])` on the CPU, P the widest row: the
        plan's input. The width comes first (a sync, which the plan needs anyway), then only
        the P columns (about K / 16 at DeepSeek-V3.2's shape) in one copy."""
        w = int(self.width)
        both = torch.stack([self.pages[:, :w], self.counts[:, :w]]).cpu().numpy()
        return both[0].astype(np.int64), np.ascontiguousarray(both[1])

    def token_table(self, page_table: torch.Tensor) -> torch.Tensor:
        """A slot table per token `[B, K]` from the plan's per page `[B, P]` (on its device):
        each token reads its page's slot."""
        b = self.inverse.shape[0]
        ok = isinstance(page_table, torch.Tensor) and page_table.dim() == 2
        ok = ok and page_table.dtype in _INTS and page_table.shape[0] == b
        # Narrower than the widest row, tokens of the last pages would read another page's
        # slot (the clamp below only keeps -1 tokens in range); the width is known without a
        # device sync only on the CPU.
        w = int(self.width) if self.width.device.type == "cpu" else 1
        w = min(w, self.inverse.shape[1])  # no selected token (K = 0): no page column
        if not (ok and page_table.shape[1] >= w):
            raise ConfigError.of(
                "page_table", describe(page_table), f"an integer [{b}, >= {w}] tensor"
            )
        cols = self.inverse.clamp(max=page_table.shape[1] - 1)
        return page_table.to(self.inverse.device, torch.long).gather(1, cols)


def map_tokens(selection: torch.Tensor, page_size: int) -> MappedTokens:
    """Maps a token selection `[B, K]` (token indices, -1 = none, in any order) to each row's
    distinct pages of `page_size` tokens with the distinct selected tokens in each, in one
    batched pass on the selection's device."""
    ok = isinstance(selection, torch.Tensor)
    if not (ok and selection.dim() == 2 and selection.dtype == torch.int64):
        raise ConfigError.of("selection", describe(selection), "an int64 [B, K] tensor")
    page_size = count("page_size", page_size, 1)
    # Entries below -1 would be skipped as "none"; refused where that costs no device sync.
    if selection.device.type == "cpu" and selection.numel() and int(selection.min()) < -1:
        raise ConfigError.of("selection", int(selection.min()), "token indices >= 0, or -1")
    b, k = selection.shape
    dev = selection.device
    valid = selection >= 0
    none = torch.iinfo(torch.int64).max  # sorts after every token
    stok, order = torch.sort(torch.where(valid, selection, none), dim=1)
    sval = stok != none
    spage = torch.where(sval, stok // page_size, -1)  # ascending with the tokens
    # A token named twice counts once; a page starts where the page changes.
    new_tok = sval.clone()
    new_tok[:, 1:] &= stok[:, 1:] != stok[:, :-1]
    first = sval.clone()
    first[:, 1:] &= spage[:, 1:] != spage[:, :-1]
    # Column of each sorted token's page; tokens of no page go to a spare column k.
    col = torch.where(sval, torch.cumsum(first, dim=1) - 1, k)
    pages = torch.full((b, k + 1), -1, dtype=torch.int64, device=dev)
    pages.scatter_(1, col, spage)  # every writer of a column writes the same page
    counts = torch.zeros((b, k + 1), dtype=torch.int32, device=dev)
    counts.scatter_add_(1, col, new_tok.to(torch.int32))
    inverse = torch.empty((b, k), dtype=torch.int64, device=dev)
    inverse.scatter_(1, order, col.clamp(max=max(k - 1, 0)))
    counts = counts[:, :k]
    return MappedTokens(
        pages[:, :k].to(torch.int32),
        counts,
        inverse.masked_fill(~valid, 0),
        counts.gt(0).sum(dim=1).amax().clamp(min=1)
        if b
        else torch.ones((), dtype=torch.int64, device=dev),
    )


_INTS = (torch.int64, torch.int32, torch.int16)  # signed: -1 is "no slot"


@dataclass
class _Graph:
    """One captured mapping: its input buffer, the graph and the outputs it writes."""

    selection: torch.Tensor
    graph: torch.cuda.CUDAGraph
    out: MappedTokens


class TokenMapper:
    """`map_tokens(selection, page_size)` for a stream of layers: on CUDA, the batched ops are
    captured once per selection shape (and device) as a CUDA graph, and each call copies the
    selection into the graph's input and replays it, one launch where eager mode queues ~20.
    Elsewhere (the CPU), or with `graphs=False`, or once a capture has failed, it maps eagerly.

    A replay writes the same output tensors each time: a call's `MappedTokens` is valid until
    the next call of the same shape. GPU work queued after it on the stream reads it in order;
    `to_host` copies it out at once, and `token_table` makes a new tensor."""

    # Shapes kept captured (a batch that changes size is a new shape): each graph holds its
    # intermediates in a private pool, ~10 tensors of [B, K].
    MAX_GRAPHS = 8

    def __init__(self, page_size: int, graphs: bool = True) -> None:
        self.page_size = count("page_size", page_size, 1)
        self.graphs = graphs
        self._captured: OrderedDict[tuple, _Graph] = OrderedDict()
        self.replays = 0  # calls served by a graph (the rest ran eagerly)

    def __call__(self, selection: torch.Tensor) -> MappedTokens:
        if not isinstance(selection, torch.Tensor):
            return map_tokens(selection, self.page_size)  # raises the typed error
        if not (self.graphs and selection.is_cuda) or selection.dim() != 2:
            return map_tokens(selection, self.page_size)
        if selection.dtype != torch.int64:
            return map_tokens(selection, self.page_size)  # raises the typed error
        key = (tuple(selection.shape), selection.device)
        g = self._captured.get(key)
        if g is None:
            g = self._capture(selection)
            if g is None:
                return map_tokens(selection, self.page_size)
            self._captured[key] = g
            if len(self._captured) > self.MAX_GRAPHS:
                self._captured.popitem(last=False)
        else:
            self._captured.move_to_end(key)
        g.selection.copy_(selection)
        if selection.device.index == torch.cuda.current_device():
            g.graph.replay()
        else:  # a graph replays on its own device's current stream
            with torch.cuda.device(selection.device):
                g.graph.replay()
        self.replays += 1
        return g.out

    def _capture(self, selection: torch.Tensor) -> _Graph | None:
        with torch.cuda.device(selection.device):  # captured on the selection's device
            return self._capture_here(selection)

    def _capture_here(self, selection: torch.Tensor) -> _Graph | None:
        static = selection.clone()
        try:
            # Warm up on a side stream (torch's recipe: first calls allocate and pick kernels),
            # then capture; the current stream waits for both.
            side = torch.cuda.Stream(selection.device)
            side.wait_stream(torch.cuda.current_stream(selection.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    map_tokens(static, self.page_size)
            torch.cuda.current_stream(selection.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # Thread-local: the copy engines' threads may query their own streams meanwhile,
            # which a global capture would refuse (and fail the capture for).
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = map_tokens(static, self.page_size)
        except RuntimeError as e:
            log.warning("token mapping: CUDA graph capture failed (%s); mapping eagerly", e)
            self.graphs = False
            return None
        return _Graph(static, graph, out)
