//! The prefix tree: a radix tree over token ids at page granularity, one root per namespace
//! (model version), whose nodes hold device pages and/or host pages.
//!
//! # Invariants (checked by [`RadixTree::validate`])
//! - every key is a whole number of pages; a node's page vectors are one entry per key page;
//! - a match returns its device part (readable pages) first and the restorable part after.
//!   Device residency is prefix-closed except after a failed load-back under a node that
//!   gained device children meanwhile: the parent is host-only again, and a later load-back
//!   restores it alone;
//! - `device_children` counts the children with device pages;
//! - a node is in the device LRU set iff it is device-evictable (device pages, not loading,
//!   unlocked, no child on the device) and in the host LRU set iff host-evictable (host copy
//!   Ready, no device pages, unlocked, not pinned by an L3 write, no children): locked nodes
//!   are never evicted;
//! - lock counts equal the number of outstanding locks whose path passes through the node.
//!
//! The tree owns no pages: it hands page ids back (evicted, duplicate) and the cache above it
//! returns them to the allocators.

use crate::error::{Error, Result};
use crate::ids::PageId;
use rustc_hash::FxHashMap;
use slab::Slab;
use std::collections::BTreeSet;

use super::token_id::page_key;
pub use super::token_id::TokenId;

mod copies;
mod evict;
mod l3;
mod validate;

const NIL: usize = usize::MAX;

/// A node id as handed out: slab index and generation, so a stale id misses instead of
/// aliasing the node that reused the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(u64);

impl NodeId {
    fn new(idx: usize, gen: u32) -> Self {
        NodeId((u64::from(gen) << 32) | idx as u64)
    }
    fn idx(self) -> usize {
        (self.0 & 0xFFFF_FFFF) as usize
    }
    fn gen(self) -> u32 {
        (self.0 >> 32) as u32
    }
    /// The raw id.
    pub const fn raw(self) -> u64 {
        self.0
    }
    /// From a raw id.
    pub const fn from_raw(raw: u64) -> Self {
        NodeId(raw)
    }
}

/// The host copy of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostCopy {
    /// None.
    None,
    /// A backup (transfer `u64`) is writing it: not yet a hit source.
    Writing(u64),
    /// Complete.
    Ready,
}

#[derive(Debug)]
struct Node {
    gen: u32,
    parent: usize,
    key: Vec<u32>,
    /// Device pages, one per key page; empty when not on the device.
    device: Vec<PageId>,
    /// A load-back (transfer id) is writing `device`: not readable yet.
    loading: Option<u64>,
    /// Host pages, one per key page; empty when `host` is `None`.
    host_pages: Vec<PageId>,
    host: HostCopy,
    /// Locks held on this node or below it (what keeps it from eviction).
    lock_ref: u32,
    /// Locks taken on this node itself (`lock`, or an insert that locked its path here): only
    /// these can be released by `unlock` of this node; a lock of a descendant is released by
    /// unlocking that descendant. Invariant: `lock_ref` is `own_locks` plus the children's
    /// `lock_ref`.
    own_locks: u32,
    /// L3 writes reading the host pages: the node stays off the host LRU set (its device
    /// pages and its ancestors are unaffected; an ancestor has this child, so it is no host
    /// leaf either).
    storage_pins: u32,
    hits: u64,
    stamp: u64,
    /// Children by the key of their first page ([`page_key`]); children whose first pages
    /// differ but share a key (possible only for pages over two tokens) chain through
    /// `next_same_key`.
    children: FxHashMap<u64, usize>,
    /// The next sibling with the same first-page key, or `NIL`.
    next_same_key: usize,
    device_children: u32,
    /// Stamps under which the node sits in the LRU sets, if it does.
    in_device_lru: Option<u64>,
    in_host_lru: Option<u64>,
}

impl Node {
    fn on_device(&self) -> bool {
        !self.device.is_empty()
    }
}

/// A walk's nodes: a path is a few nodes deep, so it lives on the stack.
type Path = smallvec::SmallVec<[usize; 8]>;

/// The generation of a new node: the low 32 bits of the process-wide serial, never 0 (node
/// ids of every tree in the process stay apart until four billion nodes were made).
fn next_generation() -> u32 {
    loop {
        let g = crate::ids::serial() as u32;
        if g != 0 {
            return g;
        }
    }
}

