//! Copies between the tiers as the tree sees them: a node's load-back and backup from their
//! start to their end, and the nodes a transfer covers.

use super::*;

impl RadixTree {
    /// Starts a load-back into `pages`: the node is on the device but not readable until
    /// [`Self::finish_load`].
    pub fn begin_load(&mut self, node: NodeId, pages: Vec<PageId>, transfer: u64) -> Result<()> {
        let idx = self.resolve(node)?;
        self.nodes[idx].loading = Some(transfer);
        self.set_device(idx, pages);
        Ok(())
    }

    /// Ends a load-back: readable on success; on failure the device pages come back (for the
    /// caller to free once the copy can no longer write them) and the node is host-only again.
    pub fn finish_load(&mut self, node: NodeId, transfer: u64, ok: bool) -> Result<Vec<PageId>> {
        let idx = self.resolve(node)?;
        if self.nodes[idx].loading != Some(transfer) {
            return Ok(Vec::new()); // split off: the other part carries it
        }
        self.nodes[idx].loading = None;
        let freed = if ok {
            Vec::new()
        } else {
            self.set_device(idx, Vec::new())
        };
        self.refresh(idx);
        Ok(freed)
    }

    /// Starts a backup into host `pages`.
    pub fn begin_backup(&mut self, node: NodeId, pages: Vec<PageId>, transfer: u64) -> Result<()> {
        let idx = self.resolve(node)?;
        let n = &mut self.nodes[idx];
        self.host_pages += pages.len();
        n.host_pages = pages;
        n.host = HostCopy::Writing(transfer);
        self.refresh(idx);
        Ok(())
    }

    /// Ends a backup: the host copy becomes a hit source on success; on failure its pages come
    /// back for the caller to free.
    pub fn finish_backup(&mut self, node: NodeId, transfer: u64, ok: bool) -> Result<Vec<PageId>> {
        let idx = self.resolve(node)?;
        if self.nodes[idx].host != HostCopy::Writing(transfer) {
            return Ok(Vec::new());
        }
        let freed = if ok {
            self.nodes[idx].host = HostCopy::Ready;
            Vec::new()
        } else {
            self.nodes[idx].host = HostCopy::None;
            let p = std::mem::take(&mut self.nodes[idx].host_pages);
            self.host_pages -= p.len();
            p
        };
        self.refresh(idx);
        Ok(freed)
    }

    /// Nodes whose loading or backup is transfer `t`, found by walking every node (used when a
    /// split may have spread a transfer over several nodes).
    pub fn nodes_of_transfer(&self, t: u64) -> Vec<NodeId> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.loading == Some(t) || n.host == HostCopy::Writing(t))
            .map(|(i, n)| NodeId::new(i, n.gen))
            .collect()
    }
}
