//! Batch alloc/free of the page allocator, for batches of 1, 64 and 4096 pages.
//! Target (issue 2): under 20 ns per page for the 4096 batch. Throughput is in pages, so
//! criterion prints pages/s; ns per page is its reciprocal.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use sparsetier::alloc::PageAllocator;
use std::hint::black_box;

fn alloc_free(c: &mut Criterion) {
    let mut group = c.benchmark_group("alloc_free");
    for n in [1usize, 64, 4096] {
        let mut alloc = PageAllocator::new(1 << 16, 1).unwrap();
        let mut pages = Vec::with_capacity(n);
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter(|| {
                pages.clear();
                alloc.alloc_into(black_box(n), &mut pages).unwrap();
                alloc.free(black_box(&pages)).unwrap();
            })
        });
    }
    group.finish();

    // Baseline, same run: moving n page ids out of a Vec stack and back with no ownership
    // checks. RESULTS.md reports alloc_free as a ratio to it.
    let mut group = c.benchmark_group("baseline_stack_move");
    for n in [1usize, 64, 4096] {
        let mut stack: Vec<u32> = (0..1u32 << 16).collect();
        let mut out: Vec<u32> = Vec::with_capacity(n);
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter(|| {
                let start = stack.len() - black_box(n);
                out.clear();
                out.extend(stack.drain(start..).rev());
                stack.extend_from_slice(black_box(&out));
            })
        });
    }
    group.finish();
}

criterion_group!(benches, alloc_free);
criterion_main!(benches);
