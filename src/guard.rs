//! Panic containment: a bug inside the core becomes an error, and the state it broke is never
//! used again.
//!
//! A panic is a broken internal invariant (bad input is a typed error, never a panic). Left
//! alone it would cross into Python as pyo3's `PanicException`, a `BaseException` that
//! `except Exception` does not catch, and the object it unwound through would stay usable
//! with half an operation applied. [`Guarded`] is the lock the stateful owners the bindings
//! drive (the step scheduler, the prefix cache) sit behind: a panic inside a call is caught
//! there, the value is *poisoned*, and that call and every later one return
//! [`Error::Internal`] instead of touching it. The copy engines' worker threads catch panics
//! the same way per job, failing the job's remaining layers (see `transfer/cpu.rs`).

use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe, Location};
use std::sync::{Arc, OnceLock};

/// Whether an owner is unusable, and why (the first internal error's message). One flag can
/// be shared by the guards of the objects one failure breaks together: a step scheduler and
/// the directory it drives.
#[derive(Debug, Default)]
pub struct Poison(OnceLock<String>);

impl Poison {
    /// The first internal error's message, once poisoned.
    pub fn get(&self) -> Option<&str> {
        self.0.get().map(String::as_str)
    }

    /// Poisons (a call found the owner broken); the first reason stays.
    pub fn set(&self, why: &Error) {
        let _ = self.0.get_or_init(|| match why {
            Error::Internal { site, message } => format!("{message}, at {site}"),
            other => other.to_string(),
        });
    }

    /// Runs `f` unless poisoned. A panic inside `f` poisons and is returned as
    /// [`Error::Internal`] naming the call's site; so is an [`Error::Internal`] `f` returns
    /// (an inner guard's: what `f` changed may be half-changed too). Once poisoned, every
    /// call returns [`Error::Internal`] without running `f`.
    #[track_caller]
    pub fn contain<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        self.contain_at(Location::caller(), f)
    }

    fn contain_at<R>(
        &self,
        site: &'static Location<'static>,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        if let Some(first) = self.get() {
            return Err(Error::Internal {
                site: site.to_string(),
                message: format!("unusable after an earlier internal error ({first})"),
            });
        }
        // Asserted unwind-safe: a panic leaves what `f` touched in whatever state it
        // reached, and the poison below keeps every later call from observing it.
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Err(e @ Error::Internal { .. })) => {
                self.set(&e);
                Err(e)
            }
            Ok(r) => r,
            Err(payload) => {
                let e = Error::Internal {
                    site: site.to_string(),
                    message: panic_message(payload.as_ref()),
                };
                self.set(&e);
                Err(e)
            }
        }
    }
}

/// A value behind a mutex whose calls contain panics (module docs).
#[derive(Debug)]
pub struct Guarded<T> {
    value: Mutex<T>,
    poison: Arc<Poison>,
}

impl<T> Guarded<T> {
    /// Guards `value` with a flag of its own.
    pub fn new(value: T) -> Self {
        Self::sharing(value, Arc::default())
    }

    /// Guards `value` with `poison`, shared with other guards.
    pub fn sharing(value: T, poison: Arc<Poison>) -> Self {
        Guarded {
            value: Mutex::new(value),
            poison,
        }
    }

    /// Runs `f` on the value under the lock, as [`Poison::contain`] does.
    #[track_caller]
    pub fn run<R>(&self, f: impl FnOnce(&mut T) -> Result<R>) -> Result<R> {
        self.poison
            .contain_at(Location::caller(), || f(&mut self.value.lock()))
    }

    /// [`Self::run`] for a call that cannot fail otherwise.
    #[track_caller]
    pub fn get<R>(&self, f: impl FnOnce(&mut T) -> R) -> Result<R> {
        self.poison
            .contain_at(Location::caller(), || Ok(f(&mut self.value.lock())))
    }

    /// [`Self::run`] if the lock is free now; `None` (without running `f`) if another thread
    /// holds it. A caller holding Python's GIL tries this first and waits with
    /// [`Self::wait_free`] only after releasing the GIL, so it never blocks a thread that
    /// needs the GIL to finish.
    #[track_caller]
    pub fn try_run<R>(&self, f: impl FnOnce(&mut T) -> Result<R>) -> Option<Result<R>> {
        self.try_run_at(Location::caller(), f)
    }

