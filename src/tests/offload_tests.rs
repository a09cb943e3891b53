//! Examples of the offload directory (vLLM's `CPUOffloadingManager` scenarios, replayed in
//! Rust) and of the block mover on the cpu engine over real buffers.

use super::*;
use crate::transfer::{CpuEngine, Direction, MemoryKind};
use std::sync::Arc;

/// vLLM's test keys: the decimal digits of `i`, then group 0.
fn key(i: u32) -> Vec<u8> {
    key_in(i, 0)
}

fn key_in(i: u32, group: u32) -> Vec<u8> {
    let mut k = i.to_string().into_bytes();
    k.extend_from_slice(&group.to_be_bytes());
    k
}

fn keys(ids: &[u32]) -> Vec<Vec<u8>> {
    ids.iter().map(|&i| key(i)).collect()
}

fn refs(k: &[Vec<u8>]) -> Vec<&[u8]> {
    k.iter().map(Vec::as_slice).collect()
}

fn dir(num_chunks: u32, policy: PolicyKind, store_threshold: u32) -> ChunkDirectory {
    ChunkDirectory::new(DirectoryConfig {
        num_chunks,
        policy,
        store_threshold,
        max_tracker_size: 64_000,
        events: true,
    })
}

/// A request context of the tests: one ref, kept across calls as a context keeps it.
#[derive(Default)]
struct Ctx(Option<RequestRef>);

impl Ctx {
    fn store(&mut self, d: &mut ChunkDirectory, ids: &[u32]) -> Option<StoreOutcome> {
        self.store_at(d, ids, &vec![None; ids.len()])
    }

    fn store_at(
        &mut self,
        d: &mut ChunkDirectory,
        ids: &[u32],
        pos: &[Option<i64>],
    ) -> Option<StoreOutcome> {
        let k = keys(ids);
        let (r, out) = d.prepare_store(self.0, &refs(&k), pos).unwrap();
        self.0 = Some(r);
        d.validate().unwrap();
        out
    }

    fn load(&mut self, d: &mut ChunkDirectory, ids: &[u32]) -> Vec<u32> {
        let k = keys(ids);
        let (r, chunks) = d
            .prepare_load(self.0, &refs(&k), &vec![None; ids.len()])
            .unwrap();
        self.0 = Some(r);
        d.validate().unwrap();
        chunks.into_iter().map(|c| c.0).collect()
    }
}

fn complete(d: &mut ChunkDirectory, ids: &[u32], ok: bool) {
    let k = keys(ids);
    d.complete_store(&refs(&k), ok);
    d.validate().unwrap();
}

fn unpin(d: &mut ChunkDirectory, ids: &[u32]) {
    let k = keys(ids);
    d.complete_load(&refs(&k)).unwrap();
    d.validate().unwrap();
}

fn evicted(out: &StoreOutcome) -> Vec<Vec<u8>> {
    out.evicted.iter().map(|k| k.to_vec()).collect()
}

fn chunk_ids(out: &StoreOutcome) -> Vec<u32> {
    out.chunks.iter().map(|c| c.0).collect()
}

