//! `KeyTable`: the offload keys the directory knows, interned once, with every per-key field.
//!
//! An engine names a chunk by an opaque byte key (vLLM's `OffloadKey`: a block hash followed
//! by a 4-byte big-endian KV-group index). Each key is hashed once per call and then handled
//! by its [`KeyId`], an index into this arena. The entry holds everything the structures of
//! the directory keep about the key (its chunk, its LRU rank, its place in an ARC list or the
//! reuse tracker, how many request records saw it), so each structure is an index over the
//! arena rather than a map of its own.
//!
//! An entry lives while anything refers to it ([`KeyEntry::is_referenced`]); callers that drop
//! a reference call [`KeyTable::release`], which frees an unreferenced entry. A `KeyId` never
//! leaves the crate, so a reused slot cannot alias a caller's handle.

use crate::error::{Error, Result};
use hashbrown::HashTable;
use std::hash::BuildHasher;
/// Index of an interned key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyId(u32);

impl KeyId {
    /// The arena index.
    #[inline]
    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }
}

/// A chunk slot of the host pool (vLLM's chunk id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub u32);

/// A resident key's chunk and who uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// The slot.
    pub id: ChunkId,
    /// Loads reading it; [`Chunk::STORING`] while its store is in flight.
    pub refs: i32,
}

impl Chunk {
    /// `refs` of a chunk whose store has not completed: not readable, not evictable.
    pub const STORING: i32 = -1;

    /// Whether its store completed (it may be read).
    #[inline]
    pub fn is_ready(self) -> bool {
        self.refs >= 0
    }
}

/// "No neighbour" in a [`Link`].
pub(crate) const NIL: u32 = u32::MAX;

/// A key's place in one intrusive list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Link {
    pub prev: u32,
    pub next: u32,
}

impl Default for Link {
    fn default() -> Self {
        Link {
            prev: NIL,
            next: NIL,
        }
    }
}

/// Which of the ARC policy's four lists a key is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ArcList {
    /// Resident, seen once.
    T1,
    /// Resident, reused.
    T2,
    /// Ghost of a key evicted from T1.
    B1,
    /// Ghost of a key evicted from T2.
    B2,
}

/// A key's bytes, inline up to 38 bytes (a 32-byte hash and the group index fit), so that
/// comparing a key reads the entry it lives in and nothing else.
#[derive(Clone, PartialEq, Eq)]
pub enum KeyBytes {
    /// Up to 38 bytes, in place.
    Inline {
        /// Bytes used.
        len: u8,
        /// The bytes.
        data: [u8; 38],
    },
    /// Longer keys.
    Heap(Box<[u8]>),
}

impl KeyBytes {
    /// A copy of `bytes`.
    pub fn new(bytes: &[u8]) -> Self {
        if bytes.len() <= 38 {
            let mut data = [0u8; 38];
            data[..bytes.len()].copy_from_slice(bytes);
            KeyBytes::Inline {
                len: bytes.len() as u8,
                data,
            }
        } else {
            KeyBytes::Heap(bytes.into())
        }
    }
}

impl std::ops::Deref for KeyBytes {
    type Target = [u8];
    #[inline]
    fn deref(&self) -> &[u8] {
        match self {
            KeyBytes::Inline { len, data } => &data[..*len as usize],
            KeyBytes::Heap(b) => b,
        }
    }
}

impl std::fmt::Debug for KeyBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:02x?}", &**self)
    }
}

/// Everything the directory keeps about one key. What a lookup reads (hash, bytes, chunk)
/// comes first, within one cache line.
#[derive(Debug, Clone)]
#[repr(C)]
pub struct KeyEntry {
    /// The index's hash of the bytes.
    pub(crate) hash: u64,
    /// The key's bytes.
    pub(crate) bytes: KeyBytes,
    /// Its chunk while resident.
    pub(crate) chunk: Option<Chunk>,
    /// The KV-cache group index (the key's last four bytes).
    pub(crate) group: u32,
    /// Request records that saw it.
    pub(crate) holders: u32,
    /// LRU recency: (request or global rank, minus token position); lower is evicted first.
    pub(crate) rank: (u64, i64),
    /// Bumped on every LRU queue push: only the entry with the latest stamp is current.
    pub(crate) heap_seq: u32,
    /// Its ARC list, if any, and its links there.
    pub(crate) arc: Option<ArcList>,
    pub(crate) arc_link: Link,
    /// Its reuse-tracker count, if tracked, and its links there.
    pub(crate) tracked: Option<u32>,
    pub(crate) tracker_link: Link,
    /// The call that last counted it in the tracker (dedups a call's repeats).
    pub(crate) tracker_stamp: u64,
}

