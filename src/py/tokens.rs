//! Token ids from the containers users hold, at most one tight conversion per call.
//!
//! The tree keeps tokens as `u32`. A C-contiguous 1-D buffer of `u32` (numpy uint32,
//! `array('I')`) is borrowed as is. Other integer buffers (`array('q')`, SGLang's container,
//! `array('i')`, numpy int64/int32/uint64/uint16/uint8, torch CPU tensors through `.numpy()`, which
//! shares their memory) are range-checked and narrowed in one pass into a reused thread-local
//! buffer. `bytes`, `bytearray` and byte `memoryview`s are read as little-endian `u32` token
//! ids. Anything else (a Python list) goes through `numpy.asarray`: the slow path.

use crate::error::Error;
use crate::py::args::int64_array;
use crate::py::error::to_py;
use numpy::PyUntypedArrayMethods;
use pyo3::buffer::{Element, PyUntypedBuffer};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyMemoryView};
use std::cell::RefCell;

thread_local! {
    /// The narrowing buffer, kept between calls so that a conversion does not allocate.
    static SCRATCH: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// Tokens for a lookup: the tree's width, or int64 compared as is.
#[derive(Clone, Copy)]
pub enum Lookup<'a> {
    /// `u32` token ids.
    U32(&'a [u32]),
    /// `int64` values (`array('q')`, numpy int64, torch int64): read only as far as a match
    /// goes, no narrowing pass.
    I64(&'a [i64]),
}

impl Lookup<'_> {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        match self {
            Lookup::U32(s) => s.len(),
            Lookup::I64(s) => s.len(),
        }
    }

    /// A copy that outlives the borrowed buffer (to read after the GIL was let go).
    pub fn copied(self) -> OwnedLookup {
        match self {
            Lookup::U32(s) => OwnedLookup::U32(s.to_vec()),
            Lookup::I64(s) => OwnedLookup::I64(s.to_vec()),
        }
    }
}

/// Tokens copied out of a caller's buffer.
pub enum OwnedLookup {
    /// `u32` token ids.
    U32(Vec<u32>),
    /// `int64` values.
    I64(Vec<i64>),
}

impl OwnedLookup {
    /// The tokens, borrowed.
    pub fn view(&self) -> Lookup<'_> {
        match self {
            OwnedLookup::U32(v) => Lookup::U32(v),
            OwnedLookup::I64(v) => Lookup::I64(v),
        }
    }
}

