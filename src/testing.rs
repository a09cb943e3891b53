//! Helpers shared by the crate's tests, soaks and benches (not part of the API).

/// A small seeded xorshift generator: reproducible streams without a dependency.
#[derive(Debug, Clone)]
pub struct XorShift(u64);

impl XorShift {
    /// A generator from `seed` (0 is mapped to a fixed non-zero state).
    pub fn new(seed: u64) -> Self {
        XorShift(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        })
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in `0..n` (`n = 0` gives 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| (self.next_u64() >> 24) as u8).collect()
    }
}

/// A zeroed host buffer sized for `spec` and a layer-first binding over it.
///
/// # Safety
/// The caller keeps the returned buffer alive, and touches it only where no transfer in
/// flight reads or writes, for as long as the binding (or anything holding a copy of it, such
/// as a scheduler) can submit transfers over it: `PageTransferBinding::new`'s contract.
pub unsafe fn host_pool(
    spec: &crate::pool::PoolSpec,
) -> crate::Result<(Box<[u8]>, crate::transfer::PageTransferBinding)> {
    // SAFETY: the caller's contract is this function's.
    unsafe { host_pool_in(spec, crate::layout::HostLayout::LayerFirst) }
}

/// [`host_pool`] in `layout`.
///
/// # Safety
/// As [`host_pool`].
pub unsafe fn host_pool_in(
    spec: &crate::pool::PoolSpec,
    layout: crate::layout::HostLayout,
) -> crate::Result<(Box<[u8]>, crate::transfer::PageTransferBinding)> {
    let mut buf = vec![0u8; spec.total_bytes() as usize].into_boxed_slice();
    // SAFETY: `buf` is one allocation of exactly the pool's bytes; moving the box out does
    // not move its heap storage, and the caller's contract above keeps it valid.
    let b = unsafe {
        crate::transfer::PageTransferBinding::new(
            buf.as_mut_ptr() as u64,
            buf.len() as u64,
            spec,
            layout,
            crate::transfer::MemoryKind::Host,
        )
    }?;
    Ok((buf, b))
}

/// The proptest configuration every property test of the crate uses: `cases` cases (or
/// `$PROPTEST_CASES` when set, for a longer run), and the failures it found kept in
/// `proptest-regressions/<name>.txt` at the crate root, one place for all of them.
#[cfg(test)]
pub fn proptest_config(cases: u32, name: &'static str) -> proptest::test_runner::Config {
    use proptest::test_runner::{Config, FileFailurePersistence};
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    // A leaked string: proptest keeps the path for the process (a few per test run).
    let path: &'static str = Box::leak(format!("proptest-regressions/{name}.txt").into_boxed_str());
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(path))),
        ..Config::default()
    }
}