/// Where a walk of some tokens ends, found without changing the tree.
struct Descent {
    /// Nodes matched in full, root first.
    path: Path,
    /// The node where the match ends inside, and its pages matched (the walk splits it there).
    split: Option<(usize, usize)>,
    /// Tokens matched, the split node's included.
    pos: usize,
}

/// What `match_prefix` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatchResult {
    /// Tokens whose pages are readable on the device.
    pub device_len: usize,
    /// Tokens after those that can be restored from host (host copy Ready, or a load already
    /// in flight).
    pub host_len: usize,
    /// Device pages of the device part, in order.
    pub device_pages: Vec<PageId>,
    /// The last node of the device part (the root's id when empty): lock it to keep the pages.
    pub device_node: NodeId,
    /// The last node of the whole match: what `load_back` restores up to.
    pub last_node: NodeId,
}

/// What `insert` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InsertResult {
    /// Tokens that were already cached (on either tier) before this insert.
    pub prefix_len: usize,
    /// Pages given for positions already on the device under other pages: the caller frees
    /// them.
    pub duplicates: Vec<PageId>,
    /// Given pages that already were the tree's own at their position (a caller passing the
    /// matched path's pages back, as SGLang's scheduler does).
    pub own: usize,
    /// The node holding the last page of the tokens.
    pub last_node: NodeId,
    /// Nodes on the path that are on the device with no host copy: write-through candidates.
    pub needs_backup: Vec<NodeId>,
}

/// What a load-back of a path must do: nodes to load (root first), and nodes already
/// loading with their transfer.
pub type Restorable = (Vec<NodeId>, Vec<(NodeId, u64)>);

/// The radix tree.
#[derive(Debug)]
pub struct RadixTree {
    page_size: usize,
    nodes: Slab<Node>,
    roots: FxHashMap<u32, usize>,
    clock: u64,
    device_lru: BTreeSet<(u64, usize)>,
    host_lru: BTreeSet<(u64, usize)>,
    device_pages: usize,
    host_pages: usize,
    /// Device pages of locked nodes (kept by `lock`, `unlock` and `set_device`).
    locked_device_pages: usize,
    #[cfg(test)]
    colliding: bool,
}

