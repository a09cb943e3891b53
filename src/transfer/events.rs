//! Per-layer completion events of one submitted transfer.
//!
//! Recording an event is not waiting for it: the engine records each layer as it finishes,
//! and a consumer of layer `l` waits for that layer alone. A failed layer fails every later
//! one of the same transfer (the engine stops there), so a waiter never sees a later layer
//! published after an earlier one failed.

use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a wait spins before it parks.
const SPIN: Duration = Duration::from_micros(30);

/// State of one layer of a transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerStatus {
    /// Not yet written.
    Pending,
    /// Every byte of the layer is written.
    Done,
    /// The layer was not (fully) written, for this reason.
    Failed(String),
}

/// Completion events of one transfer, one per layer it moves.
#[derive(Debug)]
pub struct TransferEvents {
    seq: u64,
    engine: &'static str,
    layers: Vec<usize>,
    status: Mutex<(Vec<LayerStatus>, Vec<Option<Duration>>)>,
    changed: Condvar,
    submitted: Instant,
}

impl TransferEvents {
    /// Events for `layers` of transfer number `seq` on `engine`.
    pub fn new(seq: u64, engine: &'static str, layers: Vec<usize>) -> Self {
        let n = layers.len();
        TransferEvents {
            seq,
            engine,
            layers,
            status: Mutex::new((vec![LayerStatus::Pending; n], vec![None; n])),
            changed: Condvar::new(),
            submitted: Instant::now(),
        }
    }

    /// The engine's submission number.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Layers this transfer moves, in order.
    pub fn layers(&self) -> &[usize] {
        &self.layers
    }

    fn index(&self, layer: usize) -> Result<usize> {
        self.layers.iter().position(|&l| l == layer).ok_or_else(|| {
            Error::plan(
                "layer",
                layer,
                format!("one of the transfer's layers {:?}", self.layers),
            )
        })
    }

    /// Marks the `i`-th layer written.
    pub fn record_done(&self, i: usize) {
        let mut s = self.status.lock();
        s.0[i] = LayerStatus::Done;
        s.1[i] = Some(self.submitted.elapsed());
        drop(s);
        self.changed.notify_all();
    }

    /// Marks the `i`-th layer and every later one failed.
    pub fn record_failed_from(&self, i: usize, reason: &str) {
        let mut s = self.status.lock();
        let now = self.submitted.elapsed();
        for j in i..self.layers.len() {
            s.0[j] = LayerStatus::Failed(reason.to_owned());
            s.1[j] = Some(now);
        }
        drop(s);
        self.changed.notify_all();
    }

    /// Marks every layer still pending failed (the worker copying them panicked: none of
    /// them is known to be written).
    pub fn fail_pending(&self, reason: &str) {
        let mut s = self.status.lock();
        let now = self.submitted.elapsed();
        let (status, at) = &mut *s;
        for (st, t) in status.iter_mut().zip(at.iter_mut()) {
            if *st == LayerStatus::Pending {
                *st = LayerStatus::Failed(reason.to_owned());
                *t = Some(now);
            }
        }
        drop(s);
        self.changed.notify_all();
    }

    /// The state of `layer`.
    pub fn status(&self, layer: usize) -> Result<LayerStatus> {
        let i = self.index(layer)?;
        Ok(self.status.lock().0[i].clone())
    }

    /// Whether every layer is done or failed: the engine will not write the destinations again.
    pub fn is_finished(&self) -> bool {
        self.status
            .lock()
            .0
            .iter()
            .all(|s| *s != LayerStatus::Pending)
    }

    /// Time from submission to each layer's event, where recorded.
    pub fn layer_times(&self) -> Vec<Option<Duration>> {
        self.status.lock().1.clone()
    }

    /// Blocks until `layer` is written. [`Error::CopyFailed`] if it failed,
    /// [`Error::WaitTimeout`] after `timeout`.
    pub fn wait_layer(&self, layer: usize, timeout: Option<Duration>) -> Result<()> {
        let i = self.index(layer)?;
        self.wait_until(timeout, |s| match &s[i] {
            LayerStatus::Pending => None,
            LayerStatus::Done => Some(Ok(())),
            LayerStatus::Failed(r) => Some(Err(self.failure(layer, r))),
        })
    }

    /// Blocks until every layer is written (or one failed).
    pub fn wait_all(&self, timeout: Option<Duration>) -> Result<()> {
        self.wait_until(timeout, |s| {
            if let Some((i, LayerStatus::Failed(r))) = s
                .iter()
                .enumerate()
                .find(|(_, st)| matches!(st, LayerStatus::Failed(_)))
            {
                return Some(Err(self.failure(self.layers[i], r)));
            }
            s.iter()
                .all(|st| *st == LayerStatus::Done)
                .then_some(Ok(()))
        })
    }

    fn failure(&self, layer: usize, reason: &str) -> Error {
        Error::CopyFailed {
            engine: self.engine,
            layer,
            reason: reason.to_owned(),
        }
    }

    fn wait_until(
        &self,
        timeout: Option<Duration>,
        ready: impl Fn(&[LayerStatus]) -> Option<Result<()>>,
    ) -> Result<()> {
        let start = Instant::now();
        // A deadline past what the clock can hold is no deadline.
        let deadline = timeout.and_then(|t| start.checked_add(t));
        // Most copies a step waits for are short: spin a few microseconds before parking, so
        // the wait does not pay a sleep and a wake-up (two context switches) for them.
        while start.elapsed() < timeout.map_or(SPIN, |t| t.min(SPIN)) {
            if let Some(r) = ready(&self.status.lock().0) {
                return r;
            }
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        }
        let mut s = self.status.lock();
        loop {
            if let Some(r) = ready(&s.0) {
                return r;
            }
            match deadline {
                None => self.changed.wait(&mut s),
                Some(d) => {
                    if self.changed.wait_until(&mut s, d).timed_out() {
                        if let Some(r) = ready(&s.0) {
                            return r;
                        }
                        return Err(Error::WaitTimeout {
                            id: self.seq,
                            timeout_ms: timeout.unwrap_or_default().as_millis() as u64,
                        });
                    }
                }
            }
        }
    }
}
