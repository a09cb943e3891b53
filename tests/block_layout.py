"""Block tensors laid out as vLLM lays out DeepSeek-V3.2's KV caches, with byte stamps.

Per layer, one MLA tensor ``(blocks, 64 tokens x 656 B)`` and one indexer tensor
``(blocks, 64 x 132 B)``, int8 views as vLLM's ``CanonicalKVCacheTensor``s are; group 0 lists
the MLA tensors, group 1 the indexer's (vLLM's two KV-cache groups of the model). Every byte of
block ``b`` of tensor ``t`` is a stamp of ``(t, b, offset)``, so a copy is checked byte for byte.
No vLLM import: the GPU machine runs these without vLLM.
"""

from __future__ import annotations

import torch

TOKENS_PER_BLOCK = 64
MLA_TOKEN_BYTES = 656
INDEXER_TOKEN_BYTES = 132
MLA_PAGE = TOKENS_PER_BLOCK * MLA_TOKEN_BYTES
INDEXER_PAGE = TOKENS_PER_BLOCK * INDEXER_TOKEN_BYTES


def stamp(tensor: int, block: int, page: int) -> torch.Tensor:
    """The bytes block `block` of tensor `tensor` holds (int8)."""
    offsets = torch.arange(page, dtype=torch.int64)
    return ((offsets * 7 + block * 131 + tensor * 31 + 1) % 251 - 125).to(torch.int8)


def dsv32_caches(layers: int, blocks: int, device: str = "cpu"):
    """`(tensors, pages, groups)`: the stamped block tensors, their pages, and per group the
    `(tensor index, bytes)` of each layer."""
    tensors, pages = [], []
    for page in [MLA_PAGE] * layers + [INDEXER_PAGE] * layers:
        t = len(tensors)
        rows = torch.stack([stamp(t, b, page) for b in range(blocks)])
        tensors.append(rows.to(device))
        pages.append(page)
    groups = [
        [(i, MLA_PAGE) for i in range(layers)],
        [(layers + i, INDEXER_PAGE) for i in range(layers)],
    ]
    return tensors, pages, groups


def expected_pairs(blocks: list[int], start: int, chunks: list[int], bpc: int):
    """(device block, host block) pairs of one group, as vLLM's CPU worker expands them."""
    host = [c * bpc + j for c in chunks for j in range(bpc)][start % bpc :][: len(blocks)]
    return list(zip(blocks, host, strict=True))