/// Runs `f` over the tokens of `obj` for a lookup or an insert: int64 and uint32 buffers are
/// passed as they are, the rest as by [`with_tokens`].
pub fn with_lookup<R>(
    obj: &Bound<'_, PyAny>,
    f: impl FnOnce(Lookup<'_>) -> PyResult<R>,
) -> PyResult<R> {
    if let Some(buf) = buffer(obj)? {
        if buf.dimensions() <= 1 && buf.is_c_contiguous() && !is_raw_bytes(obj) {
            if let Some(s) = typed::<i64>(&buf) {
                return f(Lookup::I64(s));
            }
            if let Some(s) = typed::<u32>(&buf) {
                return f(Lookup::U32(s));
            }
        }
    }
    with_tokens(obj, |t| f(Lookup::U32(t)))
}

/// Runs `f` over the tokens of `obj` as `u32`.
pub fn with_tokens<R>(
    obj: &Bound<'_, PyAny>,
    f: impl FnOnce(&[u32]) -> PyResult<R>,
) -> PyResult<R> {
    let py = obj.py();
    if let Some(buf) = buffer(obj)? {
        if is_raw_bytes(obj) && buf.item_size() == 1 && !buf.is_c_contiguous() {
            // Read as they are, a strided view's bytes would be a token a byte.
            return Err(to_py(
                py,
                Error::config(
                    "tokens",
                    "a strided memoryview of bytes",
                    "contiguous bytes of little-endian uint32 token ids",
                ),
            ));
        }
        if buf.dimensions() <= 1 && buf.is_c_contiguous() {
            if is_raw_bytes(obj) && buf.item_size() == 1 {
                return narrow_le_bytes(py, &buf, f);
            }
            if let Some(s) = typed::<u32>(&buf) {
                return f(s);
            }
            if let Some(s) = typed::<i64>(&buf) {
                return narrow(py, s, f);
            }
            if let Some(s) = typed::<i32>(&buf) {
                return narrow(py, s, f);
            }
            if let Some(s) = typed::<u64>(&buf) {
                return narrow(py, s, f);
            }
            if let Some(s) = typed::<u16>(&buf) {
                return narrow(py, s, f);
            }
            if let Some(s) = typed::<u8>(&buf) {
                return narrow(py, s, f);
            }
        }
    }
    slow(obj, f)
}

/// The buffer `obj` exports, or for a torch CPU tensor (which exports none) the buffer of its
/// `.numpy()` view, which shares the tensor's memory (the buffer keeps the view alive).
fn buffer(obj: &Bound<'_, PyAny>) -> PyResult<Option<PyUntypedBuffer>> {
    if let Ok(b) = PyUntypedBuffer::get(obj) {
        return Ok(Some(b));
    }
    if !is_torch_tensor(obj) {
        return Ok(None);
    }
    let view = obj.call_method0("numpy").map_err(|_| {
        to_py(
            obj.py(),
            Error::config(
                "tokens",
                crate::py::args::short(obj),
                "a CPU tensor of token ids",
            ),
        )
    })?;
    Ok(PyUntypedBuffer::get(&view).ok())
}

/// `bytes`, `bytearray` and `memoryview`s: read as little-endian uint32 token ids.
fn is_raw_bytes(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
        || obj.is_instance_of::<PyMemoryView>()
}

fn is_torch_tensor(obj: &Bound<'_, PyAny>) -> bool {
    obj.get_type()
        .module()
        .is_ok_and(|m| m.to_str().is_ok_and(|m| m == "torch"))
}

/// Whether the buffer's values are in this machine's byte order. pyo3 0.30 takes a
/// big-endian format (`>`) for native on a little-endian machine, so it is checked here:
/// values in the other order go the slow way, which converts them by value.
fn native_order(buf: &PyUntypedBuffer) -> bool {
    match buf.format().to_bytes().first() {
        Some(b'>' | b'!') => cfg!(target_endian = "big"),
        Some(b'<') => cfg!(target_endian = "little"),
        _ => true,
    }
}

/// The buffer as a slice of `T`, when its format is `T`'s, in native byte order.
fn typed<T: Element>(buf: &PyUntypedBuffer) -> Option<&[T]> {
    if !native_order(buf) {
        return None;
    }
    let b = buf.as_typed::<T>().ok()?;
    let ptr = b.as_slice_ptr()?;
    // SAFETY: the buffer is C-contiguous and of `T`'s format and size (checked by `as_typed`
    // and `as_slice_ptr`), and stays exported (so alive and unmoved) while `buf` lives. The GIL
    // is held and no Python code runs while the slice is read, so nothing writes it meanwhile.
    Some(unsafe { ptr.as_ref() })
}

/// Narrows `src` into the scratch buffer, refusing values outside `0..2^32`: one pass that
/// casts and ORs every value's 64-bit pattern (a negative value, or one of 2^32 and above, sets
/// a high bit), which the compiler vectorizes; the offending value is looked up only on error.
fn narrow<T, R>(py: Python<'_>, src: &[T], f: impl FnOnce(&[u32]) -> PyResult<R>) -> PyResult<R>
where
    T: Copy + Into<i128> + Token,
{
    with_scratch(|dst| {
        dst.resize(src.len(), 0);
        let high = cast_or_fast(src, dst) >> 32;
        if high != 0 {
            let bad = src
                .iter()
                .copied()
                .find(|v| v.bits() >> 32 != 0)
                .expect("a high bit set");
            return Err(to_py(
                py,
                Error::out_of_range("tokens", bad.into(), 0, i128::from(u32::MAX) + 1),
            ));
        }
        f(dst)
    })
}

/// [`cast_or`] compiled for AVX2 where the CPU has it (the wheel targets baseline x86-64).
fn cast_or_fast<T: Token>(src: &[T], dst: &mut [u32]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above); the function only reads
            // `src` and writes `dst`, both valid slices.
            return unsafe { cast_or_avx2(src, dst) };
        }
    }
    cast_or(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn cast_or_avx2<T: Token>(src: &[T], dst: &mut [u32]) -> u64 {
    cast_or(src, dst)
}

#[inline(always)]
fn cast_or<T: Token>(src: &[T], dst: &mut [u32]) -> u64 {
    let mut acc = 0u64;
    for (d, &s) in dst.iter_mut().zip(src) {
        let b = s.bits();
        acc |= b;
        *d = b as u32;
    }
    acc
}

/// An integer type tokens arrive in.
trait Token: Copy {
    /// The value sign-extended to 64 bits: a valid token id has the high 32 bits clear.
    fn bits(self) -> u64;
}

macro_rules! token {
    ($($t:ty => $wide:ty),*) => {$(
        impl Token for $t {
            #[inline]
            fn bits(self) -> u64 {
                <$wide>::from(self) as u64
            }
        }
    )*};
}
token!(i64 => i64, i32 => i64, u64 => u64, u16 => u64, u8 => u64);

fn narrow_le_bytes<R>(
    py: Python<'_>,
    buf: &PyUntypedBuffer,
    f: impl FnOnce(&[u32]) -> PyResult<R>,
) -> PyResult<R> {
    let Some(bytes) = typed::<u8>(buf).or_else(|| {
        // A memoryview of signed bytes ('b') or chars ('c'): the same bytes.
        // SAFETY: as in `typed`: C-contiguous, alive while `buf` lives, GIL held.
        (!buf.buf_ptr().is_null()).then(|| unsafe {
            std::slice::from_raw_parts(buf.buf_ptr().cast::<u8>(), buf.len_bytes())
        })
    }) else {
        return Err(to_py(
            py,
            Error::config("tokens", "a null buffer", "token ids"),
        ));
    };
    if bytes.len() % 4 != 0 {
        return Err(to_py(
            py,
            Error::config(
                "tokens",
                format!("{} bytes", bytes.len()),
                "bytes holding little-endian uint32 token ids (a multiple of 4 bytes)",
            ),
        ));
    }
    with_scratch(|dst| {
        dst.extend(
            bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
        f(dst)
    })
}

/// Runs `g` on the thread's scratch buffer, emptied (taken out while in use, so a nested call
/// gets a fresh one instead of a panic).
fn with_scratch<R>(g: impl FnOnce(&mut Vec<u32>) -> PyResult<R>) -> PyResult<R> {
    let mut v = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    v.clear();
    let out = g(&mut v);
    SCRATCH.with(|s| *s.borrow_mut() = v);
    out
}

/// Lists and other sequences: numpy converts, then one checked narrowing.
fn slow<R>(obj: &Bound<'_, PyAny>, f: impl FnOnce(&[u32]) -> PyResult<R>) -> PyResult<R> {
    let py = obj.py();
    let arr = int64_array(obj, "tokens", "token ids")?;
    if arr.ndim() != 1 {
        return Err(to_py(
            py,
            Error::config("tokens", format!("{} dims", arr.ndim()), "a 1-D array"),
        ));
    }
    match arr.as_slice() {
        Ok(s) => narrow(py, s, f),
        Err(_) => {
            let v: Vec<i64> = arr.as_array().iter().copied().collect();
            narrow(py, &v, f)
        }
    }
}
