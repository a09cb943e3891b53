//! State-machine test of [`DeviceTables`] (the page tables the resolver's kernel reads) against
//! a reference model: the running requests, each with its admission serial and homes. Requests
//! are admitted (or admitted again under the same id), grow by pages, end; a step over some of
//! them, in any order, prepares the tables and applies the uploads on the CPU as the device
//! does. After every step: each of the step's requests reads its homes and length in its row,
//! the batch's rows are its requests', and no two running requests share a row.

use super::{DeviceTables, StepTable};
use crate::ids::RequestId;
use crate::scheduler::resolver::device::{HostDevice, KernelDevice};
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};
use std::collections::BTreeMap;

const PS: u64 = 4;

#[derive(Debug, Clone, Default)]
struct Model {
    /// Running requests: id -> (serial, homes).
    running: BTreeMap<u64, (u64, Vec<u32>)>,
    serial: u64,
}

#[derive(Debug, Clone)]
enum Step {
    /// Request `id` admitted with `pages` pages (again, when it runs: a new admission).
    Admit(u64, Vec<u32>),
    /// The n-th running request gains pages.
    Grow(usize, Vec<u32>),
    /// The n-th running request ends.
    End(usize),
    /// A decode step over the running requests these indices name, in this order.
    Decode(Vec<usize>),
}

fn nth(m: &Model, n: usize) -> Option<u64> {
    m.running.keys().nth(n % m.running.len().max(1)).copied()
}

fn batch(m: &Model, picks: &[usize]) -> Vec<u64> {
    let mut ids: Vec<u64> = Vec::new();
    for &n in picks {
        if let Some(id) = nth(m, n) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    ids
}

struct RefMachine;

impl ReferenceStateMachine for RefMachine {
    type State = Model;
    type Transition = Step;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::default()).boxed()
    }

    fn transitions(_: &Model) -> BoxedStrategy<Step> {
        let homes = |n| proptest::collection::vec(0u32..1000, 0..n);
        prop_oneof![
            3 => (0u64..24, homes(40)).prop_map(|(id, h)| Step::Admit(id, h)),
            3 => (any::<usize>(), homes(24)).prop_map(|(n, h)| Step::Grow(n, h)),
            1 => any::<usize>().prop_map(Step::End),
            4 => proptest::collection::vec(any::<usize>(), 0..12).prop_map(Step::Decode),
        ]
        .boxed()
    }

    fn apply(mut m: Model, step: &Step) -> Model {
        match step {
            Step::Admit(id, homes) => {
                m.serial += 1;
                m.running.insert(*id, (m.serial, homes.clone()));
            }
            Step::Grow(n, more) => {
                if let Some(id) = nth(&m, *n) {
                    m.running.get_mut(&id).unwrap().1.extend(more);
                }
            }
            Step::End(n) => {
                if let Some(id) = nth(&m, *n) {
                    m.running.remove(&id);
                }
            }
            Step::Decode(_) => {}
        }
        m
    }
}

struct Sut {
    dev: HostDevice,
    tables: DeviceTables,
}

struct TablesTest;

impl StateMachineTest for TablesTest {
    type SystemUnderTest = Sut;
    type Reference = RefMachine;

    fn init_test(_: &Model) -> Sut {
        Sut {
            dev: HostDevice::new(2),
            tables: DeviceTables::default(),
        }
    }

    fn apply(mut sut: Sut, m: &Model, step: Step) -> Sut {
        let Step::Decode(picks) = step else {
            return sut;
        };
        let ids = batch(m, &picks);
        let step: Vec<StepTable<'_>> = ids
            .iter()
            .map(|&id| {
                let (serial, homes) = &m.running[&id];
                (
                    RequestId::new(id),
                    *serial,
                    &homes[..],
                    homes.len() as u64 * PS,
                )
            })
            .collect();
        let live = |id: &RequestId| m.running.contains_key(&id.raw());
        let up = sut.tables.prepare(&mut sut.dev, &step, live).unwrap();
        // Applied as the device applies them: the pairs scattered by the kernel's own code.
        let n = up.pairs.len() / 2;
        // SAFETY: every pair's index lies in the table (`prepare` sized it), which is memory
        // of the host device.
        unsafe {
            sut.dev
                .mirror_apply(up.pairs.as_ptr() as u64, n as u32, sut.tables.addr)
                .unwrap()
        };
        assert_eq!(up.rows.len(), ids.len());
        // The rows of requests that ended were let go.
        for owner in sut.tables.owners.iter().flatten() {
            assert!(
                m.running.contains_key(&owner.raw()),
                "{owner} ended, still holds a row"
            );
        }
        let w = sut.tables.width;
        let cap = up.lens.len();
        // SAFETY: the table has `cap` rows of `w` homes, in this process's memory.
        let table = unsafe { std::slice::from_raw_parts(sut.tables.addr as *const i32, cap * w) };
        for (b, &id) in ids.iter().enumerate() {
            let row = up.rows[b] as usize;
            let homes = &m.running[&id].1;
            assert_eq!(
                sut.tables.owners[row],
                Some(RequestId::new(id)),
                "row {row}"
            );
            assert_eq!(
                up.lens[row],
                (homes.len() as u64 * PS) as i64,
                "request {id}"
            );
            let got: Vec<u32> = table[row * w..row * w + homes.len()]
                .iter()
                .map(|&h| h as u32)
                .collect();
            assert_eq!(&got, homes, "request {id}'s row {row}");
        }
        sut
    }

    fn check_invariants(sut: &Sut, m: &Model) {
        // No request holds two rows.
        let _ = m;
        let mut seen = std::collections::HashSet::new();
        for id in sut.tables.owners.iter().flatten() {
            assert!(seen.insert(*id), "request {id} holds two rows");
        }
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn device_tables_follow_the_running_requests(sequential 1..60 => TablesTest);
}

#[test]
fn a_table_is_released() {
    let mut dev = HostDevice::new(1);
    let mut t = DeviceTables::default();
    let homes = [1u32, 2, 3];
    let step: Vec<StepTable<'_>> = vec![(RequestId::new(1), 1, &homes[..], 12)];
    t.prepare(&mut dev, &step, |_| true).unwrap();
    assert_ne!(t.addr, 0);
    t.release(&mut dev);
    assert_eq!(t.addr, 0);
    let _ = dev.alloc(8).unwrap();
}