#[test]
fn the_lru_scenario_of_vllms_manager_test() {
    let mut d = dir(4, PolicyKind::Lru, 0);
    let mut empty = Ctx::default();
    let out = empty.store(&mut d, &[1, 2]).unwrap();
    assert_eq!(
        (out.stored.clone(), chunk_ids(&out)),
        (vec![0, 1], vec![0, 1])
    );
    assert_eq!(d.lookup(&key(1)), Lookup::HitPending);
    complete(&mut d, &[1, 2], true);
    assert_eq!(d.lookup(&key(1)), Lookup::Hit);
    assert_eq!(d.lookup(&key(3)), Lookup::Miss);

    let out = empty.store(&mut d, &[2, 3, 4, 5]).unwrap();
    assert_eq!(out.stored, vec![1, 2, 3], "2 is stored already");
    assert_eq!(chunk_ids(&out), vec![2, 3, 0]);
    assert_eq!(evicted(&out), keys(&[1]));
    assert_eq!(
        empty.store(&mut d, &[1, 6]),
        None,
        "no room: 2 ready, 3-5 pending"
    );
    complete(&mut d, &[2, 3, 4, 5], true);

    let mut load = Ctx::default();
    assert_eq!(load.load(&mut d, &[2, 3]), vec![1, 2]);
    assert_eq!(empty.store(&mut d, &[6, 7, 8]), None, "2 and 3 are pinned");
    unpin(&mut d, &[2, 3]);
    d.finish_request(load.0.unwrap(), &[]);
    d.validate().unwrap();
    // The loaded prefix [2, 3] is recent, its tail less so than its head.
    let out = empty.store(&mut d, &[6, 7, 8]).unwrap();
    assert_eq!(evicted(&out), keys(&[4, 5, 3]));
    assert_eq!(chunk_ids(&out), vec![2, 0, 3]);
    complete(&mut d, &[6, 7, 8], true);
    let k = keys(&[2, 6, 7]);
    d.touch(&refs(&k));
    let out = empty.store(&mut d, &[9]).unwrap();
    assert_eq!(evicted(&out), keys(&[8]));
    complete(&mut d, &[7, 9], false);
    assert_eq!(d.lookup(&key(7)), Lookup::Hit);
    assert_eq!(d.lookup(&key(9)), Lookup::Miss);

    let ev = d.take_events().unwrap();
    let flat: Vec<(bool, bool, usize)> = ev
        .iter()
        .map(|e| (e.removed, e.metadata_only, e.keys.len()))
        .collect();
    assert_eq!(
        flat,
        vec![
            (false, false, 2),
            (true, false, 1),
            (false, false, 3),
            (true, false, 3),
            (false, false, 3),
            (true, false, 1),
            (true, true, 1),
        ]
    );
    assert_eq!(d.take_events().unwrap(), vec![], "drained once");
}

#[test]
fn positioned_keys_of_a_running_request_evict_tail_first_across_groups() {
    let mut d = dir(4, PolicyKind::Lru, 0);
    let k = vec![key_in(1, 0), key_in(2, 0), key_in(1, 1), key_in(2, 1)];
    let pos = [Some(16), Some(32), Some(16), Some(32)];
    let (r, out) = d.prepare_store(None, &refs(&k), &pos).unwrap();
    assert_eq!(out.unwrap().stored.len(), 4);
    d.complete_store(&refs(&k), true);
    let positions: Vec<(&[u8], i64)> = k.iter().map(Vec::as_slice).zip([16, 32, 16, 32]).collect();
    d.finish_request(r, &positions);
    let mut other = Ctx::default();
    let out = other.store(&mut d, &[10, 11]).unwrap();
    let mut ev = evicted(&out);
    ev.sort();
    let mut tails = vec![key_in(2, 0), key_in(2, 1)];
    tails.sort();
    assert_eq!(ev, tails);
}

#[test]
fn a_store_threshold_stores_keys_offered_that_many_times() {
    let mut d = ChunkDirectory::new(DirectoryConfig {
        num_chunks: 4,
        policy: PolicyKind::Lru,
        store_threshold: 2,
        max_tracker_size: 3,
        events: false,
    });
    let mut c = Ctx::default();
    assert_eq!(
        c.store(&mut d, &[1, 2]).unwrap().stored,
        Vec::<usize>::new()
    );
    assert_eq!(d.tracked_count(&key(1)), Some(1));
    assert_eq!(c.store(&mut d, &[1, 2]).unwrap().stored, vec![0, 1]);
    complete(&mut d, &[1, 2], true);
    assert_eq!(
        c.store(&mut d, &[3, 4]).unwrap().stored,
        Vec::<usize>::new()
    );
    assert_eq!(d.tracked_count(&key(1)), None, "pushed out of the tracker");
    assert_eq!(d.take_stats().stores_skipped, Some(4));
    assert_eq!(d.take_stats().stores_skipped, Some(0));
}

