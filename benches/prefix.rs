//! The prefix cache's serve loop in Rust alone (issue 5), on a synthetic stream of the peers'
//! shape: 100 shared prompts of 256-1024 tokens with Zipf(1.1) popularity, each sequence
//! 512-4096 tokens with a unique suffix. Pool: 25 % of the tokens a fill of 500 sequences
//! caches; 32 requests stay locked. `sparsetier bench prefix` runs the same loop on the exact
//! peer stream (`serve.rust_alone`).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use sparsetier::radix::bench::{fill, serve};
use sparsetier::testing::XorShift;

fn stream(n: usize, seed: u64, page_size: usize) -> Vec<Vec<u32>> {
    let mut rng = XorShift::new(0x5EED_0000 + 1);
    let prompts: Vec<Vec<u32>> = (0..100)
        .map(|_| {
            let len = 256 + rng.below(769) as usize;
            (0..len).map(|_| 1 + rng.below(31_999) as u32).collect()
        })
        .collect();
    let weights: Vec<f64> = (1..=100).map(|r| 1.0 / (r as f64).powf(1.1)).collect();
    let total: f64 = weights.iter().sum();
    let mut rng = XorShift::new(0x5EED_0000 + seed * 7919);
    (0..n)
        .map(|_| {
            let mut u = rng.unit() * total;
            let pid = weights.iter().position(|w| {
                u -= w;
                u <= 0.0
            });
            let prompt = &prompts[pid.unwrap_or(99)];
            let len = 512 + rng.below(3585) as usize;
            let suffix = len.saturating_sub(prompt.len()).max(16);
            let mut s = prompt.clone();
            s.extend((0..suffix).map(|_| 1 + rng.below(31_999) as u32));
            s.truncate(s.len() / page_size * page_size);
            s
        })
        .collect()
}

fn serve_loop(c: &mut Criterion) {
    let mut group = c.benchmark_group("prefix_serve");
    group.sample_size(10);
    for ps in [1usize, 16] {
        let cached = fill(&stream(500, 1, ps), ps).unwrap();
        let reqs = stream(500, 3, ps);
        let cap = (cached / 4 / ps) as u32;
        group.throughput(Throughput::Elements(reqs.len() as u64));
        group.bench_function(BenchmarkId::new("page", ps), |b| {
            b.iter(|| serve(&reqs, ps, cap, 32).unwrap())
        });
    }
    group.finish();
}

fn match_requery(c: &mut Criterion) {
    use sparsetier::radix::{HiCache, HiCacheConfig};
    let mut group = c.benchmark_group("prefix_match_requery");
    for ps in [1usize, 16] {
        let seqs = stream(500, 1, ps);
        let total: usize = seqs.iter().map(|s| s.len() / ps).sum();
        let cfg = HiCacheConfig {
            page_size: ps,
            device_pages: total as u32 + 1,
            device_reserve: 0,
            host_pages: 0,
            host_reserve: 0,
            drop_unbacked: true,
        };
        let mut cache = HiCache::new(cfg, Vec::new(), None).unwrap();
        for s in &seqs {
            let m = cache.match_prefix(0, s);
            let mut pages = m.device_pages;
            pages.extend(
                cache
                    .alloc_device(s.len() / ps - m.device_len / ps)
                    .unwrap(),
            );
            cache.insert(0, s, &pages).unwrap();
        }
        let queries = &seqs[..300];
        group.throughput(Throughput::Elements(queries.len() as u64));
        group.bench_function(BenchmarkId::new("page", ps), |b| {
            b.iter(|| {
                for q in queries {
                    std::hint::black_box(cache.match_prefix(0, q));
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, serve_loop, match_requery);
criterion_main!(benches);