    /// [`Self::try_run`], naming `site` as the call's place in an internal error.
    pub fn try_run_at<R>(
        &self,
        site: &'static Location<'static>,
        f: impl FnOnce(&mut T) -> Result<R>,
    ) -> Option<Result<R>> {
        let mut guard = self.value.try_lock()?;
        Some(self.poison.contain_at(site, || f(&mut guard)))
    }

    /// Blocks until the lock is free (and leaves it free).
    pub fn wait_free(&self) {
        drop(self.value.lock());
    }

    /// The flag.
    pub fn poison(&self) -> &Arc<Poison> {
        &self.poison
    }

    /// The value, exclusively, without containment: for `Drop`, which must still end what
    /// the value started (copies in flight) and decides itself what to do when that panics.
    pub fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }
}

/// A panic payload's message (`panic!` gives a `&str` or a `String`).
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

/// Unwinds with `message` as a panic would, without the panic hook's report: how injected
/// faults stand in for a bug (tests read the error, not stderr).
pub fn injected_panic(message: &str) -> ! {
    std::panic::resume_unwind(Box::new(message.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_internal_error_and_poisons_every_later_call() {
        let g = Guarded::new(vec![1, 2, 3]);
        assert_eq!(g.get(|v| v.len()), Ok(3));
        let e = g
            .run(|v| -> Result<()> {
                v.push(4); // half an operation
                injected_panic("broken invariant")
            })
            .unwrap_err();
        let Error::Internal { site, message } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(message, "broken invariant");
        assert!(site.contains("guard.rs"), "{site}");
        let first = format!("broken invariant, at {site}");
        assert_eq!(g.poison().get(), Some(first.as_str()));
        // Later calls never see the half-changed value.
        for r in [g.get(|v| v.len()), g.run(|v| Ok(v.len()))] {
            let Err(Error::Internal { message, .. }) = r else {
                panic!("{r:?}")
            };
            assert!(message.contains("broken invariant"), "{message}");
        }
    }

    #[test]
    fn an_inner_internal_error_poisons_too_and_other_errors_do_not() {
        let g = Guarded::new(0u32);
        let refused = g.run(|_| -> Result<()> { Err(Error::config("x", 1, "2")) });
        assert!(matches!(refused, Err(Error::Config { .. })));
        assert_eq!(g.poison().get(), None);
        assert_eq!(g.get(|v| *v), Ok(0));
        let inner = Guarded::new(());
        let e = g
            .run(|v| {
                *v += 1;
                inner.run(|_| -> Result<()> { injected_panic("inner") })
            })
            .unwrap_err();
        assert!(matches!(e, Error::Internal { .. }));
        assert!(inner.poison().get().is_some() && g.poison().get().is_some());
        assert!(g.get(|v| *v).is_err());
    }

    #[test]
    fn guards_sharing_a_flag_refuse_together() {
        let a = Guarded::new(1u8);
        let b = Guarded::sharing(2u8, Arc::clone(a.poison()));
        let free = Poison::default();
        assert_eq!(free.contain(|| Ok(3)), Ok(3));
        assert!(a
            .poison()
            .contain(|| -> Result<()> { injected_panic("in a") })
            .is_err());
        let Err(Error::Internal { message, .. }) = b.get(|v| *v) else {
            panic!("b still served")
        };
        assert!(message.contains("in a"), "{message}");
        assert_eq!(free.contain(|| Ok(4)), Ok(4));
    }

    #[test]
    fn a_real_panic_is_contained_with_its_message() {
        let g = Guarded::new(Vec::<u8>::new());
        #[allow(clippy::unnecessary_operation)]
        let r = g.get(|v| v[3]);
        let Err(Error::Internal { message, .. }) = r else {
            panic!("{r:?}")
        };
        assert!(message.contains("index out of bounds"), "{message}");
        assert_eq!(panic_message(&5u8), "a panic without a message");
    }
}
