//! Counters read under a core lock and turned into Python dicts after it is released (no
//! Python object is made while a core lock is held: see `lock.rs`).

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// One counter's value.
#[derive(Debug, Clone)]
pub enum StatValue {
    U(u64),
    I(i64),
    F(f64),
    B(bool),
    S(&'static str),
    Map(Stats),
    None,
}

macro_rules! from_unsigned {
    ($($t:ty),*) => { $( impl From<$t> for StatValue {
        fn from(v: $t) -> Self { StatValue::U(v as u64) }
    } )* };
}
from_unsigned!(u8, u16, u32, u64, usize);

impl From<i64> for StatValue {
    fn from(v: i64) -> Self {
        StatValue::I(v)
    }
}
impl From<f64> for StatValue {
    fn from(v: f64) -> Self {
        StatValue::F(v)
    }
}
impl From<bool> for StatValue {
    fn from(v: bool) -> Self {
        StatValue::B(v)
    }
}
impl From<&'static str> for StatValue {
    fn from(v: &'static str) -> Self {
        StatValue::S(v)
    }
}
impl From<Stats> for StatValue {
    fn from(v: Stats) -> Self {
        StatValue::Map(v)
    }
}
impl<T: Into<StatValue>> From<Option<T>> for StatValue {
    fn from(v: Option<T>) -> Self {
        v.map_or(StatValue::None, Into::into)
    }
}

/// Named counters, in order.
#[derive(Debug, Clone, Default)]
pub struct Stats(Vec<(&'static str, StatValue)>);

impl Stats {
    /// Adds `key`.
    pub fn put(&mut self, key: &'static str, v: impl Into<StatValue>) {
        self.0.push((key, v.into()));
    }

    /// The dict (nested maps as dicts).
    pub fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in &self.0 {
            match v {
                StatValue::U(x) => d.set_item(k, x)?,
                StatValue::I(x) => d.set_item(k, x)?,
                StatValue::F(x) => d.set_item(k, x)?,
                StatValue::B(x) => d.set_item(k, x)?,
                StatValue::S(x) => d.set_item(k, x)?,
                StatValue::Map(m) => d.set_item(k, m.to_dict(py)?)?,
                StatValue::None => d.set_item(k, py.None())?,
            }
        }
        Ok(d)
    }
}
