//! The copy-engine interface shared by the cpu, kernel and direct engines.

use super::events::TransferEvents;
use super::fault::Fault;
use super::prepared::PageTransferGroup;
use crate::error::{Error, Result};
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

    /// Whether the engine's copies can be waited for on a CUDA stream ([`Self::stream_wait`]).
    fn has_streams(&self) -> bool {
        false
    }

    /// Refuses a consumer's stream (`stream`) where the engine has none: a stream given to a
    /// CPU engine is a caller's mistake, whether or not its copies happen to be done.
    fn check_stream(&self, stream: Option<u64>) -> Result<()> {
        match stream {
            Some(s) if !self.has_streams() => Err(Error::config(
                "stream",
                format!("{s:#x}"),
                format!(
                    "None: the {} engine has no CUDA streams to wait on",
                    self.name()
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Makes the consumer's CUDA stream `stream` wait on the GPU for layer index `layer_index`
    /// of `events`, without blocking the CPU. Engines that run on the CPU have no streams and
    /// refuse; their consumers wait on the events instead.
    fn stream_wait(&self, events: &TransferEvents, layer_index: usize, stream: u64) -> Result<()> {
        let _ = (events, layer_index, stream);
        Err(Error::config(
            "stream",
            stream,
            format!(
                "None: the {} engine has no CUDA streams to wait on",
                self.name()
            ),
        ))
    }

    /// Arms a fault for a later submission (the engines' test hook, `super::fault`); an
    /// engine without one refuses.
    fn inject(&self, fault: Fault) -> Result<()> {
        let _ = fault;
        Err(Error::config(
            "io_backend",
            self.name(),
            "an engine with a fault hook: cpu, kernel or direct",
        ))
    }

    /// Submissions so far: the next one is number `submitted()`.
    fn submitted(&self) -> u64;

    /// The CUDA stream (a raw `CUstream`) whose queued work every later submission's copies
    /// must follow: the stream that writes the pages a backup reads and the slots a load
    /// overwrites (torch's current stream). Engines on the CPU need none: a CPU tensor write
    /// has finished when the call that made it returns.
    fn set_producer(&self, stream: Option<u64>) -> Result<()> {
        let _ = stream;
        Ok(())
    }
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