#[test]
fn arc_promotes_reused_keys_and_evicts_from_t1_first() {
    let mut d = dir(4, PolicyKind::Arc, 0);
    let mut c = Ctx::default();
    c.store(&mut d, &[1, 2, 3, 4]).unwrap();
    complete(&mut d, &[1, 2, 3, 4], true);
    let k = keys(&[3, 4]);
    d.touch(&refs(&k)); // T1 = [1, 2], T2 = [3, 4]
    let out = c.store(&mut d, &[5]).unwrap();
    assert_eq!(evicted(&out), keys(&[1]));
    complete(&mut d, &[5], true);
    // A ghost hit on 1 raises T1's target.
    let before = d.arc_target().unwrap();
    let k = keys(&[1]);
    d.touch(&refs(&k));
    assert!(d.arc_target().unwrap() > before);
}

#[test]
fn protocol_violations_are_refused_before_anything_changes() {
    let mut d = dir(4, PolicyKind::Lru, 0);
    let mut c = Ctx::default();
    c.store(&mut d, &[1]).unwrap();
    let k = keys(&[1]);
    let e = d.prepare_load(None, &refs(&k), &[None]).unwrap_err();
    assert!(
        matches!(e, crate::Error::InvalidTransition { op: "load", .. }),
        "{e}"
    );
    let k = keys(&[7]);
    let e = d.prepare_load(None, &refs(&k), &[None]).unwrap_err();
    assert!(matches!(e, crate::Error::NotResident { .. }), "{e}");
    complete(&mut d, &[1], true);
    let k = keys(&[1]);
    assert!(d.complete_load(&refs(&k)).is_err(), "never pinned");
    let k = keys(&[2, 2]);
    assert!(matches!(
        d.prepare_store(None, &refs(&k), &[None, None]),
        Err(crate::Error::Config { .. })
    ));
    let short: [&[u8]; 1] = [b"ab"];
    assert!(
        d.prepare_store(None, &short, &[None]).is_err(),
        "no group index"
    );
    // A finished request may not touch new keys.
    let r = c.0.unwrap();
    d.finish_request(r, &[]);
    let k = keys(&[3]);
    assert!(d.prepare_store(Some(r), &refs(&k), &[None]).is_err());
    assert_eq!(d.lookup(&key(3)), Lookup::Miss);
    d.validate().unwrap();
}

#[test]
fn reset_forgets_chunks_and_request_records_read_as_new() {
    let mut d = dir(2, PolicyKind::Lru, 0);
    let mut c = Ctx::default();
    c.store(&mut d, &[1, 2]).unwrap();
    d.reset();
    d.validate().unwrap();
    assert_eq!(d.lookup(&key(1)), Lookup::Miss);
    assert_eq!(chunk_ids(&c.store(&mut d, &[3]).unwrap()), vec![0]);
    // Completing a store from before the reset finds nothing in flight.
    complete(&mut d, &[1], true);
    assert_eq!(d.lookup(&key(1)), Lookup::Miss);
    d.release_request(c.0.unwrap());
    d.validate().unwrap();
    assert_eq!(d.live_requests(), 0);
}

// ---- the mover ----

struct Buffers {
    dev: Vec<Vec<u8>>,
    host: Vec<Vec<u8>>,
}

const BLOCKS: u32 = 16;
const CHUNKS: u32 = 8;

