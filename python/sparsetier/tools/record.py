"""The scheduler's step record (counted in Rust, `StepScheduler.end_step()`) as Python code
reads it: the names it groups, and how its ratios print."""

from __future__ import annotations

#: The scheduler's CPU by part: a record's `cpu_<part>_ns`. The first five are the calls (they
#: sum to `cpu_ns`, exposed wait excluded); then, inside `plan`, the selection's rows, the
#: directory's resolve and the load's submission, and prefetch (issued by `plan` and
#: `end_step`).
CPU_PARTS = (
    "plan", "ready", "finish", "append", "end_step", "rows", "resolve", "submit", "prefetch",
)  # fmt: skip


def fmt_ratio(v: float | None, undefined: str) -> str:
    """A record ratio to three places, or "n/a (why)" where the record has none (its
    denominator was 0: read amplification of a step that moved nothing)."""
    return f"n/a ({undefined})" if v is None else f"{v:.3f}"
