//! proptest-state-machine test of the residency directory against a reference model.
//!
//! The model is deliberately naive: objects in a `BTreeMap`, the LRU order in a `Vec`, slots
//! as counters. It predicts every outcome (success or the error kind), every transfer and
//! handle id, and every object's states and pins; after each step the test compares them and
//! runs `validate()`, which checks page conservation, single ownership of slots, the exact
//! LRU membership (so a pinned object is never evicted), one in-flight transfer per Loading
//! object, and that no mapping survives a failed load. A step publishes a device resolver's
//! read bitmap (here a bit a namespace): evictions then give the objects it names a second
//! chance, once a bitmap. Steps also grant a device resolver slots and victims (pinned, out of
//! the LRU, passing over what the last bitmap read), and take, hold back or return them.

use super::*;
use crate::ids::{PinHandleId, SlotId, TransferId};
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};
use std::collections::{BTreeMap, BTreeSet};

const DEVICE: u32 = 4;
const HOST: u32 = 8;
const PAGES: u8 = 5;
const NAMESPACES: u8 = 2;
const PRELOADED: u8 = 4;

type K = (u8, u8);

fn okey(k: K) -> ObjectKey {
    ObjectKey::new(u64::from(k.0), 0, u32::from(k.1), LayerGroup::All)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MDev {
    Absent,
    Loading(u64),
    Ready,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MHost {
    None,
    Writing(u64),
    Ready,
}

#[derive(Debug, Clone)]
struct MObj {
    key: K,
    dev: MDev,
    host: MHost,
    pins: u32,
    dropped: bool,
}

impl MObj {
    fn evictable(&self) -> bool {
        self.dev == MDev::Ready && self.host == MHost::Ready && self.pins == 0 && !self.dropped
    }
    fn reapable(&self) -> bool {
        self.dropped
            && self.pins == 0
            && !matches!(self.dev, MDev::Loading(_))
            && !matches!(self.host, MHost::Writing(_))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    NotResident,
    OutOfSlots,
    KeyExists,
    Dropped,
    BadTransfer,
    BadHandle,
    Invalid,
    Config,
}

#[derive(Debug, Clone)]
struct MTransfer {
    load: bool,
    objs: Vec<usize>,
    state: u8, // 0 in flight, 1 completed, 2 failed
    refs: u32,
}

#[derive(Debug, Clone)]
struct Model {
    objs: BTreeMap<usize, MObj>,
    index: BTreeMap<K, usize>,
    next_uid: usize,
    lru: Vec<usize>,
    dev_free: usize,
    host_free: usize,
    quarantine: BTreeMap<u64, (usize, usize)>,
    transfers: BTreeMap<u64, MTransfer>,
    handles: BTreeMap<u64, (Vec<usize>, Vec<u64>)>,
    next_tid: u64,
    next_hid: u64,
    dropped: BTreeSet<u8>,
    /// Evictable objects the last published read bitmap gives a second chance (none once
    /// they leave the LRU: a member again is used since).
    chance: BTreeSet<usize>,
    /// Second chances given: by evictions, by grants.
    chances: u64,
    grant_chances: u64,
    /// Victims granted and not yet taken or held back, in grant order; how many the last
    /// step granted.
    granted: Vec<usize>,
    last_grant: usize,
    /// Device slots granted (taken victims' and free ones), not yet returned.
    granted_slots: usize,
    outcome: Outcome,
}

#[derive(Debug, Clone)]
enum Step {
    Allocate(Vec<K>),
    Resolve(Vec<K>),
    Complete(u64),
    BackupComplete(u64),
    Fail(u64, bool),
    Ended(u64),
    Release(u64),
    Backup(Vec<K>),
    Evict(usize),
    Drop(u8),
    /// The last device step read these namespaces' objects.
    Reads(Vec<u8>),
    /// Grants up to n victims.
    GrantVictims(usize),
    /// Grants n slots (free ones first, then evicting).
    GrantSlots(usize),
    /// The device took granted victim i (past the end: one that is not granted).
    TakeVictim(usize),
    /// Granted victim i goes back (past the end: one that is not granted).
    Unhold(usize),
    /// Every granted slot goes back free.
    ReturnSlots,
}

impl Model {
    fn settle(&mut self, uid: usize) {
        let o = &self.objs[&uid];
        if o.evictable() {
            if !self.lru.contains(&uid) {
                self.lru.push(uid);
            }
        } else if o.reapable() {
            self.reap(uid);
        }
    }

    fn reap(&mut self, uid: usize) {
        self.lru.retain(|&u| u != uid);
        self.chance.remove(&uid);
        let o = self.objs.remove(&uid).unwrap();
        if o.dev == MDev::Ready {
            self.dev_free += 1;
        }
        if o.host == MHost::Ready {
            self.host_free += 1;
        }
    }

    fn take_slot(&mut self) {
        if self.dev_free > 0 {
            self.dev_free -= 1;
        } else {
            let victim = self.pop_victim();
            self.objs.get_mut(&victim).unwrap().dev = MDev::Absent;
        }
    }

    /// The LRU's front, after the second chances of the last read bitmap (at most
    /// `MAX_CHANCES` an eviction).
    fn pop_victim(&mut self) -> usize {
        let mut given = 0;
        loop {
            let u = self.lru.remove(0);
            if given == crate::directory::core::MAX_CHANCES || !self.chance.remove(&u) {
                return u;
            }
            given += 1;
            self.chances += 1;
            self.lru.push(u);
        }
    }

    fn lookup(&self, k: K) -> std::result::Result<usize, Outcome> {
        match self.index.get(&k) {
            Some(&u) => Ok(u),
            None if self.dropped.contains(&k.0) => Err(Outcome::Dropped),
            None => Err(Outcome::NotResident),
        }
    }

    fn new_tid(&mut self, load: bool, objs: Vec<usize>) -> u64 {
        let t = self.next_tid;
        self.next_tid += 1;
        self.transfers.insert(
            t,
            MTransfer {
                load,
                objs,
                state: 0,
                refs: 0,
            },
        );
        t
    }

    fn finish(&mut self, t: u64, state: u8) {
        let tr = self.transfers.get_mut(&t).unwrap();
        tr.state = state;
        tr.objs.clear();
        if tr.refs == 0 {
            self.transfers.remove(&t);
        }
    }

    fn allocate(&mut self, keys: &[K]) -> Outcome {
        let mut seen = BTreeSet::new();
        for &k in keys {
            if self.dropped.contains(&k.0) {
                return Outcome::Dropped;
            }
            if self.index.contains_key(&k) || !seen.insert(k) {
                return Outcome::KeyExists;
            }
        }
        if keys.len() > self.dev_free + self.lru.len() {
            return Outcome::OutOfSlots;
        }
        for &k in keys {
            self.take_slot();
            let uid = self.next_uid;
            self.next_uid += 1;
            self.objs.insert(
                uid,
                MObj {
                    key: k,
                    dev: MDev::Ready,
                    host: MHost::None,
                    pins: 0,
                    dropped: false,
                },
            );
            self.index.insert(k, uid);
        }
        Outcome::Ok
    }

    fn resolve(&mut self, keys: &[K]) -> Outcome {
        let mut order: Vec<usize> = Vec::new();
        for &k in keys {
            let uid = match self.lookup(k) {
                Ok(u) => u,
                Err(e) => return e,
            };
            if order.contains(&uid) {
                continue;
            }
            let o = &self.objs[&uid];
            if o.dev == MDev::Absent && o.host != MHost::Ready {
                return Outcome::NotResident;
            }
            order.push(uid);
        }
        let loads: Vec<usize> = order
            .iter()
            .copied()
            .filter(|u| self.objs[u].dev == MDev::Absent)
            .collect();
        let keep = order.iter().filter(|u| self.objs[u].evictable()).count();
        if loads.len() > self.dev_free + self.lru.len() - keep {
            return Outcome::OutOfSlots;
        }
        let mut held = Vec::new();
        let mut tids = Vec::new();
        for &u in &order {
            let o = self.objs.get_mut(&u).unwrap();
            match o.dev {
                MDev::Ready => {}
                MDev::Loading(t) => {
                    if !tids.contains(&t) {
                        tids.push(t);
                    }
                }
                MDev::Absent => continue,
            }
            o.pins += 1;
            held.push(u);
            self.lru.retain(|&x| x != u);
            self.chance.remove(&u);
        }
        if !loads.is_empty() {
            let t = self.new_tid(true, loads.clone());
            for &u in &loads {
                self.take_slot();
                let o = self.objs.get_mut(&u).unwrap();
                o.dev = MDev::Loading(t);
                o.pins += 1;
                held.push(u);
            }
            tids.push(t);
        }
        for t in &tids {
            self.transfers.get_mut(t).unwrap().refs += 1;
        }
        let h = self.next_hid;
        self.next_hid += 1;
        self.handles.insert(h, (held, tids));
        Outcome::Ok
    }

    fn complete(&mut self, t: u64, load: bool) -> Outcome {
        match self.transfers.get(&t) {
            Some(tr) if tr.state == 0 && tr.load == load => {}
            _ => return Outcome::BadTransfer,
        }
        let objs = self.transfers[&t].objs.clone();
        for u in objs {
            let o = self.objs.get_mut(&u).unwrap();
            if load {
                o.dev = MDev::Ready;
            } else {
                o.host = MHost::Ready;
            }
            self.settle(u);
        }
        self.finish(t, 1);
        Outcome::Ok
    }

    fn fail(&mut self, t: u64, ended: bool) -> Outcome {
        match self.transfers.get(&t) {
            Some(tr) if tr.state == 0 => {}
            _ => return Outcome::BadTransfer,
        }
        let tr = self.transfers[&t].clone();
        for &u in &tr.objs {
            let o = self.objs.get_mut(&u).unwrap();
            if tr.load {
                o.dev = MDev::Absent;
            } else {
                o.host = MHost::None;
            }
        }
        let n = tr.objs.len();
        self.quarantine
            .insert(t, if tr.load { (n, 0) } else { (0, n) });
        for &u in &tr.objs {
            self.settle(u);
        }
        self.finish(t, 2);
        if ended {
            self.ended(t);
        }
        Outcome::Ok
    }

    fn ended(&mut self, t: u64) -> Outcome {
        match self.quarantine.remove(&t) {
            Some((d, h)) => {
                self.dev_free += d;
                self.host_free += h;
                Outcome::Ok
            }
            None => Outcome::BadTransfer,
        }
    }

    fn release(&mut self, h: u64) -> Outcome {
        let Some((objs, tids)) = self.handles.remove(&h) else {
            return Outcome::BadHandle;
        };
        for t in tids {
            let tr = self.transfers.get_mut(&t).unwrap();
            tr.refs -= 1;
            if tr.refs == 0 && tr.state != 0 {
                self.transfers.remove(&t);
            }
        }
        for u in objs {
            self.objs.get_mut(&u).unwrap().pins -= 1;
            self.settle(u);
        }
        Outcome::Ok
    }

    fn backup(&mut self, keys: &[K]) -> Outcome {
        let mut order = Vec::new();
        for &k in keys {
            let uid = match self.lookup(k) {
                Ok(u) => u,
                Err(e) => return e,
            };
            if order.contains(&uid) {
                continue;
            }
            order.push(uid);
            if self.objs[&uid].dev != MDev::Ready {
                return Outcome::Invalid;
            }
        }
        let todo: Vec<usize> = order
            .into_iter()
            .filter(|u| self.objs[u].host == MHost::None)
            .collect();
        if todo.len() > self.host_free {
            return Outcome::OutOfSlots;
        }
        if !todo.is_empty() {
            let t = self.new_tid(false, todo.clone());
            for u in todo {
                self.host_free -= 1;
                self.objs.get_mut(&u).unwrap().host = MHost::Writing(t);
            }
        }
        Outcome::Ok
    }

    fn evict(&mut self, n: usize) {
        for _ in 0..n {
            if self.lru.is_empty() {
                break;
            }
            let u = self.pop_victim();
            self.objs.get_mut(&u).unwrap().dev = MDev::Absent;
            self.dev_free += 1;
        }
    }

    /// Up to `n` of the LRU's front, each read one passed over (no bound), pinned.
    fn grant_victims(&mut self, n: usize) {
        let before = self.granted.len();
        while self.granted.len() - before < n && !self.lru.is_empty() {
            let u = self.lru.remove(0);
            if self.chance.remove(&u) {
                self.grant_chances += 1;
                self.lru.push(u);
                continue;
            }
            self.objs.get_mut(&u).unwrap().pins += 1;
            self.granted.push(u);
        }
        self.last_grant = self.granted.len() - before;
    }

    fn grant_slots(&mut self, n: usize) -> Outcome {
        if n > self.dev_free + self.lru.len() {
            return Outcome::OutOfSlots;
        }
        for _ in 0..n {
            self.take_slot();
            self.granted_slots += 1;
        }
        Outcome::Ok
    }

    /// Granted victim `i` taken by the device (`take`) or held back.
    fn end_victim(&mut self, i: usize, take: bool) -> Outcome {
        if i >= self.granted.len() {
            return Outcome::Config;
        }
        let u = self.granted.remove(i);
        let o = self.objs.get_mut(&u).unwrap();
        o.pins -= 1;
        if take {
            o.dev = MDev::Absent;
            self.granted_slots += 1;
        }
        self.settle(u);
        Outcome::Ok
    }

    fn drop_ns(&mut self, ns: u8) -> Outcome {
        if !self.dropped.insert(ns) {
            return Outcome::Dropped;
        }
        let uids: Vec<usize> = self
            .index
            .iter()
            .filter(|(k, _)| k.0 == ns)
            .map(|(_, &u)| u)
            .collect();
        for u in uids {
            let k = self.objs[&u].key;
            self.index.remove(&k);
            self.objs.get_mut(&u).unwrap().dropped = true;
            self.lru.retain(|&x| x != u);
            self.chance.remove(&u);
            if self.objs[&u].reapable() {
                self.reap(u);
            }
        }
        Outcome::Ok
    }
}

struct Ref;

fn keys_strategy() -> impl Strategy<Value = Vec<K>> {
    proptest::collection::vec((0..NAMESPACES, 0..PAGES), 1..5)
}

impl ReferenceStateMachine for Ref {
    type State = Model;
    type Transition = Step;

    /// Starts with `PRELOADED` host-only objects, alternately in namespaces 0 and 1 (so that a
    /// read bitmap, a bit a namespace, names some of them), so loads, joins and their
    /// failures happen from the first step.
    fn init_state() -> BoxedStrategy<Model> {
        let mut m = Model {
            objs: BTreeMap::new(),
            index: BTreeMap::new(),
            next_uid: 0,
            lru: Vec::new(),
            dev_free: DEVICE as usize,
            host_free: HOST as usize - PRELOADED as usize,
            quarantine: BTreeMap::new(),
            transfers: BTreeMap::new(),
            handles: BTreeMap::new(),
            next_tid: 1 + u64::from(PRELOADED),
            next_hid: 1,
            dropped: BTreeSet::new(),
            chance: BTreeSet::new(),
            chances: 0,
            grant_chances: 0,
            granted: Vec::new(),
            last_grant: 0,
            granted_slots: 0,
            outcome: Outcome::Ok,
        };
        for page in 0..PRELOADED {
            let uid = m.next_uid;
            m.next_uid += 1;
            let key = (page % NAMESPACES, page);
            m.objs.insert(
                uid,
                MObj {
                    key,
                    dev: MDev::Absent,
                    host: MHost::Ready,
                    pins: 0,
                    dropped: false,
                },
            );
            m.index.insert(key, uid);
        }
        Just(m).boxed()
    }

    fn transitions(s: &Model) -> BoxedStrategy<Step> {
        // Ids drawn from what exists, plus a bogus one, so error paths are exercised too.
        let pick = |ids: Vec<u64>, bogus: u64| {
            let mut ids = ids;
            ids.push(bogus);
            proptest::sample::select(ids)
        };
        // In-flight transfers twice, so completes and failures mostly hit live work.
        let tids: Vec<u64> = s
            .transfers
            .iter()
            .flat_map(|(&t, tr)| std::iter::repeat_n(t, if tr.state == 0 { 3 } else { 1 }))
            .collect();
        let quarantined: Vec<u64> = s.quarantine.keys().copied().collect();
        let hids: Vec<u64> = s.handles.keys().copied().collect();
        let bogus_t = s.next_tid + 7;
        let bogus_h = s.next_hid + 7;
        // Reads name the namespaces of evictable objects (and one with none), so that the
        // next evictions meet their second chances.
        let mut read_ns: Vec<u8> = s.lru.iter().map(|u| s.objs[u].key.0).collect();
        read_ns.push(NAMESPACES);
        let pick_ns = |ns: Vec<u8>| proptest::sample::select(ns);
        let victims = s.granted.len();
        prop_oneof![
            2 => keys_strategy().prop_map(Step::Allocate),
            4 => keys_strategy().prop_map(Step::Resolve),
            3 => pick(tids.clone(), bogus_t).prop_map(Step::Complete),
            2 => pick(tids.clone(), bogus_t).prop_map(Step::BackupComplete),
            2 => (pick(tids, bogus_t), any::<bool>()).prop_map(|(t, e)| Step::Fail(t, e)),
            2 => pick(quarantined, bogus_t).prop_map(Step::Ended),
            3 => pick(hids, bogus_h).prop_map(Step::Release),
            2 => keys_strategy().prop_map(Step::Backup),
            1 => (0..4usize).prop_map(Step::Evict),
            1 => (0..NAMESPACES + 1).prop_map(Step::Drop),
            3 => proptest::collection::vec(pick_ns(read_ns), 0..3).prop_map(Step::Reads),
            2 => (0..4usize).prop_map(Step::GrantVictims),
            1 => (0..3usize).prop_map(Step::GrantSlots),
            2 => (0..victims + 1).prop_map(Step::TakeVictim),
            2 => (0..victims + 1).prop_map(Step::Unhold),
            1 => Just(Step::ReturnSlots),
        ]
        .boxed()
    }

    fn apply(mut s: Model, step: &Step) -> Model {
        s.outcome = match step {
            Step::Allocate(k) => s.allocate(k),
            Step::Resolve(k) => s.resolve(k),
            Step::Complete(t) => s.complete(*t, true),
            Step::BackupComplete(t) => s.complete(*t, false),
            Step::Fail(t, e) => s.fail(*t, *e),
            Step::Ended(t) => s.ended(*t),
            Step::Release(h) => s.release(*h),
            Step::Backup(k) => s.backup(k),
            Step::Evict(n) => {
                s.evict(*n);
                Outcome::Ok
            }
            Step::Drop(ns) => s.drop_ns(*ns),
            Step::Reads(ns) => {
                s.chance = s
                    .lru
                    .iter()
                    .copied()
                    .filter(|u| ns.contains(&s.objs[u].key.0))
                    .collect();
                Outcome::Ok
            }
            Step::GrantVictims(n) => {
                s.grant_victims(*n);
                Outcome::Ok
            }
            Step::GrantSlots(n) => s.grant_slots(*n),
            Step::TakeVictim(i) => s.end_victim(*i, true),
            Step::Unhold(i) => s.end_victim(*i, false),
            Step::ReturnSlots => {
                s.dev_free += s.granted_slots;
                s.granted_slots = 0;
                Outcome::Ok
            }
        };
        s
    }
}

fn kind(e: &Error) -> Outcome {
    match e {
        Error::NotResident { .. } => Outcome::NotResident,
        Error::OutOfSlots { .. } => Outcome::OutOfSlots,
        Error::KeyExists { .. } => Outcome::KeyExists,
        Error::NamespaceDropped { .. } => Outcome::Dropped,
        Error::UnknownTransfer { .. } | Error::TransferState { .. } => Outcome::BadTransfer,
        Error::UnknownHandle { .. } => Outcome::BadHandle,
        Error::InvalidTransition { .. } => Outcome::Invalid,
        Error::Config { .. } => Outcome::Config,
        other => panic!("unexpected error {other}"),
    }
}

/// The directory and the ids it issued, in order. The model numbers transfers and pin handles
/// 1, 2, ... per directory; the directory draws them from the process-wide serial (an id of
/// one directory is never another's), so the test maps one onto the other.
struct Sut {
    d: Directory,
    tids: Vec<TransferId>,
    hids: Vec<PinHandleId>,
    /// The victims granted, as the model orders them: (object index, slot).
    victims: Vec<(u32, SlotId)>,
    /// Slots granted and not yet returned.
    slots: Vec<SlotId>,
}

impl Sut {
    /// The directory's transfer for model transfer `t` (one never issued for a model id the
    /// directory has not reached).
    fn tid(&self, t: u64) -> TransferId {
        let at = usize::try_from(t - 1).unwrap();
        self.tids
            .get(at)
            .copied()
            .unwrap_or(TransferId::new(u64::MAX - t))
    }

    fn hid(&self, h: u64) -> PinHandleId {
        let at = usize::try_from(h - 1).unwrap();
        self.hids
            .get(at)
            .copied()
            .unwrap_or(PinHandleId::new(u64::MAX - h))
    }

    /// The model's number of transfer `t`.
    fn model_tid(&self, t: TransferId) -> u64 {
        1 + self
            .tids
            .iter()
            .position(|&x| x == t)
            .expect("an issued transfer") as u64
    }

    fn issued(&mut self, t: TransferId) {
        assert!(!self.tids.contains(&t), "transfer {t} issued twice");
        self.tids.push(t);
    }
}

struct DirTest;

impl StateMachineTest for DirTest {
    type SystemUnderTest = Sut;
    type Reference = Ref;

    fn init_test(_: &Model) -> Sut {
        let d = Directory::new(DirectoryConfig {
            device_pages: DEVICE,
            device_reserve: 0,
            host_pages: HOST,
            host_reserve: 0,
            object_bytes: 4096,
        })
        .unwrap();
        let mut sut = Sut {
            d,
            tids: Vec::new(),
            hids: Vec::new(),
            victims: Vec::new(),
            slots: Vec::new(),
        };
        for page in 0..PRELOADED {
            let k = [okey((page % NAMESPACES, page))];
            sut.d.allocate(&k).unwrap();
            let t = sut.d.backup(&k).unwrap().transfer.unwrap();
            sut.issued(t);
            sut.d.backup_complete(t).unwrap();
            assert_eq!(sut.d.evict(1), k.to_vec());
        }
        sut
    }

    fn apply(mut sut: Sut, m: &Model, step: Step) -> Sut {
        let keys = |k: &[K]| k.iter().map(|&k| okey(k)).collect::<Vec<_>>();
        let got: Result<()> = match &step {
            Step::Allocate(k) => sut.d.allocate(&keys(k)).map(drop),
            Step::Resolve(k) => sut.d.resolve(&keys(k), None).map(|r| {
                assert!(!sut.hids.contains(&r.handle), "a handle issued twice");
                sut.hids.push(r.handle);
                assert_eq!(sut.hids.len() as u64, m.next_hid - 1);
                for l in &r.loads {
                    sut.issued(l.transfer);
                }
                assert_eq!(r.slots.len(), k.len());
            }),
            Step::Complete(t) => sut.d.complete(sut.tid(*t)),
            Step::BackupComplete(t) => sut.d.backup_complete(sut.tid(*t)),
            Step::Fail(t, e) => sut.d.fail(sut.tid(*t), "model", *e),
            Step::Ended(t) => sut.d.transfer_ended(sut.tid(*t)),
            Step::Release(h) => sut.d.release(sut.hid(*h)).map(drop),
            Step::Backup(k) => sut.d.backup(&keys(k)).map(|p| {
                if let Some(t) = p.transfer {
                    sut.issued(t);
                }
            }),
            Step::Evict(n) => {
                sut.d.evict(*n);
                Ok(())
            }
            Step::Drop(ns) => sut
                .d
                .drop_namespace(Namespace {
                    id: u64::from(*ns),
                    version: 0,
                })
                .map(drop),
            Step::Reads(ns) => {
                let mut bits = vec![0u32; 1];
                for &n in ns {
                    bits[0] |= 1 << n;
                }
                sut.d.publish_reads(std::sync::Arc::new(bits), 0, 1);
                Ok(())
            }
            Step::GrantVictims(n) => {
                let got = sut.d.grant_victims(*n);
                let want = &m.granted[m.granted.len() - m.last_grant..];
                let got_keys: Vec<ObjectKey> = got.iter().map(|&(_, k, _)| k).collect();
                let want_keys: Vec<ObjectKey> = want.iter().map(|u| okey(m.objs[u].key)).collect();
                assert_eq!(got_keys, want_keys, "victims granted, in order");
                sut.victims.extend(got.iter().map(|&(i, _, s)| (i, s)));
                Ok(())
            }
            Step::GrantSlots(n) => sut.d.grant_slots(*n).map(|s| sut.slots.extend(s)),
            Step::TakeVictim(i) | Step::Unhold(i) => {
                let take = matches!(step, Step::TakeVictim(_));
                // Past the end: an object that is not a granted victim.
                let (idx, slot) = if *i < sut.victims.len() {
                    sut.victims.remove(*i)
                } else {
                    (u32::MAX, SlotId::new(0))
                };
                if take {
                    sut.d
                        .take_victims(&[(idx, slot)])
                        .map(|()| sut.slots.push(slot))
                } else {
                    sut.d.unhold(&[idx])
                }
            }
            Step::ReturnSlots => {
                let slots = std::mem::take(&mut sut.slots);
                sut.d.return_slots(&slots)
            }
        };
        let got = match got {
            Ok(()) => Outcome::Ok,
            Err(e) => kind(&e),
        };
        assert_eq!(got, m.outcome, "outcome of {step:?}");
        assert_eq!(sut.tids.len() as u64 + 1, m.next_tid, "transfers issued");
        sut
    }

    fn check_invariants(sut: &Sut, m: &Model) {
        let d = &sut.d;
        d.validate().unwrap();
        for ns in 0..NAMESPACES {
            for page in 0..PAGES {
                let k = (ns, page);
                let got = d.state(&okey(k));
                let want = m.index.get(&k).map(|u| &m.objs[u]);
                match (got, want) {
                    (None, None) => {}
                    (Some(g), Some(w)) => {
                        let dev = match g.device {
                            DeviceState::Absent => MDev::Absent,
                            DeviceState::Loading { transfer, .. } => {
                                MDev::Loading(sut.model_tid(transfer))
                            }
                            DeviceState::Ready { .. } => MDev::Ready,
                        };
                        let host = match g.host {
                            HostState::None => MHost::None,
                            HostState::Writing { transfer, .. } => {
                                MHost::Writing(sut.model_tid(transfer))
                            }
                            HostState::Ready { .. } => MHost::Ready,
                        };
                        assert_eq!((dev, host, g.pins), (w.dev, w.host, w.pins), "object {k:?}");
                    }
                    (g, w) => panic!("object {k:?}: directory {g:?}, model {w:?}"),
                }
            }
        }
        let s = d.stats();
        let qd: usize = m.quarantine.values().map(|q| q.0).sum();
        let qh: usize = m.quarantine.values().map(|q| q.1).sum();
        assert_eq!((s.device_free, s.device_quarantined), (m.dev_free, qd));
        assert_eq!((s.host_free, s.host_quarantined), (m.host_free, qh));
        assert_eq!(s.objects, m.objs.len());
        assert_eq!(s.evictable, m.lru.len());
        let t = &s.totals;
        let chances = (t.second_chances, t.grant_second_chances);
        assert_eq!(
            chances,
            (m.chances, m.grant_chances),
            "second chances given"
        );
        assert_eq!(sut.victims.len(), m.granted.len());
        for &(idx, slot) in &sut.victims {
            assert!(d.is_held_at(idx, slot), "victim {idx} held at {slot:?}");
        }
        assert_eq!(sut.slots.len(), m.granted_slots);
        for &slot in &sut.slots {
            assert!(d.is_granted(slot), "slot {slot:?} granted");
        }
    }
}

/// The same machine with the LRU list sweeping early and slowly (a sweep starts at the first
/// stale entries and moves on two entries a push), so that pops, evictions, pins and drops
/// meet a sweep in progress and its hole.
struct DirSweepTest;

impl StateMachineTest for DirSweepTest {
    type SystemUnderTest = Sut;
    type Reference = Ref;

    fn init_test(model: &Model) -> Sut {
        let sut = DirTest::init_test(model);
        sut.d.tune_lru(-2, 1, 1);
        sut
    }

    fn apply(sut: Sut, model: &Model, step: Step) -> Sut {
        DirTest::apply(sut, model, step)
    }

    fn check_invariants(sut: &Sut, model: &Model) {
        DirTest::check_invariants(sut, model)
    }
}

prop_state_machine! {
    #![proptest_config(crate::testing::proptest_config(1000, "directory"))]
    #[test]
    fn directory_matches_reference_model(sequential 1..60 => DirTest);

    #[test]
    fn directory_with_early_sweeps_matches_reference_model(sequential 1..60 => DirSweepTest);
}
