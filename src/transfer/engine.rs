//! The copy-engine interface shared by the cpu, kernel and direct engines.

use super::events::TransferEvents;
use super::prepared::PageTransferGroup;
use crate::error::Result;
use std::sync::Arc;

/// Moves the pages of a [`PageTransferGroup`], recording one event per layer.
pub trait CopyEngine: Send + Sync {
    /// `cpu`, `kernel` or `direct`.
    fn name(&self) -> &'static str;

    /// Submits `group`: every layer in order (`layer = None`) or one layer. Returns at once;
    /// the events say when each layer is written. The group's buffers must stay valid until
    /// [`TransferEvents::is_finished`].
    fn submit(
        &self,
        group: Arc<PageTransferGroup>,
        layer: Option<usize>,
    ) -> Result<Arc<TransferEvents>>;
}

/// The layers a submission moves.
pub(crate) fn submission_layers(
    group: &PageTransferGroup,
    layer: Option<usize>,
) -> Result<Vec<usize>> {
    match layer {
        None => Ok((0..group.layers()).collect()),
        Some(l) if l < group.layers() => Ok(vec![l]),
        Some(l) => Err(crate::error::Error::out_of_range(
            "layer",
            l as u64,
            0,
            group.layers() as u64,
        )),
    }
}
