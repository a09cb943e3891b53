//! The core behind a `StepScheduler` binding: a plain or a joined scheduler, two Rust types.
//! The Python class says which (`JoinedStepScheduler` holds a joined one); [`each!`] runs a
//! call that both kinds have on whichever it is.

use crate::error::{Error, Result};
use crate::scheduler::{JoinedScheduler, StepScheduler};

/// A plain or a joined scheduler. (One per binding, built once and never moved after: boxing
/// the larger kind would add a pointer chase to every call.)
#[allow(clippy::large_enum_variant)]
pub(crate) enum Core {
    Plain(StepScheduler),
    Joined(JoinedScheduler),
}

/// Runs `$body` with `$s` bound to the scheduler, whichever kind it is.
macro_rules! each {
    ($core:expr, $s:ident => $body:expr) => {
        match $core {
            $crate::py::scheduler_core::Core::Plain($s) => $body,
            $crate::py::scheduler_core::Core::Joined($s) => $body,
        }
    };
}
pub(crate) use each;

impl Core {
    /// The plain scheduler, for the calls only it has (`what`): a joined one admits requests
    /// by their tokens.
    pub(crate) fn plain(&mut self, what: &str) -> Result<&mut StepScheduler> {
        match self {
            Core::Plain(s) => Ok(s),
            Core::Joined(_) => Err(Error::config(
                "scheduler",
                "joined",
                format!(
                    "a plain scheduler for {what} (a joined scheduler admits requests by their \
                     tokens: admit)"
                ),
            )),
        }
    }

    /// The joined scheduler (the `JoinedStepScheduler` class holds one; a plain one is
    /// refused, not a panic).
    pub(crate) fn joined(&mut self) -> Result<&mut JoinedScheduler> {
        match self {
            Core::Joined(s) => Ok(s),
            Core::Plain(_) => Err(not_joined()),
        }
    }

    /// The joined scheduler, read only.
    pub(crate) fn joined_ref(&self) -> Result<&JoinedScheduler> {
        match self {
            Core::Joined(s) => Ok(s),
            Core::Plain(_) => Err(not_joined()),
        }
    }
}

fn not_joined() -> Error {
    Error::config(
        "scheduler",
        "plain",
        "a joined scheduler (StepScheduler.joined, with a prefix cache)",
    )
}
