"""Names in the scheduler's step record (counted in Rust, `StepScheduler.end_step()`) that
Python code groups."""

#: The scheduler's CPU by part: a record's `cpu_<part>_ns`. The first five are the calls (they
#: sum to `cpu_ns`, exposed wait excluded); then, inside `plan`, the selection's rows, the
#: directory's resolve and the load's submission, and prefetch (issued by `plan` and
#: `end_step`).
CPU_PARTS = (
    "plan", "ready", "finish", "append", "end_step", "rows", "resolve", "submit", "prefetch",
)  # fmt: skip