impl KeyEntry {
    /// Whether any structure refers to the key (an unreferenced entry is freed).
    pub(crate) fn is_referenced(&self) -> bool {
        self.chunk.is_some() || self.arc.is_some() || self.tracked.is_some() || self.holders > 0
    }

    /// The key's bytes.
    #[inline]
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// The arena of keys and the index from bytes to ids: a table of ids hashed by the hash each
/// entry keeps, so that a probe touches the small table and, only for a likely match, one
/// entry; removing an id never reads its bytes.
#[derive(Default)]
pub struct KeyTable {
    slots: Vec<Option<KeyEntry>>,
    free: Vec<u32>,
    index: HashTable<KeyId>,
    hasher: rustc_hash::FxBuildHasher,
}

impl std::fmt::Debug for KeyTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyTable")
            .field("keys", &self.index.len())
            .finish()
    }
}

/// The KV-group index an offload key ends with, or an error naming `field`.
pub fn group_of(bytes: &[u8], field: &str) -> Result<u32> {
    let n = bytes.len();
    if n < 4 {
        return Err(Error::config(
            field,
            format!("a key of {n} bytes"),
            "an offload key: a block hash followed by a 4-byte big-endian group index",
        ));
    }
    Ok(u32::from_be_bytes([
        bytes[n - 4],
        bytes[n - 3],
        bytes[n - 2],
        bytes[n - 1],
    ]))
}

impl KeyTable {
    #[inline]
    fn hash(&self, bytes: &[u8]) -> u64 {
        self.hasher.hash_one(bytes)
    }

    /// The id of `bytes`, if known.
    #[inline]
    pub fn find(&self, bytes: &[u8]) -> Option<KeyId> {
        let h = self.hash(bytes);
        let slots = &self.slots;
        self.index
            .find(h, |id| {
                let e = slots[id.index()].as_ref().expect("indexed ids are live");
                e.hash == h && *e.bytes == *bytes
            })
            .copied()
    }

    /// The id of `bytes`, interning it (unreferenced) if new. `bytes` must be a checked key
    /// ([`group_of`]).
    pub fn intern(&mut self, bytes: &[u8]) -> KeyId {
        let h = self.hash(bytes);
        if let Some(id) = self.find(bytes) {
            return id;
        }
        let entry = KeyEntry {
            hash: h,
            bytes: KeyBytes::new(bytes),
            chunk: None,
            group: group_of(bytes, "key").unwrap_or(0),
            holders: 0,
            rank: (0, 0),
            heap_seq: 0,
            arc: None,
            arc_link: Link::default(),
            tracked: None,
            tracker_link: Link::default(),
            tracker_stamp: 0,
        };
        let id = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = Some(entry);
                KeyId(i)
            }
            None => {
                self.slots.push(Some(entry));
                KeyId((self.slots.len() - 1) as u32)
            }
        };
        let slots = &self.slots;
        self.index.insert_unique(h, id, |id| {
            slots[id.index()]
                .as_ref()
                .expect("indexed ids are live")
                .hash
        });
        id
    }

    /// Frees `id` if nothing refers to it any more.
    pub fn release(&mut self, id: KeyId) {
        let unreferenced = self.slots[id.index()]
            .as_ref()
            .is_some_and(|e| !e.is_referenced());
        if unreferenced {
            let e = self.slots[id.index()].take().expect("checked above");
            if let Ok(found) = self.index.find_entry(e.hash, |x| *x == id) {
                found.remove();
            }
            self.free.push(id.0);
        }
    }

    /// The entry of a live id.
    #[inline]
    pub fn get(&self, id: KeyId) -> &KeyEntry {
        self.slots[id.index()].as_ref().expect("a live key id")
    }

    /// The entry of a live id, mutably.
    #[inline]
    pub fn get_mut(&mut self, id: KeyId) -> &mut KeyEntry {
        self.slots[id.index()].as_mut().expect("a live key id")
    }

    /// Live keys.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no key is live.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Every live id with its entry.
    pub fn iter(&self) -> impl Iterator<Item = (KeyId, &KeyEntry)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.as_ref().map(|e| (KeyId(i as u32), e)))
    }

    /// Checks the map against the arena: every live entry is indexed under its bytes, and
    /// every entry is referenced (unreferenced ones were released).
    pub fn validate(&self) -> std::result::Result<(), String> {
        let live = self.slots.iter().filter(|e| e.is_some()).count();
        if live != self.index.len() {
            return Err(format!(
                "{live} live key entries but {} indexed",
                self.index.len()
            ));
        }
        for (id, e) in self.iter() {
            if self.find(&e.bytes) != Some(id) {
                return Err(format!("key {id:?} is not indexed under its bytes"));
            }
            if !e.is_referenced() {
                return Err(format!("key {id:?} is live but nothing refers to it"));
            }
        }
        Ok(())
    }
}

