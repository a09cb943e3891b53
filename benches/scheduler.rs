//! The step scheduler's decode step (issue 10), Rust half of `sparsetier bench decode`:
//! CPU time of one decode step (append, per layer plan + ready + finish, end_step) for the
//! whole batch. Throughput is in selection entries, so criterion prints entries/s.
//!
//! The default shape is small enough for a criterion run; `SPARSETIER_BENCH_FULL=1` runs
//! DeepSeek-V3.2's shape (61 layers, batch 64, 32k-128k contexts, 25% budget, 32 blocks or
//! top-2048 tokens), which builds a directory of about five million objects first. The
//! `token_counted` case times the core's part of token mode with its tokens mapped to pages
//! outside the timer (`plan_counted`), as `sparsetier.token_map` does on the GPU.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sparsetier::scheduler::bench::{DecodeShape, DecodeWorkload};

fn decode_step(c: &mut Criterion) {
    let full = std::env::var_os("SPARSETIER_BENCH_FULL").is_some();
    let mut group = c.benchmark_group("decode_step");
    group.sample_size(10);
    for (mode, base) in [
        ("block", DecodeShape::deepseek_v32()),
        ("token", DecodeShape::deepseek_v32_tokens()),
        // Token rows mapped to counted page rows before the timer (the GPU's part).
        ("token_counted", DecodeShape::deepseek_v32_tokens_counted()),
    ] {
        let shape = if full {
            base
        } else {
            DecodeShape {
                layers: 8,
                batch: 16,
                context: (8 * 1024, 16 * 1024),
                ..base
            }
        };
        let mut w = DecodeWorkload::new(shape, 50_000).expect("workload");
        group.throughput(Throughput::Elements(w.lookups_per_step() as u64));
        let name = format!("{}_{mode}", if full { "deepseek_v32" } else { "small" });
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                // Each step appends a token to every request: a workload that has run the
                // steps its host pool holds is built again, untimed (criterion asks for more
                // iterations the faster a step is).
                if w.steps_left() < iters {
                    w = DecodeWorkload::new(shape, iters.max(50_000)).expect("workload");
                }
                w.run(iters).expect("step")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, decode_step);
criterion_main!(benches);
