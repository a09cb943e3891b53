//! State-machine test of [`PageAllocator`] against a reference model: a plain stack of free
//! pages and the holder of every page handed out (the owner, or one of three caller
//! allocations by receipt). After every step: the allocator's own `validate()`,
//! free + used = capacity, and every page's holder equals the model's.

use super::{Expect, Holder, PageAllocator};
use crate::error::Error;
use crate::ids::PageId;
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};
use std::collections::{BTreeMap, BTreeSet};

const TOTAL: u32 = 24;
const RESERVE: u32 = 2;
const CALLERS: usize = 3;

/// Who holds a page in the model: the owner, or caller allocation `k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    Owner,
    Caller(usize),
}

/// What a call accepts, in the model's terms.
#[derive(Debug, Clone, Copy)]
enum Accept {
    Only(Who),
    AnyCaller,
    Nobody,
}

impl Accept {
    fn accepts(self, w: Who) -> bool {
        match self {
            Accept::Only(x) => x == w,
            Accept::AnyCaller => matches!(w, Who::Caller(_)),
            Accept::Nobody => false,
        }
    }
}

#[derive(Debug, Clone)]
struct Model {
    free: Vec<u32>,
    held: BTreeMap<u32, Who>,
}

#[derive(Debug, Clone)]
enum Step {
    Alloc(usize, Who),
    /// Pages to free; may hold a duplicate, a reserved page, a free or a foreign one.
    Free(Vec<u32>, Accept),
    /// Pages for the owner to take; may hold a duplicate or another holder's page.
    Claim(Vec<u32>, Accept),
    /// Owner's pages handed to a caller.
    HandOver(Vec<u32>, usize),
}

fn who() -> impl Strategy<Value = Who> {
    prop_oneof![Just(Who::Owner), (0..CALLERS).prop_map(Who::Caller)]
}

fn accept() -> impl Strategy<Value = Accept> {
    prop_oneof![
        3 => who().prop_map(Accept::Only),
        2 => Just(Accept::AnyCaller),
        1 => Just(Accept::Nobody),
    ]
}

struct RefMachine;

impl ReferenceStateMachine for RefMachine {
    type State = Model;
    type Transition = Step;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model {
            free: (RESERVE..TOTAL).rev().collect(),
            held: BTreeMap::new(),
        })
        .boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Step> {
        let held: Vec<u32> = state.held.keys().copied().collect();
        let owned: Vec<u32> = state
            .held
            .iter()
            .filter(|(_, w)| **w == Who::Owner)
            .map(|(p, _)| *p)
            .collect();
        let n = held.len();
        let pages = (
            proptest::sample::subsequence(held, 0..=n),
            proptest::option::of(0..TOTAL + 3),
        )
            .prop_map(|(mut pages, extra)| {
                pages.extend(extra);
                pages
            });
        let m = owned.len();
        prop_oneof![
            3 => ((0..=(TOTAL as usize)), who()).prop_map(|(n, w)| Step::Alloc(n, w)),
            3 => (pages.clone(), accept()).prop_map(|(p, a)| Step::Free(p, a)),
            3 => (pages, accept()).prop_map(|(p, a)| Step::Claim(p, a)),
            1 => (proptest::sample::subsequence(owned, 0..=m), 0..CALLERS)
                .prop_map(|(p, k)| Step::HandOver(p, k)),
        ]
        .boxed()
    }

    fn apply(mut state: Model, step: &Step) -> Model {
        // Distinct, and each held as `a` accepts: what a free or a claim needs.
        let acceptable = |state: &Model, pages: &[u32], a: Accept| {
            pages.iter().collect::<BTreeSet<_>>().len() == pages.len()
                && pages
                    .iter()
                    .all(|p| state.held.get(p).is_some_and(|w| a.accepts(*w)))
        };
        match step {
            Step::Alloc(n, w) => {
                if *n <= state.free.len() {
                    for _ in 0..*n {
                        let p = state.free.pop().unwrap();
                        state.held.insert(p, *w);
                    }
                }
            }
            Step::Free(pages, a) => {
                if acceptable(&state, pages, *a) {
                    for p in pages {
                        state.held.remove(p);
                        state.free.push(*p);
                    }
                }
            }
            Step::Claim(pages, a) => {
                // The owner claims nothing from itself.
                let a = match a {
                    Accept::Only(Who::Owner) => Accept::Nobody,
                    a => *a,
                };
                if acceptable(&state, pages, a) {
                    for p in pages {
                        state.held.insert(*p, Who::Owner);
                    }
                }
            }
            Step::HandOver(pages, k) => {
                for p in pages {
                    state.held.insert(*p, Who::Caller(*k));
                }
            }
        }
        state
    }
}

