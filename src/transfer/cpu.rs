//! The cpu engine: both tiers in host memory, copies on worker threads, real per-layer events.
//!
//! It is how every machine without a GPU runs the whole system: Loading states, waits and
//! overlap are real. A fault-injection hook can fail, delay or panic the k-th submission, or
//! one layer of it.
//!
//! # Threads and drop
//! `threads` workers take submissions from one channel; one submission runs on one worker,
//! layer by layer. A worker that panics on a submission fails the layers it had not written
//! and takes the next one. Dropping the engine closes the channel and joins the workers after
//! they finish what was submitted.

use super::engine::{submission_layers, CopyEngine};
use super::events::TransferEvents;
pub use super::fault::{Fault, FaultAction};
use super::prepared::{CopyOp, PageTransferGroup};
use crate::error::{Error, Result};
use crate::guard::{injected_panic, panic_message};
use crossbeam_channel::{unbounded, Receiver, Sender};
use parking_lot::Mutex;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

struct Job {
    group: Arc<PageTransferGroup>,
    events: Arc<TransferEvents>,
    faults: Vec<Fault>,
}

/// The cpu copy engine.
pub struct CpuEngine {
    tx: Option<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
    faults: Mutex<Vec<Fault>>,
    seq: AtomicU64,
}

impl CpuEngine {
    /// An engine with `threads` workers (at least one).
    pub fn new(threads: usize) -> Result<Self> {
        if threads == 0 || threads > 256 {
            return Err(Error::config("threads", threads, "1 <= threads <= 256"));
        }
        let (tx, rx) = unbounded::<Job>();
        // Polling beside the submitter on a single CPU would only take its time.
        let poll = std::thread::available_parallelism().is_ok_and(|n| n.get() > 1);
        let workers = (0..threads)
            .map(|i| {
                let rx: Receiver<Job> = rx.clone();
                std::thread::Builder::new()
                    .name(format!("sparsetier-cpu-copy-{i}"))
                    .spawn(move || {
                        while let Some(job) = next_job(&rx, poll) {
                            // A panic (a bug in the copy path) fails what the job has not
                            // written instead of ending the worker: a dead worker would leave
                            // every later submission pending, and its waiters hung.
                            let ran = catch_unwind(AssertUnwindSafe(|| run(&job)));
                            if let Err(payload) = ran {
                                job.events.fail_pending(&format!(
                                    "copy worker panicked: {}",
                                    panic_message(payload.as_ref())
                                ));
                            }
                        }
                    })
                    .map_err(|e| {
                        Error::config(
                            "threads",
                            threads,
                            format!("threads the OS can start ({e})"),
                        )
                    })
            })
            .collect::<Result<_>>()?;
        Ok(CpuEngine {
            tx: Some(tx),
            workers,
            faults: Mutex::new(Vec::new()),
            seq: AtomicU64::new(0),
        })
    }

    /// Arms a fault for a later submission.
    pub fn inject(&self, fault: Fault) {
        self.faults.lock().push(fault);
    }
}

/// How long a worker polls for the next job before it blocks (where the machine has more
/// than one CPU): a submission that finds it polling costs no wake-up (a futex call and an
/// inter-processor interrupt, tens of microseconds on a VM), and a decode step submits once
/// per layer, a few hundred microseconds apart (benches/RESULTS.md, "Decode step: changes,
/// measured").
const POLL: std::time::Duration = std::time::Duration::from_micros(200);

/// The next job, or None once every sender is gone.
fn next_job(rx: &Receiver<Job>, poll: bool) -> Option<Job> {
    let start = std::time::Instant::now();
    loop {
        match rx.try_recv() {
            Ok(job) => return Some(job),
            Err(crossbeam_channel::TryRecvError::Disconnected) => return None,
            Err(crossbeam_channel::TryRecvError::Empty) if poll && start.elapsed() < POLL => {
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
            }
            Err(crossbeam_channel::TryRecvError::Empty) => return rx.recv().ok(),
        }
    }
}

fn run(job: &Job) {
    for (i, &layer) in job.events.layers().iter().enumerate() {
        for f in &job.faults {
            let at = f.layer.unwrap_or(job.events.layers()[0]);
            if at != layer {
                continue;
            }
            match &f.action {
                FaultAction::Delay(d) => std::thread::sleep(*d),
                FaultAction::Fail(reason) => {
                    job.events.record_failed_from(i, reason);
                    return;
                }
                FaultAction::Panic(message) => injected_panic(message),
            }
        }
        match job.group.layer_ops(layer) {
            Ok(ops) => {
                copy(&ops);
                job.events.record_done(i);
            }
            Err(e) => {
                job.events.record_failed_from(i, &e.to_string());
                return;
            }
        }
    }
}

fn copy(ops: &[CopyOp]) {
    for op in ops {
        // SAFETY: every address comes from a `PreparedPageTransfer`, which checked that each
        // unit lies inside its bindings, and `PageTransferBinding::new`'s contract keeps those
        // buffers valid and untouched by others while the transfer is in flight. Source and
        // destination are different buffers (checked when the group was prepared), so the
        // ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(op.src as *const u8, op.dst as *mut u8, op.len as usize);
        }
    }
}

impl CopyEngine for CpuEngine {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn inject(&self, fault: Fault) -> Result<()> {
        self.faults.lock().push(fault);
        Ok(())
    }

    fn submitted(&self) -> u64 {
        self.seq.load(Ordering::SeqCst)
    }

    fn submit(
        &self,
        group: Arc<PageTransferGroup>,
        layer: Option<usize>,
    ) -> Result<Arc<TransferEvents>> {
        if !group.all_host() {
            return Err(Error::config(
                "io_backend",
                "cpu",
                "host buffers on both sides for the cpu engine; device buffers need kernel or direct",
            ));
        }
        let layers = submission_layers(&group, layer)?;
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let faults = super::fault::take_for(&mut self.faults.lock(), seq);
        let events = Arc::new(TransferEvents::new(seq, "cpu", layers));
        let tx = self
            .tx
            .as_ref()
            .expect("the channel lives as long as the engine");
        tx.send(Job {
            group,
            events: Arc::clone(&events),
            faults,
        })
        .map_err(|_| Error::config("engine", "shut down", "a running engine"))?;
        Ok(events)
    }
}

impl Drop for CpuEngine {
    fn drop(&mut self) {
        self.tx.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
