//! Injected faults: the engines' test hook, armed per submission, so a failure takes the same
//! path through events, waits and the scheduler as a real one.
//!
//! The cpu engine can fail, delay or panic at a layer. The CUDA engines can fail one: they stop
//! launching at that layer, so earlier layers are copied and published and the rest fail,
//! as when a launch fails part-way. A GPU copy cannot be held back from the host, so they
//! refuse delays; nor do they copy on a thread of theirs, so they refuse panics.

use std::time::Duration;

/// What an injected fault does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultAction {
    /// The layer is not written and fails, with every later layer.
    Fail(String),
    /// The layer starts this much later.
    Delay(Duration),
    /// The worker copying the layer panics with this message, as a bug in the copy path would
    /// (cpu engine only): the engine catches it, fails the layer and every later one with
    /// the panic's message, and goes on serving.
    Panic(String),
}

/// A fault for submission number `nth` (0-based, in submission order), at one layer or at
/// its first layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// Which submission.
    pub nth: u64,
    /// Which layer; `None` is the submission's first layer.
    pub layer: Option<usize>,
    /// What happens.
    pub action: FaultAction,
}

/// Takes the faults armed for submission `seq` out of `armed`.
pub(crate) fn take_for(armed: &mut Vec<Fault>, seq: u64) -> Vec<Fault> {
    let (mine, rest) = armed.drain(..).partition(|f| f.nth == seq);
    *armed = rest;
    mine
}

/// Where a submission moving `layers` (in order) stops under `faults`: the position of the
/// first layer a failure names (a fault at a layer the submission does not move is ignored,
/// as in the cpu engine) and its reason. Delays are ignored here.
pub(crate) fn first_failure(faults: &[Fault], layers: &[usize]) -> Option<(usize, String)> {
    faults
        .iter()
        .filter_map(|f| {
            let FaultAction::Fail(reason) = &f.action else {
                return None;
            };
            let at = f.layer.unwrap_or(*layers.first()?);
            let i = layers.iter().position(|&l| l == at)?;
            Some((i, reason.clone()))
        })
        .min_by_key(|(i, _)| *i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fail(nth: u64, layer: Option<usize>, why: &str) -> Fault {
        Fault {
            nth,
            layer,
            action: FaultAction::Fail(why.into()),
        }
    }

    #[test]
    fn the_first_named_layer_fails_and_other_submissions_keep_theirs() {
        let mut armed = vec![
            fail(3, Some(7), "late"),
            fail(4, None, "other"),
            fail(3, Some(5), "early"),
            Fault {
                nth: 3,
                layer: Some(4),
                action: FaultAction::Delay(Duration::from_millis(1)),
            },
        ];
        let mine = take_for(&mut armed, 3);
        assert_eq!(mine.len(), 3);
        assert_eq!(armed, vec![fail(4, None, "other")]);
        // Layers 4..8 in order: layer 5 is position 1, before layer 7's position 3.
        assert_eq!(
            first_failure(&mine, &[4, 5, 6, 7]),
            Some((1, "early".into()))
        );
        // A one-layer submission of layer 7 fails there; of layer 6, not at all.
        assert_eq!(first_failure(&mine, &[7]), Some((0, "late".into())));
        assert_eq!(first_failure(&mine, &[6]), None);
        // No layer named: the submission's first.
        assert_eq!(first_failure(&armed, &[2, 3]), Some((0, "other".into())));
        assert_eq!(first_failure(&armed, &[]), None);
    }
}