struct Sut {
    alloc: PageAllocator,
    receipts: [Holder; CALLERS],
}

impl Sut {
    fn holder(&self, w: Who) -> Holder {
        match w {
            Who::Owner => Holder::OWNER,
            Who::Caller(k) => self.receipts[k],
        }
    }

    fn expect(&self, a: Accept) -> Expect {
        match a {
            Accept::Only(w) => Expect::Holder(self.holder(w)),
            Accept::AnyCaller => Expect::AnyCaller,
            Accept::Nobody => Expect::Nobody,
        }
    }
}

struct AllocTest;

impl StateMachineTest for AllocTest {
    type SystemUnderTest = Sut;
    type Reference = RefMachine;

    fn init_test(_: &Model) -> Sut {
        Sut {
            alloc: PageAllocator::new(TOTAL, RESERVE).unwrap(),
            receipts: [Holder::fresh(), Holder::fresh(), Holder::fresh()],
        }
    }

    fn apply(mut sut: Sut, model: &Model, step: Step) -> Sut {
        let before: Vec<Option<Holder>> = (0..TOTAL)
            .map(|p| sut.alloc.holder(PageId::new(p)))
            .collect();
        let unchanged = |sut: &Sut| {
            let now: Vec<Option<Holder>> = (0..TOTAL)
                .map(|p| sut.alloc.holder(PageId::new(p)))
                .collect();
            assert_eq!(now, before, "a refused call changed a holder");
        };
        let ids = |pages: &[u32]| pages.iter().copied().map(PageId::new).collect::<Vec<_>>();
        match step {
            Step::Alloc(n, w) => {
                let mut out = Vec::new();
                match sut.alloc.alloc_as(n, &mut out, sut.holder(w)) {
                    Ok(()) => {
                        assert_eq!(out.len(), n);
                        assert!(out.iter().all(|p| model.held.contains_key(&p.raw())));
                    }
                    Err(Error::OutOfPages {
                        requested, free, ..
                    }) => {
                        assert_eq!((requested, free), (n, sut.alloc.free_count()));
                        assert!(out.is_empty());
                        unchanged(&sut);
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            Step::Free(pages, a) => {
                let used = sut.alloc.used_count();
                let expect = sut.expect(a);
                match sut.alloc.free_held(&ids(&pages), expect, "pages") {
                    Ok(()) => assert_eq!(sut.alloc.used_count(), used - pages.len()),
                    Err(
                        Error::DoubleFree { .. } | Error::NotOwned { .. } | Error::NotHeld { .. },
                    ) => unchanged(&sut),
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            Step::Claim(pages, a) => {
                let expect = sut.expect(a);
                match sut.alloc.claim(&[&ids(&pages)], expect, "device_pages") {
                    Ok(()) => {}
                    Err(Error::NotHeld { field, .. }) => {
                        assert_eq!(field, "device_pages");
                        unchanged(&sut)
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            Step::HandOver(pages, k) => {
                let to = sut.receipts[k];
                sut.alloc.hand_over(&ids(&pages), to);
            }
        }
        sut
    }

    fn check_invariants(sut: &Sut, model: &Model) {
        let a = &sut.alloc;
        a.validate().unwrap();
        assert_eq!(a.free_count() + a.used_count(), a.capacity());
        let held: BTreeMap<u32, Holder> = (0..TOTAL)
            .filter_map(|p| a.holder(PageId::new(p)).map(|h| (p, h)))
            .collect();
        let want: BTreeMap<u32, Holder> = model
            .held
            .iter()
            .map(|(p, w)| (*p, sut.holder(*w)))
            .collect();
        assert_eq!(held, want);
    }
}

prop_state_machine! {
    #![proptest_config(crate::testing::proptest_config(256, "alloc"))]
    #[test]
    fn allocator_matches_reference(sequential 1..60 => AllocTest);
}
