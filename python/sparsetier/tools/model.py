"""A small decoder-only model with sparse attention: a few layers, GQA, an indexer per layer,
weights from a fixed seed. It runs on CPU in seconds and on CUDA unchanged. The model holds no
cache: the decode runtime owns where every K/V page lives."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from sparsetier.indexer import SparseIndexer, rope


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512
    hidden: int = 64
    layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    indexer_heads: int = 2
    indexer_dim: int = 16
    seed: int = 0


def rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Layer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.wq = nn.Linear(c.hidden, c.q_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.q_heads * c.head_dim, c.hidden, bias=False)
        self.up = nn.Linear(c.hidden, 2 * c.hidden, bias=False)
        self.down = nn.Linear(2 * c.hidden, c.hidden, bias=False)
        self.indexer = SparseIndexer(c.hidden, c.indexer_heads, c.indexer_dim)

    def qkv(self, x: torch.Tensor, pos: torch.Tensor):
        """q [T, Hq, D] (float32), k and v [T, Hkv, D] (bf16, as the KV pool stores them)."""
        h = rms(x)
        c = self.c
        q = rope(self.wq(h).view(-1, c.q_heads, c.head_dim), pos)
        k = rope(self.wk(h).view(-1, c.kv_heads, c.head_dim), pos).to(torch.bfloat16)
        v = self.wv(h).view(-1, c.kv_heads, c.head_dim).to(torch.bfloat16)
        return q, k, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.wo(attn.reshape(x.shape[0], -1))
        return x + self.down(torch.relu(self.up(rms(x))))


class TinySparseModel(nn.Module):
    def __init__(self, c: ModelConfig | None = None) -> None:
        super().__init__()
        self.c = c = c or ModelConfig()
        g = torch.Generator().manual_seed(c.seed)
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(max(p.shape[-1], 1)))
            for layer in self.layers:
                layer.indexer.gamma_k.fill_(1.0)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, start: int = 0, past=None):
        """Dense causal pass over `tokens` at positions `start`, `start + 1`, ... Returns, per
        layer, (k, v, indexer input) of these tokens and the last token's logits. With
        `start > 0`, `past(layer)` gives the K/V ([start, Hkv, D]) of the earlier tokens; it is
        called layer by layer, so a layer's earlier K/V can arrive while the previous layer
        computes."""
        pos = torch.arange(start, start + tokens.numel(), device=tokens.device)
        x = self.embed(tokens)
        out = []
        for li, layer in enumerate(self.layers):
            q, k, v = layer.qkv(x, pos)
            if start:
                pk, pv = past(li)
                attn = _causal(q, torch.cat([pk, k]), torch.cat([pv, v]), offset=start)
            else:
                attn = _causal(q, k, v)
            out.append((k, v, rms(x)))
            x = layer.finish(x, attn)
        return out, self.head(rms(x[-1:]))[0]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(rms(x))


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Causal attention of queries at positions offset.. over keys at 0..; GQA by repetition."""
    group = q.shape[1] // k.shape[1]
    kk = k.to(torch.float32).repeat_interleave(group, dim=1)
    vv = v.to(torch.float32).repeat_interleave(group, dim=1)
    logits = torch.einsum("thd,shd->hts", q, kk) / math.sqrt(q.shape[-1])
    n, s = q.shape[0], k.shape[0]
    ar = torch.arange(max(n, s), device=q.device)
    visible = ar[None, :s] <= (ar[:n] + offset)[:, None]
    logits = logits.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(logits, dim=-1), vv)


__all__ = ["Layer", "ModelConfig", "TinySparseModel", "rms"]
