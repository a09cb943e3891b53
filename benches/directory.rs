//! Residency directory benches (issue 3): `resolve` of 64, 2048 and 16384 keys at 100%, 90%
//! and 50% device hits; `complete` and `release`; resolve under eviction pressure.
//! Throughput is in keys, so criterion prints keys/s. Target: under 50 ns per key for the
//! 16384-key batch at 90% hits. Workloads live in `sparsetier::directory::bench`, shared with
//! the Python benchmark.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use sparsetier::directory::bench::{time_complete_release, PressureWorkload, ResolveWorkload};

fn resolve(c: &mut Criterion) {
    let mut group = c.benchmark_group("resolve");
    for batch in [64usize, 2048, 16384] {
        for hit in [1.0, 0.9, 0.5] {
            let w = ResolveWorkload::new(batch, hit).unwrap();
            group.throughput(Throughput::Elements(batch as u64));
            let id = BenchmarkId::new(format!("hit{:.0}", hit * 100.0), batch);
            group.bench_function(id, |b| b.iter_custom(|iters| w.time_resolves(iters)));
        }
    }
    group.finish();
}

fn complete_release(c: &mut Criterion) {
    let mut group = c.benchmark_group("complete_release");
    for batch in [64usize, 2048, 16384] {
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_function(BenchmarkId::new("complete", batch), |b| {
            b.iter_custom(|iters| time_complete_release(batch, iters).unwrap().0)
        });
        group.bench_function(BenchmarkId::new("release", batch), |b| {
            b.iter_custom(|iters| time_complete_release(batch, iters).unwrap().1)
        });
    }
    group.finish();
}

fn pressure(c: &mut Criterion) {
    let mut group = c.benchmark_group("resolve_evicting");
    for batch in [64usize, 2048, 16384] {
        let w = PressureWorkload::new(batch).unwrap();
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_function(BenchmarkId::from_parameter(batch), |b| {
            b.iter_custom(|iters| w.time_resolves(iters))
        });
    }
    group.finish();
}

criterion_group!(benches, resolve, complete_release, pressure);
criterion_main!(benches);