/// Two groups as DeepSeek-V3.2 has them (a wide MLA page, a narrow indexer page), two layers
/// each, 3 blocks a chunk; the first MLA tensor's page is padded past what is copied.
fn mover(bpc: u32, engine: Arc<dyn crate::transfer::CopyEngine>) -> (BlockMover, Buffers) {
    let pages = [96u64, 80, 24, 24];
    let mut dev: Vec<Vec<u8>> = pages
        .iter()
        .map(|&p| vec![0u8; (p * u64::from(BLOCKS)) as usize])
        .collect();
    let mut host: Vec<Vec<u8>> = pages
        .iter()
        .map(|&p| vec![0u8; (p * u64::from(bpc * CHUNKS)) as usize])
        .collect();
    for (t, buf) in dev.iter_mut().enumerate() {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i * 7 + t * 31 + 1) as u8;
        }
    }
    let tensors = pages
        .iter()
        .enumerate()
        .map(|(t, &p)| BlockTensor {
            device_base: dev[t].as_mut_ptr() as u64,
            device_len: dev[t].len() as u64,
            blocks: BLOCKS,
            block_stride: p,
            device_kind: MemoryKind::Host,
            ordinal: None,
            host_base: host[t].as_mut_ptr() as u64,
            host_len: host[t].len() as u64,
            page_bytes: p,
        })
        .collect();
    let groups = vec![
        vec![
            Ref {
                tensor: 0,
                bytes: 88,
            },
            Ref {
                tensor: 1,
                bytes: 80,
            },
            Ref {
                tensor: 1,
                bytes: 80,
            },
        ],
        vec![
            Ref {
                tensor: 2,
                bytes: 24,
            },
            Ref {
                tensor: 3,
                bytes: 24,
            },
        ],
    ];
    // SAFETY: the buffers are returned beside the mover, and every test drops the mover
    // (which waits for its jobs) before them; nothing else writes them during a job.
    let m = unsafe { BlockMover::new(tensors, groups, bpc, CHUNKS, Arc::clone(&engine), engine) }
        .unwrap();
    (m, Buffers { dev, host })
}

fn wait_one(m: &mut BlockMover) -> JobOutcome {
    for ev in m.all_events() {
        let _ = ev.wait_all(None);
    }
    let mut f = m.finished();
    assert_eq!(f.len(), 1, "{f:?}");
    f.remove(0)
}

#[test]
fn a_store_and_a_load_move_each_groups_blocks_through_partial_chunks() {
    let engine: Arc<dyn crate::transfer::CopyEngine> = Arc::new(CpuEngine::new(2).unwrap());
    let bpc = 3;
    let (mut m, mut buf) = mover(bpc, engine);
    // Group 0: blocks 5, 9, 2 at request index 1 (skipping one block of chunk 4, then chunk
    // 6); group 1: block 7 at index 3 (chunk 1's first block).
    let spec = JobSpec {
        direction: Direction::Backup,
        blocks: vec![5, 9, 2, 7],
        group_sizes: vec![3, 1],
        block_indices: vec![1, 3],
        chunks: vec![4, 6, 1],
    };
    let pairs = m.pairs(&spec).unwrap();
    assert_eq!(pairs[0], (vec![5, 9, 2], vec![13, 14, 18]));
    assert_eq!(pairs[1], (vec![7], vec![3]));
    m.submit(1, &spec, false).unwrap();
    let out = wait_one(&mut m);
    assert!(out.success, "{out:?}");
    assert_eq!(
        out.bytes,
        3 * (88 + 80) + 24 * 2,
        "the aliased ref is copied once"
    );
    let page = |t: usize| [96usize, 80, 24, 24][t];
    let used = |t: usize| [88usize, 80, 24, 24][t];
    for (g, (dev, host)) in pairs.iter().enumerate() {
        let ts: &[usize] = if g == 0 { &[0, 1] } else { &[2, 3] };
        for &t in ts {
            for (&d, &h) in dev.iter().zip(host) {
                let (d, h) = (d as usize * page(t), h as usize * page(t));
                assert_eq!(
                    buf.host[t][h..h + used(t)],
                    buf.dev[t][d..d + used(t)],
                    "tensor {t}"
                );
                assert!(
                    buf.host[t][h + used(t)..h + page(t)]
                        .iter()
                        .all(|&b| b == 0),
                    "padding is not copied"
                );
            }
        }
    }
    // Load them back into other blocks.
    for t in 0..4 {
        buf.dev[t].iter_mut().for_each(|b| *b = 0);
    }
    let back = JobSpec {
        direction: Direction::Load,
        blocks: vec![0, 1, 3, 4],
        ..spec.clone()
    };
    m.submit(2, &back, true).unwrap();
    assert!(wait_one(&mut m).success);
    let p0 = page(0);
    assert_eq!(
        buf.dev[0][p0..p0 + 88],
        buf.host[0][14 * p0..14 * p0 + 88],
        "block 1 holds chunk 4's last block"
    );
    m.shutdown();
    drop(m);
    drop(buf);
}

