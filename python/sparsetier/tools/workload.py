"""The shared-prefix workload: N sequences over M shared system prompts with Zipf popularity,
each with a unique random suffix, optionally multi-turn follow-ups that extend an earlier
sequence.

It follows the generator of the peer benchmarks' `workload.py` (in `--peers-dir`) call for call
(same numpy calls in the same order, same seeds), so the streams are identical to the ones the
peer benchmarks run on, and a stream dumped there (`--dump FILE.npz`) can be replayed with
`load_stream`."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparsetier._checks import count, describe, real
from sparsetier.errors import ConfigError


@dataclass(frozen=True)
class WorkloadSpec:
    num_seqs: int = 10_000
    num_prompts: int = 100
    zipf_a: float = 1.1
    min_len: int = 512
    max_len: int = 4096
    sys_min: int = 256
    sys_max: int = 1024
    followup_frac: float = 0.0
    vocab: int = 32_000
    seed: int = 0
    align: int = 1

    def __post_init__(self) -> None:
        # Refused here, not by numpy mid-stream (or not at all: a float length read as another,
        # a NaN fraction as 0, an align of 0 as 1, min_len > max_len swapped into a ValueError).
        count("num_seqs", self.num_seqs)
        count("num_prompts", self.num_prompts, 1)
        real("zipf_a", self.zipf_a)
        count("max_len", self.max_len, count("min_len", self.min_len))
        count("sys_max", self.sys_max, count("sys_min", self.sys_min))
        real("followup_frac", self.followup_frac, 0.0, 1.0)
        count("vocab", self.vocab, 2)  # token ids are drawn from [1, vocab)
        count("seed", self.seed)
        count("align", self.align, 1)


def zipf_probs(n: int, a: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** a
    return w / w.sum()


class Workload:
    def __init__(self, spec: WorkloadSpec):
        if not isinstance(spec, WorkloadSpec):
            raise ConfigError.of("spec", describe(spec), "a WorkloadSpec")
        self.spec = spec
        rng = np.random.default_rng(spec.seed)
        lens = rng.integers(spec.sys_min, spec.sys_max + 1, size=spec.num_prompts)
        self.prompts = [rng.integers(1, spec.vocab, size=int(n), dtype=np.int64) for n in lens]
        self.probs = zipf_probs(spec.num_prompts, spec.zipf_a)

    def stream(self, n: int, stream_seed: int) -> Iterator[tuple[int, np.ndarray]]:
        """Yields (prompt id or -1 for a follow-up, int64 tokens) for n sequences."""
        spec = self.spec
        n, stream_seed = count("n", n), count("stream_seed", stream_seed)
        rng = np.random.default_rng([spec.seed, stream_seed])
        prev: list[np.ndarray] = []
        pids = rng.choice(spec.num_prompts, size=n, p=self.probs)
        lens = rng.integers(spec.min_len, spec.max_len + 1, size=n)
        followup = rng.random(n) < spec.followup_frac
        for i in range(n):
            if followup[i] and prev:
                base = prev[int(rng.integers(0, len(prev)))]
                extra = int(rng.integers(64, 1024))
                toks = np.concatenate(
                    [base, rng.integers(1, spec.vocab, size=extra, dtype=np.int64)]
                )
                pid = -1
            else:
                pid = int(pids[i])
                prompt = self.prompts[pid]
                suffix = max(16, int(lens[i]) - len(prompt))
                toks = np.concatenate(
                    [prompt, rng.integers(1, spec.vocab, size=suffix, dtype=np.int64)]
                )
            if spec.align > 1:
                toks = toks[: len(toks) // spec.align * spec.align]
            prev.append(toks)
            yield pid, toks


def load_stream(path: str) -> list[np.ndarray]:
    """Sequences of a stream dumped by the peers' `workload.py --dump FILE.npz`."""
    z = np.load(path)
    if not isinstance(z, np.lib.npyio.NpzFile) or not {"tokens", "offsets"} <= set(z.files):
        got = sorted(z.files) if isinstance(z, np.lib.npyio.NpzFile) else describe(z)
        raise ConfigError.of("path", f"{path} ({got})", "an .npz with tokens and offsets")
    with z:
        tokens, offsets = z["tokens"], z["offsets"]
    # Offsets that do not cut the tokens exactly would be sliced into short or empty sequences.
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ConfigError.of("tokens", describe(tokens), "1-D integer token ids")
    cuts = offsets.ndim == 1 and offsets.dtype.kind in "iu" and len(offsets) > 0
    if not (cuts and offsets[0] == 0 and offsets[-1] == len(tokens)
            and (np.diff(offsets) >= 0).all()):  # fmt: skip
        allowed = f"1-D integers from 0 up to len(tokens) = {len(tokens)}, never decreasing"
        raise ConfigError.of("offsets", describe(offsets), allowed)
    return [tokens[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


#: The token containers the benchmarks can feed: ``q`` is ``array('q')`` (SGLang's own), then
#: numpy int64 (this generator's), numpy uint32 (sparsetier's tree width) and a Python list.
TOKEN_TYPES = ("q", "numpy", "uint32", "list")


def as_tokens(kind: str, toks: np.ndarray) -> Any:
    """`toks` in the container `kind` (one of :data:`TOKEN_TYPES`)."""
    if kind not in TOKEN_TYPES:
        raise ConfigError.of("kind", repr(kind), " or ".join(TOKEN_TYPES))
    toks = np.asarray(toks)
    # Converted, floats would be truncated and ids past the container's range wrapped around.
    if toks.ndim != 1 or (toks.size and toks.dtype.kind not in "iu"):  # ([] is float64)
        raise ConfigError.of("toks", describe(toks), "1-D integer token ids")
    info = np.iinfo(np.uint32 if kind == "uint32" else np.int64)
    if toks.size and (int(toks.min()) < info.min or int(toks.max()) > info.max):
        bad = int(toks.min()) if int(toks.min()) < info.min else int(toks.max())
        raise ConfigError.of("toks", f"a token id {bad}", f"ids in [{info.min}, {info.max}]")
    if kind == "q":
        a = array("q")
        a.frombytes(np.ascontiguousarray(toks, dtype=np.int64).tobytes())
        return a
    if kind == "numpy":
        return np.ascontiguousarray(toks, dtype=np.int64)
    if kind == "uint32":
        return np.ascontiguousarray(toks, dtype=np.uint32)
    return toks.tolist()  # "list"
