//! What the L3 tier needs of the tree: a node's namespace and tokens (its page keys are a hash
//! chain over them), the host eviction order one node at a time (write-back stores a victim
//! before it leaves), and host-only inserts of pages prefetched from the store.

use super::{HostCopy, NodeId, RadixTree, NIL};
use crate::error::{Error, Result};
use crate::ids::PageId;

impl RadixTree {
    /// The namespace and the tokens from the root to the end of `node`.
    pub fn path_tokens(&self, node: NodeId) -> Result<(u32, Vec<u32>)> {
        let mut idx = self.resolve(node)?;
        let mut parts = Vec::new();
        while self.nodes[idx].parent != NIL {
            parts.push(idx);
            idx = self.nodes[idx].parent;
        }
        let ns = self
            .roots
            .iter()
            .find(|(_, &r)| r == idx)
            .map(|(&ns, _)| ns)
            .ok_or(Error::UnknownNode { id: node.raw() })?;
        let tokens = parts
            .iter()
            .rev()
            .flat_map(|&i| self.nodes[i].key.iter().copied())
            .collect();
        Ok((ns, tokens))
    }

    /// Up to `max` host-evictable nodes, least recently used first.
    pub fn host_victims(&self, max: usize) -> Vec<NodeId> {
        self.host_lru
            .iter()
            .take(max)
            .map(|&(_, idx)| self.id(idx))
            .collect()
    }

    /// The least recently used host-evictable node, if any.
    pub fn host_victim(&self) -> Option<NodeId> {
        self.host_lru.iter().next().map(|&(_, idx)| self.id(idx))
    }

    /// Evicts one host-evictable node (see [`Self::host_victim`]): it leaves the tree and its
    /// host pages come back.
    pub fn evict_host_node(&mut self, node: NodeId) -> Result<Vec<PageId>> {
        let idx = self.resolve(node)?;
        if self.nodes[idx].in_host_lru.is_none() {
            return Err(Error::config(
                "node",
                node.raw(),
                "a host-evictable node (host copy Ready, not on the device, unlocked, a leaf)",
            ));
        }
        let pages = std::mem::take(&mut self.nodes[idx].host_pages);
        self.host_pages -= pages.len();
        self.nodes[idx].host = HostCopy::None;
        self.remove_leaf(idx);
        Ok(pages)
    }

    /// Inserts pages that exist on the host only (fetched from L3): `host_pages` hold pages
    /// `start_page..` of `tokens`, which covers exactly those pages' end. The cached path must
    /// reach `start_page` (else nothing is inserted: the prefix left meanwhile). Pages the
    /// tree already holds are not taken. Returns the last node of the path (None when nothing
    /// could be placed) and the given pages the tree did not take.
    pub fn insert_host(
        &mut self,
        ns: u32,
        tokens: &[u32],
        start_page: usize,
        host_pages: &[PageId],
    ) -> Result<(Option<NodeId>, Vec<PageId>)> {
        let ps = self.page_size;
        if tokens.len() != (start_page + host_pages.len()) * ps {
            return Err(Error::config(
                "tokens",
                format!("{} tokens", tokens.len()),
                format!(
                    "{} tokens: pages 0..{} of {ps}",
                    (start_page + host_pages.len()) * ps,
                    start_page + host_pages.len()
                ),
            ));
        }
        if host_pages.is_empty() {
            return Ok((None, Vec::new()));
        }
        let (path, pos) = self.walk(ns, tokens);
        for &idx in &path {
            self.touch(idx);
        }
        let have = pos / ps;
        if have < start_page {
            return Ok((None, host_pages.to_vec()));
        }
        let taken_from = have - start_page;
        let spare = host_pages[..taken_from.min(host_pages.len())].to_vec();
        let mut last = match path.last() {
            Some(&l) => l,
            None => self.root(ns),
        };
        if taken_from < host_pages.len() {
            let leaf = self.new_node(last, tokens[pos..].to_vec());
            self.add_child(last, leaf);
            self.refresh(last);
            let given = host_pages[taken_from..].to_vec();
            self.host_pages += given.len();
            let n = &mut self.nodes[leaf];
            n.host_pages = given;
            n.host = HostCopy::Ready;
            self.touch(leaf);
            last = leaf;
        }
        Ok((Some(self.id(last)), spare))
    }
}

impl RadixTree {
    /// The nodes from the root to `node` (root excluded) with their page counts.
    pub fn path_nodes(&self, node: NodeId) -> Result<Vec<(NodeId, usize)>> {
        let mut idx = self.resolve(node)?;
        let mut out = Vec::new();
        while self.nodes[idx].parent != NIL {
            out.push((self.id(idx), self.nodes[idx].key.len() / self.page_size));
            idx = self.nodes[idx].parent;
        }
        out.reverse();
        Ok(out)
    }

    /// Pins the host pages of `node` for an L3 write: it cannot leave the host tier.
    pub fn pin_host(&mut self, node: NodeId) -> Result<()> {
        let idx = self.resolve(node)?;
        self.nodes[idx].storage_pins += 1;
        self.refresh(idx);
        Ok(())
    }

    /// Undoes one [`Self::pin_host`].
    pub fn unpin_host(&mut self, node: NodeId) -> Result<()> {
        let idx = self.resolve(node)?;
        if self.nodes[idx].storage_pins == 0 {
            return Err(Error::NotLocked { id: node.raw() });
        }
        self.nodes[idx].storage_pins -= 1;
        self.refresh(idx);
        Ok(())
    }

    /// The host copy state of `node`.
    pub fn host_copy(&self, node: NodeId) -> Result<HostCopy> {
        Ok(self.nodes[self.resolve(node)?].host)
    }
}
