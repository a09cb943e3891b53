"""Prometheus metrics of a decode runtime: the scheduler's cumulative counters (seed 002's
record, counted in Rust), the prefix tier's, and histograms of step and prefill latency folded
as they arrive. Memory stays constant however long the process runs; serving operators scrape
it in the text format (`DecodeRuntime.metrics_text()`, or `registry` with
`prometheus_client.start_http_server`). Needs `prometheus-client` (`pip install
sparsetier[metrics]`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sparsetier._checks import describe
from sparsetier.errors import ConfigError
from sparsetier.tools.record import CPU_PARTS

if TYPE_CHECKING:
    from sparsetier.tools.runtime import DecodeRuntime

#: Scheduler totals exported as counters (name without the `sparsetier_` prefix: meaning).
COUNTERS = {
    "selected": "selection entries that named a page",
    "pages": "distinct (page, layer) objects planned",
    "ready": "objects found ready on the device",
    "loaded": "objects loaded from host",
    "joined": "objects joined while loading (in-flight reuse)",
    "bytes_needed": "bytes of the selected tokens",
    "bytes_transferred": "bytes loaded from host",
    "load_submissions": "load submissions",
    "backup_pages": "pages written through",
    "failed_loads": "failed loads",
    "retried_loads": "load retries",
    "failed_backups": "failed write-throughs",
    "failed_requests": "requests failed after a retry failed",
    "exposed_wait_ns": "nanoseconds attention waited for loads",
    "cpu_ns": "nanoseconds of CPU in the scheduler",
}
PREFIX = {
    "hits": "requests that matched a cached prefix",
    "device_hit_tokens": "tokens matched with Indexer-K on the device",
    "host_hit_tokens": "tokens matched and restored from host",
    "indexer_bytes_restored": "Indexer-K bytes restored",
    "prefix_kv_bytes_loaded": "main-KV bytes loaded for matched pages",
    "full_restore_bytes": "bytes a whole-prefix restore would have moved",
    "restores_failed": "failed Indexer-K restores",
    "pages_inserted": "pages inserted into the prefix tree",
}
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class RuntimeMetrics:
    """The runtime's registry: counters read from Rust at scrape time, latency histograms
    observed per step and per prefill."""

    def __init__(self, runtime: DecodeRuntime) -> None:
        from sparsetier.tools.runtime import DecodeRuntime  # (it imports this module)

        # Read only when scraped: anything else would fail there, far from this call.
        if not isinstance(runtime, DecodeRuntime):
            raise ConfigError.of("runtime", describe(runtime), "a DecodeRuntime")
        self.runtime = runtime
        self.registry = CollectorRegistry()
        self.step_seconds = Histogram(
            "sparsetier_decode_step_seconds", "wall time of one decode step (TPOT)",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.prefill_seconds = Histogram(
            "sparsetier_prefill_seconds", "wall time of one admission and prefill (TTFT)",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.registry.register(self)

    def collect(self):
        rt = self.runtime
        tot = rt.scheduler.totals()
        for k, doc in COUNTERS.items():
            c = CounterMetricFamily(f"sparsetier_{k}", doc)
            c.add_metric([], float(tot[k]))
            yield c
        parts = CounterMetricFamily(
            "sparsetier_cpu_part_ns", "nanoseconds of CPU in the scheduler, by part",
            labels=["part"],
        )  # fmt: skip
        for part in CPU_PARTS:
            parts.add_metric([part], float(tot[f"cpu_{part}_ns"]))
        yield parts
        steps = CounterMetricFamily("sparsetier_decode_steps", "decode steps run")
        steps.add_metric([], float(rt.steps))
        yield steps
        px = rt.prefix_stats() or {}
        for k, doc in PREFIX.items():
            c = CounterMetricFamily(f"sparsetier_prefix_{k}", doc)
            c.add_metric([], float(px.get(k, 0)))
            yield c
        s = rt.scheduler.stats()
        for k, doc in (
            ("device_used", "device slots held by objects"),
            ("device_capacity", "usable device slots"),
            ("pins", "pins held"),
            ("objects", "objects tracked"),
        ):
            g = GaugeMetricFamily(f"sparsetier_{k}", doc)
            g.add_metric([], float(s[k]))
            yield g
        g = GaugeMetricFamily("sparsetier_running_requests", "requests running")
        g.add_metric([], float(len(rt.requests)))
        yield g

    def text(self) -> str:
        return generate_latest(self.registry).decode()
