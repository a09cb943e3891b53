//! State-machine test of [`Lru`] against a reference model: the members as a plain list, least
//! recently used first. A small slack makes sweeps start within a few steps, so pops, pushes
//! and removes land before, inside and after a sweep's hole. After every step: `validate()`,
//! the members in order equal the model's, and `len` and `entries` agree with the queue.

use super::Lru;
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

const OBJECTS: usize = 12;

#[derive(Debug, Clone)]
enum Step {
    /// Becomes evictable (a push, then the compaction a push runs).
    Push(usize),
    /// Pinned again (removed, its entry left stale).
    Remove(usize),
    /// An eviction.
    Pop,
    /// Removed and pushed again `n` times: stale entries pile up.
    Churn(usize, usize),
}

struct RefMachine;

impl ReferenceStateMachine for RefMachine {
    type State = Vec<usize>;
    type Transition = Step;

    fn init_state() -> BoxedStrategy<Vec<usize>> {
        Just(Vec::new()).boxed()
    }

    fn transitions(_: &Vec<usize>) -> BoxedStrategy<Step> {
        prop_oneof![
            4 => (0..OBJECTS).prop_map(Step::Push),
            2 => (0..OBJECTS).prop_map(Step::Remove),
            2 => Just(Step::Pop),
            2 => (0..OBJECTS, 1usize..12).prop_map(|(i, n)| Step::Churn(i, n)),
        ]
        .boxed()
    }

    fn apply(mut members: Vec<usize>, step: &Step) -> Vec<usize> {
        match *step {
            Step::Push(i) => {
                if !members.contains(&i) {
                    members.push(i);
                }
            }
            Step::Remove(i) => members.retain(|&m| m != i),
            Step::Pop => {
                if !members.is_empty() {
                    members.remove(0);
                }
            }
            Step::Churn(i, _) => {
                members.retain(|&m| m != i);
                members.push(i);
            }
        }
        members
    }
}

struct Sut {
    lru: Lru,
    marks: Vec<u64>,
}

impl Sut {
    fn push(&mut self, i: usize) {
        self.lru.push_back(i, &mut self.marks[i]);
        let marks = &self.marks;
        self.lru.compact_if_needed(|j| marks[j], |_| ());
    }
}

struct LruTest;

impl StateMachineTest for LruTest {
    type SystemUnderTest = Sut;
    type Reference = RefMachine;

    fn init_test(_: &Vec<usize>) -> Sut {
        let mut lru = Lru::new();
        // Sweeps start at two stale entries beyond the members and move on two entries at
        // every push: most steps land mid-sweep.
        lru.tune(2, 2, 1);
        Sut {
            lru,
            marks: vec![0; OBJECTS],
        }
    }

    fn apply(mut sut: Sut, members: &Vec<usize>, step: Step) -> Sut {
        match step {
            Step::Push(i) => sut.push(i),
            Step::Remove(i) => {
                let was = sut.marks[i] != 0;
                assert_eq!(sut.lru.remove(&mut sut.marks[i]), was);
            }
            Step::Pop => {
                let before = sut.lru.len();
                let marks = &mut sut.marks;
                let got = sut.lru.pop_front(|i, s| {
                    let live = marks[i] == s;
                    if live {
                        marks[i] = 0;
                    }
                    live
                });
                // `members` is after the pop: the popped one is the one no longer there.
                assert_eq!(got.is_some(), before > 0);
                if let Some(i) = got {
                    assert!(!members.contains(&i), "popped {i}, still a member");
                }
            }
            Step::Churn(i, n) => {
                for _ in 0..n {
                    sut.lru.remove(&mut sut.marks[i]);
                    sut.push(i);
                }
            }
        }
        sut
    }

    fn check_invariants(sut: &Sut, members: &Vec<usize>) {
        let marks = &sut.marks;
        sut.lru.validate(|i| marks[i]).unwrap();
        let order: Vec<usize> = sut.lru.iter(|i| marks[i]).collect();
        assert_eq!(&order, members);
        assert_eq!(sut.lru.len(), members.len());
        assert!(sut.lru.entries() >= members.len());
        for (i, &m) in marks.iter().enumerate() {
            assert_eq!(m != 0, members.contains(&i), "object {i}'s mark");
        }
    }
}

prop_state_machine! {
    #![proptest_config(crate::testing::proptest_config(512, "lru"))]
    #[test]
    fn lru_matches_reference(sequential 1..80 => LruTest);
}
