//! Faults armed on the scheduler's copy submissions: tests, the soak and `demo --faults` ask
//! for the next loads or backups (at a layer, or any) to fail, to be delayed, or to make the
//! copy worker panic. A layer over the copy engine: when a submission of an armed kind comes,
//! the fault is handed to the engine's own fault hook for that submission, so the failure
//! takes the real path. It holds no other state of the scheduler's.

use super::core::StepScheduler;
use super::tier::Tier;
use crate::error::Result;
use crate::transfer::{CopyEngine, Direction, Fault, FaultAction};
use std::time::Duration;

#[derive(Debug, Clone)]
struct ArmedFault {
    direction: Direction,
    layer: Option<u16>,
    remaining: u32,
    action: Armed,
}

/// What an armed fault does to the submission it lands on.
#[derive(Debug, Clone, Copy)]
enum Armed {
    Fail,
    Delay(Duration),
    /// The engine's worker panics (the cpu engine contains it as a failure).
    Panic,
}

/// The faults armed and not yet taken, and the copy-worker panics handed to the engine.
#[derive(Debug, Default)]
pub(super) struct ArmedFaults {
    faults: Vec<ArmedFault>,
    copy_panics: u64,
}

impl ArmedFaults {
    /// `count` failures (or, with `delay`, slow copies) of the next `direction` submissions,
    /// at `layer` only if given.
    pub(super) fn fail(
        &mut self,
        direction: Direction,
        count: u32,
        layer: Option<u16>,
        delay: Option<Duration>,
    ) {
        let action = delay.map_or(Armed::Fail, Armed::Delay);
        self.push(direction, count, layer, action);
    }

    /// `count` panics of the copy worker in the next `direction` submissions.
    pub(super) fn panic(&mut self, direction: Direction, count: u32, layer: Option<u16>) {
        self.push(direction, count, layer, Armed::Panic);
    }

    fn push(&mut self, direction: Direction, count: u32, layer: Option<u16>, action: Armed) {
        self.faults.push(ArmedFault {
            direction,
            layer,
            remaining: count,
            action,
        });
    }

    /// Copy-worker panics handed to the engine so far.
    pub(super) fn copy_panics(&self) -> u64 {
        self.copy_panics
    }

    /// Submissions of `direction` still armed to fail.
    pub(super) fn armed(&self, direction: Direction) -> u64 {
        self.faults
            .iter()
            .filter(|f| f.direction == direction)
            .map(|f| u64::from(f.remaining))
            .sum()
    }

    /// Takes the armed load failures for the device resolver's copies (a panic, with no copy
    /// worker there to panic, fails its copy): (layer or any, count). Slow copies stay armed.
    pub(super) fn take_copy_faults(&mut self) -> Vec<(Option<u16>, u32)> {
        let mut out = Vec::new();
        self.faults.retain(|f| {
            let take = f.direction == Direction::Load && !matches!(f.action, Armed::Delay(_));
            if take {
                out.push((f.layer, f.remaining));
            }
            !take
        });
        out
    }

    /// Arms again, as failures, the copy faults a device step did not take.
    pub(super) fn restore_copy_faults(&mut self, faults: Vec<(Option<u16>, u32)>) {
        for (layer, n) in faults {
            self.push(Direction::Load, n, layer, Armed::Fail);
        }
    }

    /// Before a `direction` submission at `layer` (None: a backup, every layer): hands the
    /// first armed fault that matches to `engine` for its next submission.
    pub(super) fn arm(
        &mut self,
        engine: &dyn CopyEngine,
        direction: Direction,
        layer: Option<u16>,
    ) -> Result<()> {
        if self.faults.is_empty() {
            return Ok(());
        }
        let hit = self.faults.iter_mut().find(|f| {
            f.direction == direction && f.remaining > 0 && (f.layer.is_none() || f.layer == layer)
        });
        if let Some(f) = hit {
            f.remaining -= 1;
            let action = match f.action {
                Armed::Delay(d) => FaultAction::Delay(d),
                Armed::Fail => FaultAction::Fail(format!("injected {} fault", direction.name())),
                Armed::Panic => {
                    self.copy_panics += 1;
                    FaultAction::Panic(format!("injected {} panic", direction.name()))
                }
            };
            engine.inject(Fault {
                nth: engine.submitted(),
                layer: None,
                action,
            })?;
        }
        self.faults.retain(|f| f.remaining > 0);
        Ok(())
    }
}

/// The scheduler's fault hooks (`sparsetier.testing` in Python).
impl<T: Tier> StepScheduler<T> {
    /// Arms `count` failures (or, with `delay`, slow copies) for the next load (or backup)
    /// submissions, at `layer` only if given. Through the engine's fault hook, so the failure
    /// takes the real path.
    pub fn inject_faults(
        &mut self,
        direction: Direction,
        count: u32,
        layer: Option<u16>,
        delay: Option<Duration>,
    ) {
        self.xfer.faults.fail(direction, count, layer, delay);
    }

    /// Arms `count` panics of the engine's worker (cpu engine) in the next load (or backup)
    /// submissions, at `layer` only if given: a bug in the copy path, which the engine turns
    /// into a failed transfer.
    pub fn inject_panics(&mut self, direction: Direction, count: u32, layer: Option<u16>) {
        self.xfer.faults.panic(direction, count, layer);
    }

    /// Injected copy-worker panics handed to the engine so far, each with the submission it
    /// fails (a panic armed but not yet handed over is in [`Self::armed_faults`]).
    pub fn copy_panics_injected(&self) -> u64 {
        self.xfer.faults.copy_panics()
    }

    /// The next plan panics inside the core after it has pinned and submitted its loads, as
    /// a bug would (tests the bindings' containment: see [`crate::guard`]).
    pub fn inject_internal_fault(&mut self) {
        self.internal_fault = true;
    }

    /// Injected faults still armed, by kind: (loads, backups, restores). A fault stays armed
    /// until a submission of its kind (at its layer, if it names one) takes it, so a run whose
    /// faults found nothing to fail can say so.
    pub fn armed_faults(&self) -> (u64, u64, u64) {
        let restores = self.tier.restore_faults();
        let armed = |d| self.xfer.faults.armed(d);
        (armed(Direction::Load), armed(Direction::Backup), restores)
    }
}
