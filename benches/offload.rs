//! The offload directory alone (`sparsetier::offload::bench`): whole requests of vLLM's
//! connector calls over a 64k-token stream with shared prefixes and eviction, per policy.
//! `sparsetier bench vllm` times the same calls through Python against vLLM's own manager.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use sparsetier::offload::bench::{RequestStream, StreamShape};
use sparsetier::offload::PolicyKind;
use std::time::Duration;

fn requests(c: &mut Criterion) {
    let mut group = c.benchmark_group("offload_request");
    group.sample_size(20);
    let shape = StreamShape::default();
    group.throughput(Throughput::Elements(shape.blocks as u64));
    for (name, policy) in [("lru", PolicyKind::Lru), ("arc", PolicyKind::Arc)] {
        let mut stream = RequestStream::new(shape, 400, policy);
        for _ in 0..20 {
            stream.serve(); // the pool fills and starts evicting
        }
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    if stream.left() == 0 {
                        stream = RequestStream::new(shape, 400, policy);
                        for _ in 0..20 {
                            stream.serve();
                        }
                    }
                    let t = stream.serve();
                    total += t.lookup + t.load + t.store;
                }
                total
            })
        });
    }
    group.finish();
}

criterion_group!(benches, requests);
criterion_main!(benches);