#[test]
fn a_failed_copy_is_a_failed_job_and_bad_specs_are_refused() {
    let cpu = Arc::new(CpuEngine::new(1).unwrap());
    cpu.inject(crate::transfer::Fault {
        nth: 0,
        layer: None,
        action: crate::transfer::FaultAction::Fail("injected".into()),
    });
    let engine: Arc<dyn crate::transfer::CopyEngine> = cpu;
    let (mut m, buf) = mover(1, engine);
    let spec = JobSpec {
        direction: Direction::Backup,
        blocks: vec![1, 2],
        group_sizes: vec![1, 1],
        block_indices: vec![0, 0],
        chunks: vec![0, 1],
    };
    m.submit(7, &spec, false).unwrap();
    let out = wait_one(&mut m);
    assert!(
        !out.success && out.error.as_deref().unwrap().contains("injected"),
        "{out:?}"
    );
    for bad in [
        JobSpec {
            group_sizes: vec![2],
            ..spec.clone()
        },
        JobSpec {
            group_sizes: vec![2, 1],
            ..spec.clone()
        },
        JobSpec {
            blocks: vec![1, BLOCKS as i64],
            ..spec.clone()
        },
        JobSpec {
            chunks: vec![0, CHUNKS as i64],
            ..spec.clone()
        },
        JobSpec {
            chunks: vec![0],
            ..spec.clone()
        },
        JobSpec {
            chunks: vec![0, 1, 2],
            ..spec.clone()
        },
    ] {
        assert!(m.submit(8, &bad, false).is_err(), "{bad:?}");
    }
    assert_eq!(m.pending(), 0, "nothing was submitted");
    m.submit(9, &spec, false).unwrap();
    assert!(m.submit(9, &spec, false).is_err(), "a job id in flight");
    assert!(wait_one(&mut m).success, "the engine serves on");
    drop(m);
    drop(buf);
}

/// The bench's stream, served and checked (`cargo test -- --ignored offload_stream_phases
/// --nocapture` prints the phases' times).
#[test]
fn the_bench_stream_serves_and_stays_valid() {
    use crate::offload::bench::{RequestStream, StreamShape};
    let shape = StreamShape {
        blocks: 64,
        prefix_blocks: 40,
        prefixes: 4,
        pool_requests: 3.0,
        step: 8,
        ..StreamShape::default()
    };
    for policy in [PolicyKind::Lru, PolicyKind::Arc] {
        let mut s = RequestStream::new(shape, 40, policy);
        while s.left() > 0 {
            s.serve();
            s.directory().validate().unwrap();
        }
        assert_eq!(s.directory().pinned(), 0);
    }
}

#[test]
#[ignore = "a timing printout, not a check"]
fn offload_stream_phases() {
    use crate::offload::bench::{RequestStream, StreamShape};
    let mut s = RequestStream::new(StreamShape::default(), 120, PolicyKind::Lru);
    let faults = || {
        // SAFETY: rusage is plain integers and timevals: all zeros is a valid value.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `u` is a valid rusage for getrusage to fill.
        unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
        u.ru_minflt
    };
    let f0 = faults();
    let (mut l, mut d, mut st) = (0.0, 0.0, 0.0);
    let reps = std::env::var("REPS").map_or(1, |r| r.parse().unwrap());
    for i in 0..120 * reps {
        if s.left() == 0 {
            s.restart();
        }
        let t = s.serve();
        if (20..120).contains(&i) {
            l += t.lookup.as_secs_f64();
            d += t.load.as_secs_f64();
            st += t.store.as_secs_f64();
        }
    }
    println!(
        "per request ms: lookup {:.3} load {:.3} store+finish {:.3}; minor faults {}",
        l * 10.0,
        d * 10.0,
        st * 10.0,
        faults() - f0
    );
}
