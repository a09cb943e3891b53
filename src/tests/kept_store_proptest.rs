//! State-machine test of [`KeptStore`] against a reference model: per live slot, a plain list
//! of pages per layer, and a stack of freed slots (reused last-freed first). After every step:
//! the store's own `validate()`, every live slot's lists equal the model's, and the slots in
//! use are the model's.

use super::{KeptSlot, KeptStore, Run};
use crate::scheduler::Kept;
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};
use std::collections::BTreeMap;

const LAYERS: usize = 3;

#[derive(Debug, Clone, Default)]
struct Model {
    /// Live slot -> per layer, its pages.
    live: BTreeMap<u32, Vec<Vec<u32>>>,
    free: Vec<u32>,
    slots: u32,
}

#[derive(Debug, Clone)]
enum Step {
    Add,
    /// The n-th live slot ends.
    Remove(usize),
    /// A plan of `layer` covers these live slots (by position) with these lists; `gap`
    /// garbage entries before each run (rows it skipped).
    Install {
        layer: usize,
        covered: Vec<(usize, Vec<u32>)>,
        gap: usize,
    },
    /// The n-th live slot at `layer` drops the pages `p % 3 == r`.
    Retain(usize, usize, u32),
    /// The n-th live slot gives back `layer`'s list.
    Drain(usize, usize),
}

fn nth(model: &Model, n: usize) -> Option<u32> {
    model.live.keys().nth(n % model.live.len().max(1)).copied()
}

fn entry(page: u32) -> Kept {
    Kept {
        page,
        object: page + 1000,
        slot: page as i32,
    }
}

struct RefMachine;

impl ReferenceStateMachine for RefMachine {
    type State = Model;
    type Transition = Step;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::default()).boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Step> {
        if state.live.is_empty() {
            return Just(Step::Add).boxed();
        }
        let list = proptest::collection::btree_set(0u32..40, 0..6)
            .prop_map(|s| s.into_iter().collect::<Vec<_>>());
        prop_oneof![
            2 => Just(Step::Add),
            1 => any::<usize>().prop_map(Step::Remove),
            4 => (
                0..LAYERS,
                proptest::collection::vec((any::<usize>(), list), 0..4),
                0usize..3
            )
                .prop_map(|(layer, covered, gap)| Step::Install { layer, covered, gap }),
            1 => (any::<usize>(), 0..LAYERS, 0u32..3).prop_map(|(n, l, r)| Step::Retain(n, l, r)),
            1 => (any::<usize>(), 0..LAYERS).prop_map(|(n, l)| Step::Drain(n, l)),
        ]
        .boxed()
    }

    fn preconditions(state: &Model, step: &Step) -> bool {
        // (Shrinking may drop the Add a step needs.)
        matches!(step, Step::Add) || !state.live.is_empty()
    }

    fn apply(mut state: Model, step: &Step) -> Model {
        match step {
            Step::Add => {
                let s = state.free.pop().unwrap_or_else(|| {
                    state.slots += 1;
                    state.slots - 1
                });
                state.live.insert(s, vec![Vec::new(); LAYERS]);
            }
            Step::Remove(n) => {
                if let Some(s) = nth(&state, *n) {
                    state.live.remove(&s);
                    state.free.push(s);
                }
            }
            Step::Install { layer, covered, .. } => {
                // A slot covered twice: the later run wins.
                for (n, pages) in covered {
                    if let Some(s) = nth(&state, *n) {
                        state.live.get_mut(&s).unwrap()[*layer] = pages.clone();
                    }
                }
            }
            Step::Retain(n, layer, r) => {
                if let Some(s) = nth(&state, *n) {
                    state.live.get_mut(&s).unwrap()[*layer].retain(|p| p % 3 != *r);
                }
            }
            Step::Drain(n, layer) => {
                if let Some(s) = nth(&state, *n) {
                    state.live.get_mut(&s).unwrap()[*layer].clear();
                }
            }
        }
        state
    }
}

struct StoreTest;

impl StateMachineTest for StoreTest {
    type SystemUnderTest = KeptStore;
    type Reference = RefMachine;

    fn init_test(_: &Model) -> KeptStore {
        KeptStore::new(LAYERS)
    }

    fn apply(mut sut: KeptStore, model: &Model, step: Step) -> KeptStore {
        // `model` is the state after the step; slots are found by position in the state
        // before it, which for every step but Add and Remove has the same live slots.
        let slot = |n: usize, live: &BTreeMap<u32, Vec<Vec<u32>>>| {
            live.keys().nth(n % live.len().max(1)).map(|&s| KeptSlot(s))
        };
        match step {
            Step::Add => {
                let s = sut.add();
                assert!(
                    model.live.contains_key(&s.0),
                    "slot {} not the model's",
                    s.0
                );
            }
            Step::Remove(_) => {
                // The slot the model removed: live in the store, not in the model.
                let gone: Vec<u32> = (0..sut.slots)
                    .filter(|s| !sut.free.contains(&KeptSlot(*s)) && !model.live.contains_key(s))
                    .collect();
                assert_eq!(gone.len(), 1, "{gone:?}");
                let s = KeptSlot(gone[0]);
                let expect: usize = (0..LAYERS).map(|l| sut.list(l, s).len()).sum();
                let mut objects = Vec::new();
                sut.remove(s, &mut objects);
                assert_eq!(objects.len(), expect);
            }
            Step::Install {
                layer,
                covered,
                gap,
            } => {
                let mut lists = sut.take_spare(16);
                let mut runs = Vec::new();
                for (n, pages) in &covered {
                    let s = slot(*n, &model.live).unwrap();
                    lists.extend((0..gap as u32).map(|g| entry(900 + g)));
                    let start = lists.len() as u32;
                    lists.extend(pages.iter().map(|&p| entry(p)));
                    runs.push((
                        s,
                        Run {
                            start,
                            end: lists.len() as u32,
                        },
                    ));
                }
                sut.install(layer, lists, &runs);
            }
            Step::Retain(n, layer, r) => {
                let s = slot(n, &model.live).unwrap();
                sut.retain(layer, s, |k| k.page % 3 != r);
            }
            Step::Drain(n, layer) => {
                let s = slot(n, &model.live).unwrap();
                let expect: Vec<u32> = sut.list(layer, s).iter().map(|k| k.object).collect();
                let mut objects = Vec::new();
                sut.drain(layer, s, &mut objects);
                assert_eq!(objects, expect);
            }
        }
        sut
    }

    fn check_invariants(sut: &KeptStore, model: &Model) {
        sut.validate().unwrap();
        assert_eq!(sut.in_use(), model.live.len());
        for (&s, layers) in &model.live {
            let s = KeptSlot(s);
            for (l, pages) in layers.iter().enumerate() {
                let got: Vec<u32> = sut.list(l, s).iter().map(|k| k.page).collect();
                assert_eq!(&got, pages, "slot {} layer {l}", s.0);
                assert!(sut.list(l, s).iter().all(|k| k.object == k.page + 1000));
            }
            assert_eq!(sut.count(s), layers.iter().map(Vec::len).sum::<usize>());
        }
    }
}

prop_state_machine! {
    #![proptest_config(crate::testing::proptest_config(256, "kept_store"))]
    #[test]
    fn kept_store_matches_reference(sequential 1..60 => StoreTest);
}