/// An intrusive doubly-linked list over the arena, through one of the entry's links.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyList {
    head: u32,
    tail: u32,
    len: usize,
}

impl Default for KeyList {
    fn default() -> Self {
        KeyList {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }
}

/// Which link of an entry a [`KeyList`] threads through.
pub(crate) trait LinkOf {
    fn link(e: &mut KeyEntry) -> &mut Link;
    fn read(e: &KeyEntry) -> Link;
}

/// The ARC lists' link.
pub(crate) struct ArcLink;
impl LinkOf for ArcLink {
    #[inline]
    fn link(e: &mut KeyEntry) -> &mut Link {
        &mut e.arc_link
    }
    #[inline]
    fn read(e: &KeyEntry) -> Link {
        e.arc_link
    }
}

/// The reuse tracker's link.
pub(crate) struct TrackerLink;
impl LinkOf for TrackerLink {
    #[inline]
    fn link(e: &mut KeyEntry) -> &mut Link {
        &mut e.tracker_link
    }
    #[inline]
    fn read(e: &KeyEntry) -> Link {
        e.tracker_link
    }
}

impl KeyList {
    pub fn len(&self) -> usize {
        self.len
    }

    /// The oldest key.
    pub fn front(&self) -> Option<KeyId> {
        (self.head != NIL).then_some(KeyId(self.head))
    }

    /// The key after `index`.
    pub fn next<L: LinkOf>(&self, keys: &KeyTable, id: KeyId) -> Option<KeyId> {
        let n = L::read(keys.get(id)).next;
        (n != NIL).then_some(KeyId(n))
    }

    /// Appends `id` (not in this list) as the newest.
    pub fn push_back<L: LinkOf>(&mut self, keys: &mut KeyTable, id: KeyId) {
        let tail = self.tail;
        *L::link(keys.get_mut(id)) = Link {
            prev: tail,
            next: NIL,
        };
        if tail == NIL {
            self.head = id.0;
        } else {
            L::link(keys.get_mut(KeyId(tail))).next = id.0;
        }
        self.tail = id.0;
        self.len += 1;
    }

    /// Takes `id` (in this list) out.
    pub fn unlink<L: LinkOf>(&mut self, keys: &mut KeyTable, id: KeyId) {
        let Link { prev, next } = std::mem::take(L::link(keys.get_mut(id)));
        if prev == NIL {
            self.head = next;
        } else {
            L::link(keys.get_mut(KeyId(prev))).next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            L::link(keys.get_mut(KeyId(next))).prev = prev;
        }
        self.len -= 1;
    }

    /// Moves `id` (in this list) to the newest end.
    pub fn move_to_back<L: LinkOf>(&mut self, keys: &mut KeyTable, id: KeyId) {
        if self.tail != id.0 {
            self.unlink::<L>(keys, id);
            self.push_back::<L>(keys, id);
        }
    }

    /// Every key, oldest first.
    pub fn collect<L: LinkOf>(&self, keys: &KeyTable) -> Vec<KeyId> {
        let mut out = Vec::with_capacity(self.len);
        let mut at = self.head;
        while at != NIL {
            out.push(KeyId(at));
            at = L::read(keys.get(KeyId(at))).next;
        }
        out
    }

    /// Empties the list without touching entries (for a clear that rebuilds them).
    pub fn forget(&mut self) {
        *self = KeyList::default();
    }
}