impl RadixTree {
    /// An empty tree with `page_size` tokens per page.
    pub fn new(page_size: usize) -> Result<Self> {
        if page_size == 0 || page_size > 1 << 16 {
            return Err(Error::config(
                "page_size",
                page_size,
                "1 <= page_size <= 65536",
            ));
        }
        Ok(RadixTree {
            page_size,
            nodes: Slab::new(),
            roots: FxHashMap::default(),
            clock: 0,
            device_lru: BTreeSet::new(),
            host_lru: BTreeSet::new(),
            device_pages: 0,
            host_pages: 0,
            locked_device_pages: 0,
            #[cfg(test)]
            colliding: false,
        })
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Device pages held by the tree.
    pub fn device_pages(&self) -> usize {
        self.device_pages
    }

    /// Host pages held by the tree.
    pub fn host_pages(&self) -> usize {
        self.host_pages
    }

    /// Nodes, roots included.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// Device pages eviction could free now: nodes with a Ready host copy, and with
    /// `drop_unbacked` childless ones without. (Dropping a leaf can free its parent in turn;
    /// that is not counted, so this is a lower bound.)
    pub fn evictable_device_pages_now(&self, drop_unbacked: bool) -> usize {
        self.device_lru
            .iter()
            .map(|&(_, i)| &self.nodes[i])
            .filter(|n| n.host == HostCopy::Ready || (drop_unbacked && n.children.is_empty()))
            .map(|n| n.device.len())
            .sum()
    }

    /// Device pages of every unlocked node: what eviction can free once the nodes below them
    /// are gone too (SGLang's `evictable_size`). The figure admission wants ("free + evictable
    /// >= need"); a load in flight counts (it becomes evictable when it lands).
    pub fn evictable_device_pages_total(&self) -> usize {
        self.device_pages - self.locked_device_pages
    }

    fn new_node(&mut self, parent: usize, key: Vec<u32>) -> usize {
        // From the process-wide serial: a node id from another tree is unknown here.
        let gen = next_generation();
        self.nodes.insert(Node {
            gen,
            parent,
            key,
            device: Vec::new(),
            loading: None,
            host_pages: Vec::new(),
            host: HostCopy::None,
            lock_ref: 0,
            own_locks: 0,
            storage_pins: 0,
            hits: 0,
            stamp: 0,
            children: FxHashMap::default(),
            next_same_key: NIL,
            device_children: 0,
            in_device_lru: None,
            in_host_lru: None,
        })
    }

    fn root(&mut self, ns: u32) -> usize {
        if let Some(&r) = self.roots.get(&ns) {
            return r;
        }
        let r = self.new_node(NIL, Vec::new());
        self.roots.insert(ns, r);
        r
    }

    fn id(&self, idx: usize) -> NodeId {
        NodeId::new(idx, self.nodes[idx].gen)
    }

    /// The slab index of a live node id.
    fn resolve(&self, id: NodeId) -> Result<usize> {
        match self.nodes.get(id.idx()) {
            Some(n) if n.gen == id.gen() => Ok(id.idx()),
            _ => Err(Error::UnknownNode { id: id.raw() }),
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Re-derives the node's LRU-set memberships: the one place they change.
    fn refresh(&mut self, idx: usize) {
        let n = &self.nodes[idx];
        let is_root = n.parent == NIL;
        let dev = !is_root
            && n.on_device()
            && n.loading.is_none()
            && n.lock_ref == 0
            && n.device_children == 0;
        let host = !is_root
            && n.host == HostCopy::Ready
            && !n.on_device()
            && n.loading.is_none()
            && n.lock_ref == 0
            && n.storage_pins == 0
            && n.children.is_empty();
        let stamp = n.stamp;
        let (in_dev, in_host) = (n.in_device_lru, n.in_host_lru);
        if in_dev != dev.then_some(stamp) {
            if let Some(s) = in_dev {
                self.device_lru.remove(&(s, idx));
            }
            if dev {
                self.device_lru.insert((stamp, idx));
            }
            self.nodes[idx].in_device_lru = dev.then_some(stamp);
        }
        if in_host != host.then_some(stamp) {
            if let Some(s) = in_host {
                self.host_lru.remove(&(s, idx));
            }
            if host {
                self.host_lru.insert((stamp, idx));
            }
            self.nodes[idx].in_host_lru = host.then_some(stamp);
        }
    }

    fn touch(&mut self, idx: usize) {
        let t = self.tick();
        self.nodes[idx].stamp = t;
        self.refresh(idx);
    }

    /// Sets or clears a node's device pages, keeping the parent's child count and the page
    /// total right.
    fn set_device(&mut self, idx: usize, pages: Vec<PageId>) -> Vec<PageId> {
        let was = self.nodes[idx].on_device();
        let old = std::mem::replace(&mut self.nodes[idx].device, pages);
        let now = self.nodes[idx].on_device();
        self.device_pages = self.device_pages - old.len() + self.nodes[idx].device.len();
        if self.nodes[idx].lock_ref > 0 {
            self.locked_device_pages =
                self.locked_device_pages - old.len() + self.nodes[idx].device.len();
        }
        let parent = self.nodes[idx].parent;
        if was != now && parent != NIL {
            if now {
                self.nodes[parent].device_children += 1;
            } else {
                self.nodes[parent].device_children -= 1;
            }
            self.refresh(parent);
        }
        self.refresh(idx);
        old
    }

    /// Splits `idx` after `pages` pages: a new node takes the first part and becomes `idx`'s
    /// parent. Returns the new node. Transfers in flight on `idx` cover both parts: the caller
    /// of the transfer finds both through `on_split`.
    fn split(&mut self, idx: usize, pages: usize) -> usize {
        let ps = self.page_size;
        let parent = self.nodes[idx].parent;
        // One copy of each part at most: the tail moves out, the head stays in the old buffer
        // (shrunk: in place where the allocator can).
        let mut head_key = std::mem::take(&mut self.nodes[idx].key);
        let tail_key = head_key.split_off(pages * ps);
        head_key.shrink_to_fit();
        let head = self.new_node(parent, head_key);
        // The head is a new node, as fresh as now (as SGLang's split makes it): it outlives
        // its old tail in LRU order once it becomes a leaf.
        let fresh = self.tick();
        let n = &mut self.nodes[idx];
        let dev_tail = if n.device.is_empty() {
            Vec::new()
        } else {
            n.device.split_off(pages)
        };
        let dev_head = std::mem::replace(&mut n.device, dev_tail);
        let host_tail = if n.host_pages.is_empty() {
            Vec::new()
        } else {
            n.host_pages.split_off(pages)
        };
        let host_head = std::mem::replace(&mut n.host_pages, host_tail);
        let (host, loading, lock_ref, hits) = (n.host, n.loading, n.lock_ref, n.hits);
        n.key = tail_key;
        n.parent = head;
        let on_dev = n.on_device();
        let h = &mut self.nodes[head];
        h.device = dev_head;
        h.host_pages = host_head;
        h.host = host;
        h.loading = loading;
        h.lock_ref = lock_ref;
        h.hits = hits;
        h.stamp = fresh;
        h.device_children = u32::from(on_dev);
        // The head starts with the same page as the old node: it takes its place under the
        // parent, and the old node becomes the head's only child.
        self.replace_child(parent, idx, head);
        self.add_child(head, idx);
        self.refresh(head);
        self.refresh(idx);
        self.refresh(parent);
        head
    }

    /// The child of `node` whose key starts with `page` (one page of tokens, any width).
    #[inline]
    fn find_child<T: TokenId>(&self, node: usize, page: &[T]) -> Option<usize> {
        // A value no token id can have matches nothing.
        let mut c = *self.nodes[node].children.get(&self.page_key(page)?)?;
        if page.len() <= 2 {
            return Some(c); // the key is the page itself
        }
        loop {
            if T::common_prefix(&self.nodes[c].key[..page.len()], page) == page.len() {
                return Some(c);
            }
            c = self.nodes[c].next_same_key;
            if c == NIL {
                return None;
            }
        }
    }

    /// Lists `child` (not yet listed) under `parent`.
    fn add_child(&mut self, parent: usize, child: usize) {
        let key = self.first_page_key(child);
        let prev = self.nodes[parent].children.insert(key, child);
        self.nodes[child].next_same_key = prev.unwrap_or(NIL);
    }

    /// Puts `new` in `old`'s place under `parent`: `new`'s key starts with the page `old`'s
    /// did when it was listed (`old`'s own key may have changed since, as in a split).
    fn replace_child(&mut self, parent: usize, old: usize, new: usize) {
        let next = std::mem::replace(&mut self.nodes[old].next_same_key, NIL);
        self.nodes[new].next_same_key = next;
        let key = self.first_page_key(new);
        self.relink(parent, key, old, new);
    }

    /// Takes `child` off `parent`'s list.
    fn remove_child(&mut self, parent: usize, child: usize) {
        let next = std::mem::replace(&mut self.nodes[child].next_same_key, NIL);
        let key = self.first_page_key(child);
        self.relink(parent, key, child, next);
    }

    /// Makes whatever pointed at `old` in `parent`'s list under `key` (the map entry or a
    /// sibling's chain link) point at `to` (`NIL`: unlisted).
    fn relink(&mut self, parent: usize, key: u64, old: usize, to: usize) {
        let children = &mut self.nodes[parent].children;
        let head = children[&key];
        if head == old {
            if to == NIL {
                children.remove(&key);
            } else {
                children.insert(key, to);
            }
            return;
        }
        let mut c = head;
        while self.nodes[c].next_same_key != old {
            c = self.nodes[c].next_same_key;
        }
        self.nodes[c].next_same_key = to;
    }

    fn first_page_key(&self, idx: usize) -> u64 {
        self.page_key(&self.nodes[idx].key[..self.page_size])
            .expect("tree keys are token ids")
    }

    #[inline(always)]
    fn page_key<T: TokenId>(&self, page: &[T]) -> Option<u64> {
        let key = page_key(page)?;
        #[cfg(test)]
        if self.colliding && page.len() > 2 {
            return Some(key % 3); // every sibling chains: the tests' worst case
        }
        Some(key)
    }

    /// Makes first-page keys of pages over two tokens collide (tests of the chains).
    #[cfg(test)]
    pub(crate) fn set_colliding(&mut self) {
        assert!(self.nodes.is_empty(), "before the first insert");
        self.colliding = true;
    }

    /// Every child of `idx`, chains included.
    fn children_of(&self, idx: usize) -> impl Iterator<Item = usize> + '_ {
        self.nodes[idx].children.values().flat_map(move |&head| {
            std::iter::successors(Some(head), move |&c| {
                Some(self.nodes[c].next_same_key).filter(|&n| n != NIL)
            })
        })
    }

    /// Walks the path of `tokens` (whole pages only), splitting the last node when the match
    /// ends inside it. Returns the path's nodes and the tokens they cover. The caller touches
    /// the path.
    fn walk<T: TokenId>(&mut self, ns: u32, tokens: &[T]) -> (Path, usize) {
        let found = self.descend(ns, tokens);
        self.take_path(ns, found)
    }

    /// The path of `tokens` (whole pages only) as it stands, changing nothing (no split, no
    /// root made): see [`Descent`].
    fn descend<T: TokenId>(&self, ns: u32, tokens: &[T]) -> Descent {
        let ps = self.page_size;
        let len = tokens.len() / ps * ps;
        let mut d = Descent {
            path: Path::new(),
            split: None,
            pos: 0,
        };
        let Some(&root) = self.roots.get(&ns) else {
            return d;
        };
        let mut node = root;
        while d.pos < len {
            let Some(child) = self.find_child(node, &tokens[d.pos..d.pos + ps]) else {
                break;
            };
            let key = &self.nodes[child].key;
            let node_len = key.len();
            let max_pages = node_len.min(len - d.pos) / ps;
            // First differing token, rounded down to whole pages (the first page matched: it
            // is the child's key).
            let limit = max_pages * ps;
            let common = T::common_prefix(&key[..limit], &tokens[d.pos..d.pos + limit]);
            let same = (common / ps).max(1);
            d.pos += same * ps;
            if same * ps < node_len {
                d.split = Some((child, same));
                break;
            }
            d.path.push(child);
            node = child;
        }
        d
    }

    /// Makes a descent's path real: the namespace's root, and the split of its last node.
    /// Returns the path's nodes and the tokens they cover.
    fn take_path(&mut self, ns: u32, d: Descent) -> (Path, usize) {
        self.root(ns);
        let mut path = d.path;
        if let Some((child, same)) = d.split {
            // Touched before the split, as SGLang does: the tail keeps this access. (The
            // callers touch the whole path afterwards, in order: nothing else is touched here.)
            self.touch(child);
            path.push(self.split(child, same));
        }
        (path, d.pos)
    }

    /// The given pages on a descent's path that the tree does not hold at their positions:
    /// those at positions on the device under other pages (duplicates) first, then those for
    /// host-only nodes. Returns them, how many are duplicates, and how many given pages are
    /// the tree's own at their positions.
    fn foreign_pages(&self, d: &Descent, pages: &[PageId]) -> (Vec<PageId>, usize, usize) {
        let ps = self.page_size;
        let (mut foreign, mut off_device) = (Vec::new(), Vec::new());
        let mut own = 0;
        let mut at = 0;
        let split = d.split.map(|(idx, same)| (idx, same * ps));
        let nodes = d.path.iter().map(|&idx| (idx, self.nodes[idx].key.len()));
        for (idx, len) in nodes.chain(split) {
            let n = &self.nodes[idx];
            let given = &pages[at..at + len / ps];
            if !n.on_device() {
                off_device.extend_from_slice(given);
            } else if given == &n.device[..given.len()] {
                // The pages of a matched path usually come back as they are.
                own += given.len();
            } else {
                for (g, mine) in given.iter().zip(&n.device) {
                    if g == mine {
                        own += 1;
                    } else {
                        foreign.push(*g);
                    }
                }
            }
            at += given.len();
        }
        let n_dup = foreign.len();
        foreign.append(&mut off_device);
        (foreign, n_dup, own)
    }

    /// The longest cached prefix of `tokens` in namespace `ns`: its device part, then the part
    /// restorable from host. Touches the path (LRU) and counts a hit on its last node.
    ///
    /// Tokens may come in any [`TokenId`] width: they are compared as they are, and only up to
    /// the first mismatch (the rest of a long prompt is never read).
    pub fn match_prefix<T: TokenId>(&mut self, ns: u32, tokens: &[T]) -> MatchResult {
        let (path, _) = self.walk(ns, tokens);
        let root = self.root(ns);
        let mut device_len = 0;
        let mut host_len = 0;
        // Sized once: at most every page of the path (a page-1 match is thousands).
        let mut device_pages =
            Vec::with_capacity(path.iter().map(|&i| self.nodes[i].device.len()).sum());
        let mut device_node = root;
        let mut last_node = root;
        let mut in_device = true;
        for &idx in &path {
            let n = &self.nodes[idx];
            let ready = n.on_device() && n.loading.is_none();
            if in_device && ready {
                device_len += n.key.len();
                device_pages.extend_from_slice(&n.device);
                device_node = idx;
                last_node = idx;
                continue;
            }
            in_device = false;
            if ready || n.loading.is_some() || n.host == HostCopy::Ready {
                host_len += n.key.len();
                last_node = idx;
            } else {
                break;
            }
        }
        for &idx in &path {
            self.touch(idx);
        }
        if last_node != root {
            self.nodes[last_node].hits += 1;
        }
        MatchResult {
            device_len,
            host_len,
            device_pages,
            device_node: self.id(device_node),
            last_node: self.id(last_node),
        }
    }

    /// Inserts `tokens` (whole pages; a partial last page is ignored) with `pages`, one device
    /// page per token page. Positions already on the device hand their given page back as a
    /// duplicate; host-only nodes on the path take the given pages (they were written afresh);
    /// the rest becomes a new leaf.
    /// Tokens may come in any [`TokenId`] width; the new part is stored as `u32` (a value that
    /// is no token id is refused before anything changes).
    pub fn insert<T: TokenId>(
        &mut self,
        ns: u32,
        tokens: &[T],
        pages: &[PageId],
    ) -> Result<InsertResult> {
        self.insert_locked(ns, tokens, pages, false)
    }

    /// [`Self::insert`], locking the inserted path (as [`Self::lock`] of its last node) with
    /// `lock`: locked before the new leaf is listed, so it never enters the eviction order only
    /// to leave it again.
    pub fn insert_locked<T: TokenId>(
        &mut self,
        ns: u32,
        tokens: &[T],
        pages: &[PageId],
        lock: bool,
    ) -> Result<InsertResult> {
        self.insert_claimed(ns, tokens, pages, lock, |_, _| Ok(()))
    }

    /// [`Self::insert_locked`] that first shows `claim` the given pages the tree does not
    /// already hold at their position: those on the matched path (duplicates, and pages for
    /// host-only nodes), then the new leaf's. An error from `claim` is returned with the tree
    /// as it was (the page allocator refuses pages their caller does not hold there).
    pub fn insert_claimed<T: TokenId>(
        &mut self,
        ns: u32,
        tokens: &[T],
        pages: &[PageId],
        lock: bool,
        claim: impl FnOnce(&[PageId], &[PageId]) -> Result<()>,
    ) -> Result<InsertResult> {
        let ps = self.page_size;
        let n_pages = tokens.len() / ps;
        if pages.len() != n_pages {
            return Err(Error::config(
                "device_pages",
                format!("{} pages", pages.len()),
                format!(
                    "{n_pages}: one per whole page of the {} tokens",
                    tokens.len()
                ),
            ));
        }
        let tokens = &tokens[..n_pages * ps];
        // Everything that can refuse the insert runs before anything changes: the new part
        // as the tree stores it (every value a token id), then the claim of the given pages.
        let found = self.descend(ns, tokens);
        let pos = found.pos;
        let mut suffix = Vec::with_capacity(n_pages * ps - pos);
        T::extend_ids(&tokens[pos..], &mut suffix)?;
        let (foreign, n_dup, own) = self.foreign_pages(&found, pages);
        claim(&foreign, &pages[pos / ps..])?;
        let (path, _) = self.take_path(ns, found);
        let mut last = match path.last() {
            Some(&l) => l,
            None => self.root(ns),
        };
        if lock {
            self.lock_from(last);
        }
        // The lock belongs to the node the insert returns: the new leaf, else `last`.
        let locks_last = lock && pos >= n_pages * ps;
        if locks_last && self.nodes[last].parent != NIL {
            self.nodes[last].own_locks += 1;
        }
        let mut duplicates = foreign;
        duplicates.truncate(n_dup);
        let mut needs_backup = Vec::new();
        let mut at = 0; // page index into `pages`
        for &idx in &path {
            let k = self.nodes[idx].key.len() / ps;
            if !self.nodes[idx].on_device() {
                self.set_device(idx, pages[at..at + k].to_vec());
            }
            if self.nodes[idx].host == HostCopy::None && self.nodes[idx].loading.is_none() {
                needs_backup.push(self.id(idx));
            }
            self.touch(idx);
            at += k;
        }
        if pos < n_pages * ps {
            let leaf = self.new_node(last, suffix);
            // Locked from the start: nothing is on the device yet, so no locked pages change.
            self.nodes[leaf].lock_ref = u32::from(lock);
            self.nodes[leaf].own_locks = u32::from(lock);
            self.add_child(last, leaf);
            self.refresh(last);
            self.set_device(leaf, pages[at..].to_vec());
            self.touch(leaf);
            needs_backup.push(self.id(leaf));
            last = leaf;
        }
        Ok(InsertResult {
            prefix_len: pos,
            duplicates,
            own,
            last_node: self.id(last),
            needs_backup,
        })
    }

    /// [`Self::insert`] for pages whose host copy the caller already wrote (the joined mode:
    /// a request's main KV was written through layer by layer, its Indexer-K at its end):
    /// every node of the path without a host copy takes the given host pages as Ready, so
    /// nothing is queued for backup. Returns the insert, the given host pages the tree did not
    /// take (positions that already had another host copy: the caller frees those) and the
    /// given host pages it took. `claim` sees the device pages as in [`Self::insert_claimed`].
    pub fn insert_with_host(
        &mut self,
        ns: u32,
        tokens: &[u32],
        pages: &[PageId],
        host_pages: &[PageId],
        claim: impl FnOnce(&[PageId], &[PageId]) -> Result<()>,
    ) -> Result<(InsertResult, Vec<PageId>, Vec<PageId>)> {
        if host_pages.len() != pages.len() {
            return Err(Error::config(
                "host_pages",
                format!("{} pages", host_pages.len()),
                format!("{}: one per device page", pages.len()),
            ));
        }
        let mut r = self.insert_claimed(ns, tokens, pages, false, claim)?;
        let mut path = Vec::new();
        let mut idx = self.resolve(r.last_node)?;
        while self.nodes[idx].parent != NIL {
            path.push(idx);
            idx = self.nodes[idx].parent;
        }
        path.reverse();
        let ps = self.page_size;
        let mut spare = Vec::new();
        let mut taken = Vec::new();
        let mut at = 0;
        for idx in path {
            let k = self.nodes[idx].key.len() / ps;
            let given = &host_pages[at..at + k];
            if self.nodes[idx].host == HostCopy::None {
                self.host_pages += k;
                let n = &mut self.nodes[idx];
                n.host_pages = given.to_vec();
                n.host = HostCopy::Ready;
                self.refresh(idx);
                taken.extend_from_slice(given);
            } else {
                let mine = &self.nodes[idx].host_pages;
                spare.extend(
                    given
                        .iter()
                        .zip(mine)
                        .filter(|(g, m)| g != m)
                        .map(|(g, _)| *g),
                );
            }
            at += k;
        }
        r.needs_backup.clear();
        Ok((r, spare, taken))
    }

    /// Increments the lock count of `node` and every ancestor: none of them is evicted while
    /// locked.
    pub fn lock(&mut self, node: NodeId) -> Result<()> {
        let idx = self.resolve(node)?;
        if self.nodes[idx].parent != NIL {
            self.nodes[idx].own_locks += 1;
        }
        self.lock_from(idx);
        Ok(())
    }

    fn lock_from(&mut self, mut idx: usize) {
        while self.nodes[idx].parent != NIL {
            self.nodes[idx].lock_ref += 1;
            if self.nodes[idx].lock_ref == 1 {
                self.locked_device_pages += self.nodes[idx].device.len();
            }
            self.refresh(idx);
            idx = self.nodes[idx].parent;
        }
    }

    /// The lock counts of child `c` and of the siblings chained behind it under one key.
    fn chain_lock_refs(&self, mut c: usize) -> u32 {
        let mut sum = 0;
        while c != NIL {
            sum += self.nodes[c].lock_ref;
            c = self.nodes[c].next_same_key;
        }
        sum
    }

    /// Undoes one `lock` of `node` (or the lock an insert took on it). A node locked only
    /// through a descendant is not locked itself: refused, and nothing changes.
    pub fn unlock(&mut self, node: NodeId) -> Result<()> {
        let start = self.resolve(node)?;
        if self.nodes[start].parent != NIL {
            if self.nodes[start].own_locks == 0 {
                return Err(Error::NotLocked { id: node.raw() });
            }
            self.nodes[start].own_locks -= 1;
        }
        let mut idx = start;
        while self.nodes[idx].parent != NIL {
            self.nodes[idx].lock_ref -= 1;
            if self.nodes[idx].lock_ref == 0 {
                self.locked_device_pages -= self.nodes[idx].device.len();
            }
            self.refresh(idx);
            idx = self.nodes[idx].parent;
        }
        Ok(())
    }

    /// Device pages of the path from the root to `node`, in order.
    pub fn path_device_pages(&self, node: NodeId) -> Result<Vec<PageId>> {
        self.path_pages(node, |n| &n.device)
    }

    /// Host pages of the path from the root to `node`, in order.
    pub fn path_host_pages(&self, node: NodeId) -> Result<Vec<PageId>> {
        self.path_pages(node, |n| &n.host_pages)
    }

    fn path_pages(
        &self,
        node: NodeId,
        pages: impl Fn(&Node) -> &Vec<PageId>,
    ) -> Result<Vec<PageId>> {
        let mut idx = self.resolve(node)?;
        let mut parts = Vec::new();
        while self.nodes[idx].parent != NIL {
            parts.push(idx);
            idx = self.nodes[idx].parent;
        }
        Ok(parts
            .iter()
            .rev()
            .flat_map(|&i| pages(&self.nodes[i]).iter().copied())
            .collect())
    }

    /// Nodes of the path to `node` that hold no readable device copy but a Ready host copy,
    /// with their host pages: what a load-back restores. Nodes already loading are returned
    /// apart, with their transfer.
    pub fn restorable(&self, node: NodeId) -> Result<Restorable> {
        let mut idx = self.resolve(node)?;
        let mut todo = Vec::new();
        let mut joined = Vec::new();
        while self.nodes[idx].parent != NIL {
            let n = &self.nodes[idx];
            if let Some(t) = n.loading {
                joined.push((self.id(idx), t));
            } else if !n.on_device() && n.host == HostCopy::Ready {
                todo.push(self.id(idx));
            }
            idx = n.parent;
        }
        todo.reverse();
        joined.reverse();
        Ok((todo, joined))
    }

    /// Key pages of a node.
    pub fn node_pages(&self, node: NodeId) -> Result<usize> {
        Ok(self.nodes[self.resolve(node)?].key.len() / self.page_size)
    }

    /// Host pages of a node (empty without a host copy).
    pub fn host_pages_of(&self, node: NodeId) -> Result<&[PageId]> {
        Ok(&self.nodes[self.resolve(node)?].host_pages)
    }

    /// Device pages of a node (empty when not on the device).
    pub fn device_pages_of(&self, node: NodeId) -> Result<&[PageId]> {
        Ok(&self.nodes[self.resolve(node)?].device)
    }

    /// Tokens from the root to the end of `node`.
    pub fn depth_tokens(&self, node: NodeId) -> Result<usize> {
        let mut idx = self.resolve(node)?;
        let mut t = 0;
        while self.nodes[idx].parent != NIL {
            t += self.nodes[idx].key.len();
            idx = self.nodes[idx].parent;
        }
        Ok(t)
    }
}
