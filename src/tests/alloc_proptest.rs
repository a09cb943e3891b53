//! State-machine test of [`PageAllocator`] against a reference model: a plain stack of free
//! pages and a set of allocated ones. After every step: the allocator's own `validate()`,
//! free + used = capacity, and the allocated set equals the model's.

use super::PageAllocator;
use crate::error::Error;
use crate::ids::PageId;
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};
use std::collections::BTreeSet;

const TOTAL: u32 = 24;
const RESERVE: u32 = 2;

#[derive(Debug, Clone)]
struct Model {
    free: Vec<u32>,
    allocated: BTreeSet<u32>,
}

#[derive(Debug, Clone)]
enum Step {
    Alloc(usize),
    /// Pages to free; may hold a duplicate, a reserved page or a foreign one.
    Free(Vec<u32>),
}

struct RefMachine;

impl ReferenceStateMachine for RefMachine {
    type State = Model;
    type Transition = Step;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model {
            free: (RESERVE..TOTAL).rev().collect(),
            allocated: BTreeSet::new(),
        })
        .boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Step> {
        let held: Vec<u32> = state.allocated.iter().copied().collect();
        let n = held.len();
        let subset = proptest::sample::subsequence(held, 0..=n);
        let extra = proptest::option::of(0..TOTAL + 3);
        prop_oneof![
            3 => (0..=(TOTAL as usize)).prop_map(Step::Alloc),
            3 => (subset, extra).prop_map(|(mut pages, extra)| {
                pages.extend(extra);
                Step::Free(pages)
            }),
        ]
        .boxed()
    }

    fn apply(mut state: Model, step: &Step) -> Model {
        match step {
            Step::Alloc(n) => {
                if *n <= state.free.len() {
                    for _ in 0..*n {
                        let p = state.free.pop().unwrap();
                        state.allocated.insert(p);
                    }
                }
            }
            Step::Free(pages) => {
                let distinct: BTreeSet<u32> = pages.iter().copied().collect();
                let ok = distinct.len() == pages.len()
                    && pages.iter().all(|p| state.allocated.contains(p));
                if ok {
                    for p in pages {
                        state.allocated.remove(p);
                        state.free.push(*p);
                    }
                }
            }
        }
        state
    }
}

struct AllocTest;

impl StateMachineTest for AllocTest {
    type SystemUnderTest = PageAllocator;
    type Reference = RefMachine;

    fn init_test(_: &Model) -> PageAllocator {
        PageAllocator::new(TOTAL, RESERVE).unwrap()
    }

    fn apply(mut sut: PageAllocator, model: &Model, step: Step) -> PageAllocator {
        let before = sut.used_count();
        match step {
            Step::Alloc(n) => match sut.alloc(n) {
                Ok(pages) => {
                    assert_eq!(pages.len(), n);
                    assert!(pages.iter().all(|p| model.allocated.contains(&p.raw())));
                }
                Err(Error::OutOfPages {
                    requested, free, ..
                }) => {
                    assert_eq!((requested, free), (n, sut.free_count()));
                    assert_eq!(sut.used_count(), before, "a failed alloc changed state");
                }
                Err(e) => panic!("unexpected error {e}"),
            },
            Step::Free(pages) => {
                let ids: Vec<PageId> = pages.iter().copied().map(PageId::new).collect();
                match sut.free(&ids) {
                    Ok(()) => assert_eq!(sut.used_count(), before - pages.len()),
                    Err(Error::DoubleFree { .. } | Error::NotOwned { .. }) => {
                        assert_eq!(sut.used_count(), before, "a refused free changed state")
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
        }
        sut
    }

    fn check_invariants(sut: &PageAllocator, model: &Model) {
        sut.validate().unwrap();
        assert_eq!(sut.free_count() + sut.used_count(), sut.capacity());
        let held: BTreeSet<u32> = (0..TOTAL)
            .filter(|&p| sut.is_allocated(PageId::new(p)))
            .collect();
        assert_eq!(held, model.allocated);
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]
    #[test]
    fn allocator_matches_reference(sequential 1..60 => AllocTest);
}
