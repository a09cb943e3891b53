//! State-machine test of [`DevicePool`] (the device resolver's slots between steps) against a
//! reference model: a list of (slot, occupant) in clock order and the set of occupants the
//! last step read. Slots are pushed (new ones, or ones that left the pool before), taken with
//! or without a second chance, removed from anywhere (the host adopting what one holds), and
//! drained. After every transition: the pool holds exactly the model's entries in the
//! model's order, and no slot twice.

use super::DevicePool;
use crate::ids::SlotId;
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};
use std::collections::BTreeSet;

#[derive(Debug, Clone, Default)]
struct Model {
    ring: Vec<(u32, Option<usize>)>,
    /// Occupants the last step read.
    recent: BTreeSet<usize>,
    next_slot: u32,
    /// Slots that left the pool, to push again.
    out: Vec<u32>,
    /// The slot the last push used.
    pushed: u32,
    /// What the last take (or remove) returned.
    taken: Vec<(u32, Option<usize>)>,
}

#[derive(Debug, Clone)]
enum Step {
    /// A slot at the back, holding this occupant: one that left the pool (the nth of them,
    /// if any), else a new one.
    Push(Option<usize>, Option<usize>),
    /// Remove the nth entry's slot.
    Remove(usize),
    /// Up to n entries, with or without a second chance.
    Take(usize, bool),
    /// A step read these occupants (the last step's marks).
    Read(BTreeSet<usize>),
    Drain,
}

struct RefMachine;

impl ReferenceStateMachine for RefMachine {
    type State = Model;
    type Transition = Step;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::default()).boxed()
    }

    fn transitions(_: &Model) -> BoxedStrategy<Step> {
        prop_oneof![
            6 => (
                proptest::option::weighted(0.8, 0usize..16),
                proptest::option::of(0usize..8)
            )
                .prop_map(|(e, again)| Step::Push(e, again)),
            3 => (0usize..16).prop_map(Step::Remove),
            4 => (0usize..12, any::<bool>()).prop_map(|(n, c)| Step::Take(n, c)),
            2 => proptest::collection::btree_set(0usize..16, 0..10).prop_map(Step::Read),
            1 => Just(Step::Drain),
        ]
        .boxed()
    }

    fn apply(mut m: Model, step: &Step) -> Model {
        m.taken.clear();
        match step {
            Step::Push(e, again) => {
                m.pushed = match again {
                    Some(i) if !m.out.is_empty() => m.out.remove(i % m.out.len()),
                    _ => {
                        m.next_slot += 1;
                        m.next_slot - 1
                    }
                };
                m.ring.push((m.pushed, *e));
            }
            Step::Remove(i) => {
                if !m.ring.is_empty() {
                    let i = i % m.ring.len();
                    m.taken.push(m.ring.remove(i));
                }
            }
            Step::Take(n, second_chance) => {
                // One pass at most: a recent occupant goes to the back, once; the rest are
                // taken in order until n.
                let mut passes = m.ring.len();
                while m.taken.len() < *n && passes > 0 {
                    passes -= 1;
                    let (s, e) = m.ring.remove(0);
                    if *second_chance && e.is_some_and(|e| m.recent.contains(&e)) {
                        m.ring.push((s, e));
                    } else {
                        m.taken.push((s, e));
                    }
                }
            }
            Step::Read(read) => m.recent = read.clone(),
            Step::Drain => m.taken = std::mem::take(&mut m.ring),
        }
        m.out.extend(m.taken.iter().map(|&(s, _)| s));
        m
    }
}

struct PoolTest;

struct Sut {
    pool: DevicePool,
    recent: BTreeSet<usize>,
    taken: Vec<(u32, Option<usize>)>,
    /// The model's ring before the step (where `Remove` finds its entry).
    before: Vec<(u32, Option<usize>)>,
}

impl StateMachineTest for PoolTest {
    type SystemUnderTest = Sut;
    type Reference = RefMachine;

    fn init_test(_: &Model) -> Sut {
        Sut {
            pool: DevicePool::default(),
            recent: BTreeSet::new(),
            taken: Vec::new(),
            before: Vec::new(),
        }
    }

    fn apply(mut sut: Sut, m: &Model, step: Step) -> Sut {
        sut.taken.clear();
        match step {
            Step::Push(e, _) => sut.pool.push(SlotId::new(m.pushed), e),
            Step::Remove(i) => {
                // (The entry is found in the model's ring before the step.)
                if let Some(&(s, e)) = sut.before.get(i % sut.before.len().max(1)) {
                    sut.pool.remove(SlotId::new(s));
                    sut.taken.push((s, e));
                }
            }
            Step::Take(n, second_chance) => {
                let mut out = Vec::new();
                let recent = &sut.recent;
                sut.pool
                    .take(n, second_chance, |e| recent.contains(&e), |_| {}, &mut out);
                assert!(out.len() <= n);
                sut.taken = out.into_iter().map(|(s, e)| (s.raw(), e)).collect();
            }
            Step::Read(read) => sut.recent = read,
            Step::Drain => {
                sut.taken = sut
                    .pool
                    .drain()
                    .into_iter()
                    .map(|(s, e)| (s.raw(), e))
                    .collect();
            }
        }
        assert_eq!(sut.taken, m.taken, "what the step took");
        sut.before = m.ring.clone();
        sut
    }

    fn check_invariants(sut: &Sut, m: &Model) {
        let have: Vec<(u32, Option<usize>)> = sut.pool.iter().map(|(s, e)| (s.raw(), e)).collect();
        assert_eq!(have, m.ring, "the pool's entries, in clock order");
        assert_eq!(sut.pool.len(), m.ring.len());
        let slots: BTreeSet<u32> = have.iter().map(|&(s, _)| s).collect();
        assert_eq!(slots.len(), have.len(), "a slot held twice");
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn the_pool_turns_over_as_a_clock(sequential 1..60 => PoolTest);
}

#[test]
fn a_take_with_a_second_chance_takes_what_was_not_read_first() {
    let mut pool = DevicePool::default();
    for (s, e) in [(0, Some(1)), (1, Some(2)), (2, None), (3, Some(4))] {
        pool.push(SlotId::new(s), e);
    }
    let mut out = Vec::new();
    pool.take(2, true, |e| e == 1 || e == 2, |_| {}, &mut out);
    assert_eq!(out, vec![(SlotId::new(2), None), (SlotId::new(3), Some(4))]);
    // The read ones went to the back, in their order.
    let rest: Vec<_> = pool.iter().collect();
    assert_eq!(
        rest,
        vec![(SlotId::new(0), Some(1)), (SlotId::new(1), Some(2))]
    );
}

#[test]
fn a_slot_removed_and_pushed_again_is_in_the_pool_once_at_its_new_place() {
    let mut pool = DevicePool::default();
    for (s, e) in [(0, Some(1)), (1, Some(2)), (2, Some(3))] {
        pool.push(SlotId::new(s), e);
    }
    pool.remove(SlotId::new(0));
    pool.push(SlotId::new(0), Some(9));
    assert_eq!(pool.len(), 3);
    let order: Vec<_> = pool.iter().collect();
    assert_eq!(
        order,
        vec![
            (SlotId::new(1), Some(2)),
            (SlotId::new(2), Some(3)),
            (SlotId::new(0), Some(9))
        ]
    );
    let mut out = Vec::new();
    pool.take(3, false, |_| false, |_| {}, &mut out);
    assert_eq!(out, order);
    assert_eq!(pool.len(), 0);
}
