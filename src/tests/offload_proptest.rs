//! State-machine test of [`ChunkDirectory`] against a reference model of residency: each key
//! absent, stored with its store in flight, or ready with its readers. The model decides
//! which keys an offer stores, whether it fits, what the lookups say and what a load pins;
//! the directory chooses which keys to evict, and the model checks each choice was allowed
//! (ready, unpinned, not offered) and that exactly the needed number went, then adopts it
//! (so the residency model lives beside the directory; the reference machine draws the steps
//! and keeps what does not depend on the directory's choices). Both policies, with
//! and without a store threshold's tracker, over several requests, resets and request ends.
//! After every step: `validate()` and every lookup against the model. (The eviction *order* is
//! vLLM's, and is checked against vLLM itself by `tests/test_vllm_manager.py`.)

use super::*;
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};
use std::collections::BTreeMap;

const KEYS: u32 = 12;
const CHUNKS: u32 = 5;
const REQUESTS: usize = 3;

fn key(i: u32) -> Vec<u8> {
    let mut k = vec![b'k', i as u8];
    k.extend_from_slice(&(i % 2).to_be_bytes());
    k
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Res {
    Storing,
    Ready(u32),
}

#[derive(Debug, Clone)]
enum Step {
    Store(usize, Vec<u32>),
    Complete(Vec<u32>, bool),
    /// Loads of ready keys, chosen when applied.
    Load(usize, Vec<usize>),
    /// Completions of pinned keys, chosen when applied.
    Unload(Vec<usize>),
    Touch(Vec<u32>),
    Finish(usize),
    Reset,
}

#[derive(Debug, Clone)]
struct Model {
    policy: PolicyKind,
    threshold: bool,
}

/// Keys of `keys` in state `want`, in key order.
fn with(keys: &BTreeMap<u32, Res>, want: impl Fn(Res) -> bool) -> Vec<u32> {
    keys.iter()
        .filter(|(_, &r)| want(r))
        .map(|(&k, _)| k)
        .collect()
}

/// The keys `picks` choose among `of` (by index, modulo), deduplicated, in pick order.
fn pick(of: &[u32], picks: &[usize]) -> Vec<u32> {
    let mut out = Vec::new();
    if of.is_empty() {
        return out;
    }
    for &p in picks {
        let k = of[p % of.len()];
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

fn subset(of: Vec<u32>) -> BoxedStrategy<Vec<u32>> {
    if of.is_empty() {
        return Just(Vec::new()).boxed();
    }
    proptest::sample::subsequence(of.clone(), 1..=of.len().min(4))
        .prop_shuffle()
        .boxed()
}

struct RefMachine;

impl ReferenceStateMachine for RefMachine {
    type State = Model;
    type Transition = Step;

    fn init_state() -> BoxedStrategy<Model> {
        (
            prop_oneof![Just(PolicyKind::Lru), Just(PolicyKind::Arc)],
            any::<bool>(),
        )
            .prop_map(|(policy, threshold)| Model { policy, threshold })
            .boxed()
    }

    fn transitions(_: &Model) -> BoxedStrategy<Step> {
        let all: Vec<u32> = (0..KEYS).collect();
        let picks = || prop::collection::vec(0usize..KEYS as usize, 1..4);
        prop_oneof![
            5 => (0..REQUESTS, subset(all.clone())).prop_map(|(r, k)| Step::Store(r, k)),
            4 => (subset(all.clone()), prop::bool::weighted(0.85))
                .prop_map(|(k, ok)| Step::Complete(k, ok)),
            3 => (0..REQUESTS, picks()).prop_map(|(r, k)| Step::Load(r, k)),
            3 => picks().prop_map(Step::Unload),
            1 => subset(all).prop_map(Step::Touch),
            1 => (0..REQUESTS).prop_map(Step::Finish),
            1 => Just(Step::Reset),
        ]
        .boxed()
    }

    fn apply(m: Model, _: &Step) -> Model {
        m
    }
}

struct Sut {
    d: ChunkDirectory,
    reqs: [Option<RequestRef>; REQUESTS],
    /// The model's view of residency, kept in step with the directory's choices.
    keys: BTreeMap<u32, Res>,
    /// Requests that finished: a finished request's context is gone, so the next access of
    /// its slot comes with a new one.
    finished: [bool; REQUESTS],
}

impl Sut {
    /// The request context of slot `r`: a new one after its request finished.
    fn context(&mut self, r: usize) -> Option<RequestRef> {
        if std::mem::take(&mut self.finished[r]) {
            if let Some(old) = self.reqs[r].take() {
                self.d.release_request(old);
            }
        }
        self.reqs[r]
    }
}

struct DirTest;

impl StateMachineTest for DirTest {
    type SystemUnderTest = Sut;
    type Reference = RefMachine;

    fn init_test(m: &Model) -> Sut {
        Sut {
            d: ChunkDirectory::new(DirectoryConfig {
                num_chunks: CHUNKS,
                policy: m.policy,
                store_threshold: if m.threshold { 2 } else { 0 },
                max_tracker_size: 6,
                events: true,
            }),
            reqs: [None; REQUESTS],
            keys: BTreeMap::new(),
            finished: [false; REQUESTS],
        }
    }

    fn apply(mut s: Sut, m: &Model, step: Step) -> Sut {
        let m = m.clone();
        let bytes = |k: &[u32]| k.iter().map(|&i| key(i)).collect::<Vec<_>>();
        match &step {
            Step::Store(r, k) => {
                let b = bytes(k);
                let refs: Vec<&[u8]> = b.iter().map(Vec::as_slice).collect();
                let pos: Vec<Option<i64>> = k.iter().map(|&i| Some(i64::from(i) * 16)).collect();
                let ctx = s.context(*r);
                let (req, out) = s.d.prepare_store(ctx, &refs, &pos).unwrap();
                s.reqs[*r] = Some(req);
                let missing: Vec<usize> = (0..k.len())
                    .filter(|&j| !s.keys.contains_key(&k[j]))
                    .collect();
                let stored_now = s.keys.len() as u32;
                let free = CHUNKS - stored_now;
                let evictable: Vec<u32> = s
                    .keys
                    .iter()
                    .filter(|(i, r)| **r == Res::Ready(0) && !k.contains(i))
                    .map(|(&i, _)| i)
                    .collect();
                match out {
                    None => {
                        assert!(!missing.is_empty());
                        let need = missing.len() as u32 - free.min(missing.len() as u32);
                        assert!(
                            need as usize > evictable.len(),
                            "a store that fits was refused"
                        );
                    }
                    Some(out) => {
                        if !m.threshold {
                            assert_eq!(out.stored, missing, "stores exactly the missing keys");
                        } else {
                            assert!(out.stored.iter().all(|j| missing.contains(j)));
                        }
                        let need = (out.stored.len() as u32).saturating_sub(free);
                        assert_eq!(
                            out.evicted.len() as u32,
                            need,
                            "evicts exactly what is needed"
                        );
                        for e in &out.evicted {
                            let i = (0..KEYS).find(|&i| key(i) == **e).unwrap();
                            assert!(evictable.contains(&i), "evicted {i}: not evictable");
                            s.keys.remove(&i);
                        }
                        for &j in &out.stored {
                            s.keys.insert(k[j], Res::Storing);
                        }
                        let mut ids: Vec<u32> = out.chunks.iter().map(|c| c.0).collect();
                        ids.sort_unstable();
                        ids.dedup();
                        assert_eq!(ids.len(), out.stored.len(), "distinct chunks");
                        assert!(ids.iter().all(|&c| c < CHUNKS));
                    }
                }
            }
            Step::Complete(k, ok) => {
                let b = bytes(k);
                let refs: Vec<&[u8]> = b.iter().map(Vec::as_slice).collect();
                s.d.complete_store(&refs, *ok);
                for i in k {
                    if s.keys.get(i) == Some(&Res::Storing) {
                        if *ok {
                            s.keys.insert(*i, Res::Ready(0));
                        } else {
                            s.keys.remove(i);
                        }
                    }
                }
            }
            Step::Load(r, picks) => {
                let k = &pick(&with(&s.keys, |r| matches!(r, Res::Ready(_))), picks);
                let b = bytes(k);
                let refs: Vec<&[u8]> = b.iter().map(Vec::as_slice).collect();
                let ctx = s.context(*r);
                let (req, chunks) = s.d.prepare_load(ctx, &refs, &vec![None; k.len()]).unwrap();
                s.reqs[*r] = Some(req);
                assert_eq!(chunks.len(), k.len());
                for i in k {
                    if let Some(Res::Ready(n)) = s.keys.get_mut(i) {
                        *n += 1;
                    }
                }
            }
            Step::Unload(picks) => {
                let k = &pick(
                    &with(&s.keys, |r| matches!(r, Res::Ready(n) if n > 0)),
                    picks,
                );
                let b = bytes(k);
                let refs: Vec<&[u8]> = b.iter().map(Vec::as_slice).collect();
                s.d.complete_load(&refs).unwrap();
                for i in k {
                    if let Some(Res::Ready(n)) = s.keys.get_mut(i) {
                        *n -= 1;
                    }
                }
            }
            Step::Touch(k) => {
                let b = bytes(k);
                let refs: Vec<&[u8]> = b.iter().map(Vec::as_slice).collect();
                s.d.touch(&refs);
            }
            Step::Finish(r) => {
                s.finished[*r] = true;
                if let Some(req) = s.reqs[*r] {
                    // Loads were offered without positions: they come late, from the context.
                    let keys = s.d.unpositioned_keys(req);
                    let pos: Vec<(&[u8], i64)> =
                        keys.iter().map(|k| (&**k, i64::from(k[1]) * 16)).collect();
                    s.d.finish_request(req, &pos);
                }
            }
            Step::Reset => {
                s.d.reset();
                s.keys.clear();
            }
        }
        s
    }

    fn check_invariants(s: &Sut, m: &Model) {
        let _ = m;
        s.d.validate().unwrap();
        for i in 0..KEYS {
            let want = match s.keys.get(&i) {
                None => Lookup::Miss,
                Some(Res::Storing) => Lookup::HitPending,
                Some(Res::Ready(_)) => Lookup::Hit,
            };
            assert_eq!(s.d.lookup(&key(i)), want, "key {i}");
        }
        let pins: u64 = s
            .keys
            .values()
            .map(|r| match r {
                Res::Ready(n) => u64::from(*n),
                Res::Storing => 0,
            })
            .sum();
        assert_eq!(s.d.pinned(), pins);
    }
}

prop_state_machine! {
    #![proptest_config(crate::testing::proptest_config(96, "offload"))]
    #[test]
    fn the_directory_keeps_residency_and_evicts_only_what_it_may(sequential 1..60 => DirTest);
}
