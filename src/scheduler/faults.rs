//! Faults armed on the scheduler's copy submissions: tests, the soak and `demo --faults` ask
//! for the next loads or backups (at a layer, or any) to fail, to be delayed, or to make the
//! copy worker panic. A layer over the copy engine: when a submission of an armed kind comes,
//! the fault is handed to the engine's own fault hook for that submission, so the failure
//! takes the real path. It holds no other state of the scheduler's.

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
