"""A parametric model of what a sparse-attention indexer selects, for benchmarks of prefix
restores at scales the tiny model cannot reach (its random weights select almost uniformly).

Each query token selects `topk_pages` pages of its context, per layer:
- `sink_pages`: the context's first pages (attention sinks), always;
- a local window: the pages holding its last `window` tokens, always;
- the rest drawn from the other pages by a Zipf law of exponent `zipf_s` over a ranking of
  pages fixed per layer (the pages a layer finds relevant to this conversation): the distinct
  pages of a Poisson number of draws with replacement, of a mean set so that a token selects
  its whole budget (`topk_pages` pages) in expectation, as a top-k does (as many draws as
  the budget's pages would name fewer: duplicates merge). Each token keeps each of its
  predecessor's draws but with probability `churn`, and makes a Poisson number of new ones,
  `churn` times a token's mean (`churn=1`: independent tokens, which still share the sinks,
  the window and the Zipf law's head). `adjacent_overlap` gives the share of a token's pages
  the next token selects too, and `with_overlap` sets `churn` from a measured one.

What a prefix restore needs is the union, over the suffix's tokens and per layer, of the
prefix pages selected. The model gives its expected size in closed form: a suffix of S tokens
makes a Poisson number of draws of mean n = m (1 + (S - 1) churn) in all (m: a token's), and a
page of draw probability p is in their union with probability 1 - exp(-n p). Top-k sets
redrawn without replacement name a few per cent more pages (a redraw there never lands on a
page the token holds; a test simulates both and bounds the gap). The defaults are
DeepSeek-V3.2's top-2048 tokens in 64-token pages, one sink page and a 512-token window, and
`churn=0.1`, chosen before any measurement. DSA's published measurements are of tokens, not
pages. Its adjacent top-k sets' overlap leaves the churn open. The misses of its decode cache
sit near 0.1 for a model that packs selections into whole pages (`tools/lru_misses.py`;
benches/RESULTS.md, "What DSA's decode cache misses, against the model").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SelectionModel:
    """Sinks, a local window and Zipf-distributed pages over the rest (module docs)."""

    page_size: int = 64
    topk_pages: int = 32
    sink_pages: int = 1
    window: int = 512
    zipf_s: float = 1.1
    churn: float = 0.1

    def __post_init__(self):
        for name in ("page_size", "topk_pages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: allowed >= 1")
        if self.sink_pages < 0 or self.window < 0:
            raise ValueError(
                f"sink_pages = {self.sink_pages}, window = {self.window}: allowed >= 0"
            )
        # (Past 50 the first page takes every draw, and the powers underflow.)
        if not 0 < self.zipf_s <= 50:
            raise ValueError(f"zipf_s = {self.zipf_s}: allowed 0 < zipf_s <= 50")
        if not 0 <= self.churn <= 1:
            raise ValueError(f"churn = {self.churn}: allowed 0 <= churn <= 1")
        if self.sink_pages + self.window_pages > self.topk_pages:
            raise ValueError(
                f"sink_pages + window pages = {self.sink_pages + self.window_pages}: allowed "
                f"<= topk_pages ({self.topk_pages})"
            )

    @property
    def window_pages(self) -> int:
        return -(-self.window // self.page_size)

    def prefix_union(self, prefix_tokens: int, suffix_tokens: int) -> float:
        """Expected prefix pages a layer's selections over `suffix_tokens` query tokens (the
        tokens after the prefix) name, of the prefix's `ceil(prefix_tokens / page_size)`."""
        return float(self.page_probs(prefix_tokens, suffix_tokens).sum())

    def page_probs(self, prefix_tokens: int, suffix_tokens: int) -> np.ndarray:
        """Per prefix page, the probability that a layer's selections over the suffix name it:
        1 for the sinks and the window's pages at the prefix's end; the Zipf pages' expected
        coverage, the same for each of the middle pages (a layer's ranking of them is not
        positional: averaged over layers, each page is any rank)."""
        if prefix_tokens < 0 or suffix_tokens < 0:
            raise ValueError(
                f"prefix_tokens = {prefix_tokens}, suffix_tokens = {suffix_tokens}: allowed >= 0"
            )
        pages = -(-prefix_tokens // self.page_size)
        out = np.zeros(pages)
        if pages == 0 or suffix_tokens == 0:
            return out
        sinks = min(self.sink_pages, pages)
        # The first suffix token's window reaches back into the prefix; later ones less.
        window = min(self.window_pages, pages - sinks)
        rest = pages - sinks - window
        out[:sinks] = 1.0
        out[pages - window :] = 1.0
        draws = self.topk_pages - self.sink_pages - self.window_pages
        if rest == 0 or draws == 0:
            return out
        if rest <= draws:
            return np.ones(pages)
        p = self._zipf(rest)
        covered = -np.expm1(-self._suffix_draws(p, draws, suffix_tokens) * p)
        out[sinks : pages - window] = covered.mean()
        return out

    def adjacent_overlap(self, context_tokens: int) -> float:
        """The expected share of a token's selected pages that the next token selects too,
        over a context of `context_tokens` (what a measurement of adjacent top-k sets gives,
        to set `churn` from: `with_overlap`). The sinks and the window count as shared (the
        window moves one token a step: at most one of its pages in `page_size` steps)."""
        if context_tokens < 0:
            raise ValueError(f"context_tokens = {context_tokens}: allowed >= 0")
        return self._overlap(context_tokens, self.churn)

    def with_overlap(self, overlap: float, context_tokens: int) -> SelectionModel:
        """This model with the churn whose `adjacent_overlap` over `context_tokens` is
        `overlap` (it falls as churn rises: bisection)."""
        import dataclasses

        if context_tokens < 1:
            raise ValueError(f"context_tokens = {context_tokens}: allowed >= 1")
        lo = self._overlap(context_tokens, 1.0)
        if not lo <= overlap <= 1.0:
            raise ValueError(
                f"overlap = {overlap}: allowed between {lo:.3f} (independent tokens, churn 1, "
                f"over {context_tokens} tokens) and 1"
            )
        a, b = 0.0, 1.0
        for _ in range(50):
            mid = 0.5 * (a + b)
            a, b = (mid, b) if self._overlap(context_tokens, mid) > overlap else (a, mid)
        return dataclasses.replace(self, churn=0.5 * (a + b))

    def _overlap(self, context_tokens: int, churn: float) -> float:
        """`adjacent_overlap` at `churn`: a page of draw probability p is in a token's draws
        with probability 1 - exp(-m p), in both tokens' with 1 - 2 exp(-m p) +
        exp(-(1 + churn) m p) (the kept, dropped and new draws are independent Poissons)."""
        pages = -(-context_tokens // self.page_size)
        sinks = min(self.sink_pages, pages)
        window = min(self.window_pages, pages - sinks)
        rest = pages - sinks - window
        draws = self.topk_pages - self.sink_pages - self.window_pages
        if rest <= draws or draws == 0:
            return 1.0
        p = self._zipf(rest)
        m = _draws_for(p, draws)
        both = -2.0 * np.expm1(-m * p) + np.expm1(-(1.0 + churn) * m * p)
        return float((sinks + window + both.sum()) / self.topk_pages)

    def sample_union(
        self, prefix_tokens: int, suffix_tokens: int, rng: np.random.Generator
    ) -> np.ndarray:
        """One layer's union, drawn: the prefix pages (ascending) the suffix's selections
        name, the middle ones ranked by a random permutation (the layer's own ranking). Its
        size averages `prefix_union`."""
        probs = self.page_probs(prefix_tokens, suffix_tokens)
        certain = np.flatnonzero(probs == 1.0)
        pages = probs.size
        sinks = min(self.sink_pages, pages)
        window = min(self.window_pages, pages - sinks)
        rest = pages - sinks - window
        draws = self.topk_pages - self.sink_pages - self.window_pages
        if suffix_tokens == 0 or rest <= draws or draws == 0:
            return certain
        p = self._zipf(rest)
        n = rng.poisson(self._suffix_draws(p, draws, suffix_tokens))
        ranked = rng.permutation(rest) + sinks
        drawn = ranked[np.unique(rng.choice(rest, size=n, p=p))]
        return np.union1d(certain, drawn)

    def _zipf(self, rest: int) -> np.ndarray:
        """The Zipf law over the `rest` middle pages, by rank."""
        p = 1.0 / np.arange(1, rest + 1, dtype=np.float64) ** self.zipf_s
        return p / p.sum()

    def _suffix_draws(self, p: np.ndarray, draws: int, suffix_tokens: int) -> float:
        """The mean number of Zipf draws a suffix of `suffix_tokens` makes in all."""
        return _draws_for(p, draws) * (1 + (suffix_tokens - 1) * self.churn)


def _rows3(field: str, rows: np.ndarray, page_size: int) -> np.ndarray:
    """`rows` as an integer array `[layers, tokens, k]`, and a page size of at least 1."""
    rows = np.asarray(rows)
    if rows.ndim != 3 or not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(
            f"{field} = an array of shape {rows.shape} and dtype {rows.dtype}: allowed an "
            "integer array [layers, tokens, k]"
        )
    if page_size < 1:
        raise ValueError(f"page_size = {page_size}: allowed >= 1")
    return rows


def _distinct(rows: np.ndarray) -> np.ndarray:
    """`rows` sorted, each id once (repeats become -1, the padding)."""
    r = np.sort(rows, axis=1)
    r[:, 1:][r[:, 1:] == r[:, :-1]] = -1
    return r


def _draws_for(p: np.ndarray, pages: int) -> float:
    """The mean number of draws (of probabilities `p`) whose distinct pages number `pages` in
    expectation: the root of sum(1 - exp(-lam p)) = pages, which rises with lam (bisection;
    `pages` < len(p))."""
    lo, hi = float(pages), 2.0 * pages
    while -np.expm1(-hi * p).sum() < pages:
        lo, hi = hi, 2.0 * hi
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if -np.expm1(-mid * p).sum() < pages else (lo, mid)
    return 0.5 * (lo + hi)


class RecordedSelections:
    """Selections recorded from a real model, replayed where the parametric model would be:
    `sel[l, t]` holds the pages (ids, -1 padded) token `t` of one long request selected at
    layer `l`. A prefix of P tokens with a suffix of S is the recording's first P tokens and
    the S after them: the union, per layer, of the prefix pages those S tokens selected.

    Saved as an `.npz` with `sel` (int32 `[layers, tokens, k]`) and `page_size`; or with
    `token_sel` instead of `sel`: the token indices an indexer such as DSA's selected
    (`[layers, tokens, k_tokens]`, -1 padded), turned into the pages they fall in
    (`from_tokens`).
    """

    def __init__(self, sel: np.ndarray, page_size: int) -> None:
        sel = _rows3("sel", sel, page_size)
        self.sel = sel
        self.page_size = int(page_size)
        self.topk_pages = int(sel.shape[2])

    @classmethod
    def load(cls, path: str) -> RecordedSelections:
        with np.load(path) as z:
            if "token_sel" in z and "sel" not in z:
                return cls.from_tokens(z["token_sel"], int(z["page_size"]))
            return cls(z["sel"], int(z["page_size"]))

    @classmethod
    def from_tokens(cls, token_sel: np.ndarray, page_size: int) -> RecordedSelections:
        """Selections of tokens (`[layers, tokens, k_tokens]` token indices, -1 padded) as
        the pages they fall in: each row's distinct pages, -1 padded to the widest row."""
        token_sel = _rows3("token_sel", token_sel, page_size)
        # A layer at a time (a recording of DSA's top-2048 is gigabytes): per row, the sorted
        # pages with -1 (padding) first, each page's first place marked and packed left.
        out = []
        for layer in token_sel:
            pages = np.sort(np.where(layer >= 0, layer // page_size, -1), axis=1)
            first = np.ones(pages.shape, dtype=bool)
            first[:, 1:] = pages[:, 1:] != pages[:, :-1]
            first &= pages >= 0
            at = np.cumsum(first, axis=1) - 1
            ti, ki = np.nonzero(first)
            row = np.full(pages.shape, -1, dtype=np.int32)
            row[ti, at[ti, ki]] = pages[ti, ki]
            out.append(row)
        width = max((int((r >= 0).sum(axis=1).max(initial=0)) for r in out), default=0)
        return cls(np.stack([r[:, : max(width, 1)] for r in out]), page_size)

    def adjacent_overlap(self, context_tokens: int) -> float:
        """The share of a token's selected pages that the next token selects too, averaged
        over layers and the adjacent pairs from `context_tokens` on (`SelectionModel`'s
        figure, measured)."""
        if not 0 <= context_tokens < self.tokens - 1:
            raise ValueError(
                f"context_tokens = {context_tokens}: allowed 0 to {self.tokens - 2} (two tokens "
                "after it recorded)"
            )
        total, pairs = 0.0, 0
        for layer in self.sel:
            rows = layer[context_tokens:]
            for at in range(0, rows.shape[0] - 1, 4096):  # (bounded memory a chunk)
                a = _distinct(rows[at : at + 4096])
                b = _distinct(rows[at + 1 : at + 4097])[: a.shape[0]]
                a = a[: b.shape[0]]
                # Rows hold distinct ids: an id in both sits twice, side by side, once sorted.
                c = np.sort(np.concatenate([a, b], axis=1), axis=1)
                both = ((c[:, 1:] == c[:, :-1]) & (c[:, 1:] >= 0)).sum(axis=1)
                size = (a >= 0).sum(axis=1)
                named = size > 0
                total += float((both[named] / size[named]).sum())
                pairs += int(named.sum())
        return total / pairs if pairs else 0.0

    @property
    def tokens(self) -> int:
        return int(self.sel.shape[1])

    def covers(self, prefix_tokens: int, suffix_tokens: int) -> bool:
        """Whether the recording is long enough for this prefix and suffix."""
        return prefix_tokens + suffix_tokens <= self.tokens

    def prefix_union(self, prefix_tokens: int, suffix_tokens: int) -> float:
        """Prefix pages a layer's selections over the suffix name, averaged over layers."""
        return float(self.page_probs(prefix_tokens, suffix_tokens).sum())

    def layer_union(self, layer: int, prefix_tokens: int, suffix_tokens: int) -> np.ndarray:
        """The prefix pages (ascending) layer `layer`'s selections over the suffix named (a
        model of more layers than recorded reads them round again)."""
        self.page_probs(prefix_tokens, suffix_tokens)  # (checks the lengths)
        pages = -(-prefix_tokens // self.page_size)
        r = self.sel[layer % self.sel.shape[0], prefix_tokens : prefix_tokens + suffix_tokens]
        return np.unique(r[(r >= 0) & (r < pages)]).astype(np.int64)

    def page_probs(self, prefix_tokens: int, suffix_tokens: int) -> np.ndarray:
        """Per prefix page, the share of layers whose selections over the suffix name it."""
        if not self.covers(prefix_tokens, suffix_tokens):
            raise ValueError(
                f"prefix_tokens + suffix_tokens = {prefix_tokens + suffix_tokens}: allowed "
                f"<= the {self.tokens} tokens recorded"
            )
        pages = -(-prefix_tokens // self.page_size)
        rows = self.sel[:, prefix_tokens : prefix_tokens + suffix_tokens, :]
        hits = np.zeros(pages)
        for r in rows.reshape(rows.shape[0], -1):
            hits[np.unique(r[(r >= 0) & (r < pages)])] += 1
        return hits / rows.shape[0]
