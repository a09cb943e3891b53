//! `PageTransferBinding`: one pool buffer's planes, as a copy engine sees them.
//!
//! Planes are listed layer-major, as the source does: `[K0, V0, K1, V1, ...]` for K/V pools and
//! `[K0, K1, ...]` for K-only pools, so layer `l` uses planes `[l * ppl, l * ppl + ppl)`.

use crate::error::{Error, Result};
use crate::layout::HostLayout;
use crate::pool::PoolSpec;
use std::ops::Range;

/// Where a buffer lives, which decides which engines may touch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Pageable or pinned host memory, addressed by host pointers.
    Host,
    /// CUDA device memory.
    Device,
}

/// One pool buffer's planes: base address of each (layer, plane), page stride and sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageTransferBinding {
    planes: Vec<u64>,
    planes_per_layer: usize,
    pages: u32,
    page_size: u32,
    token_bytes: u64,
    page_stride: u64,
    base: u64,
    len: u64,
    kind: MemoryKind,
}

impl PageTransferBinding {
    /// Describes the buffer `[base, base + len)` holding a pool of geometry `spec` in `layout`.
    ///
    /// # Safety
    /// `base..base + len` must be one allocation that stays valid, and that nothing but the
    /// copy engines reads or writes while a transfer over it is in flight. Engines rely on
    /// this to copy without further checks; every address they touch is inside the range.
    pub unsafe fn new(
        base: u64,
        len: u64,
        spec: &PoolSpec,
        layout: HostLayout,
        kind: MemoryKind,
    ) -> Result<Self> {
        if base == 0 {
            return Err(Error::plan(
                "base",
                "a null pointer",
                "the buffer's address",
            ));
        }
        if len != spec.total_bytes() {
            return Err(Error::plan(
                "len",
                len,
                format!(
                    "{} bytes: the size of a {} pool of this geometry",
                    spec.total_bytes(),
                    spec.component.name()
                ),
            ));
        }
        base.checked_add(len).ok_or_else(|| {
            Error::plan(
                "base + len",
                "an overflow",
                "a buffer inside the address space",
            )
        })?;
        let g = spec.geometry(layout);
        let mut planes = Vec::with_capacity((g.layers * g.planes) as usize);
        for layer in 0..g.layers {
            for plane in 0..g.planes {
                planes.push(base + g.page_offset_unchecked(plane, layer, 0));
            }
        }
        let page_stride = if g.pages > 1 {
            g.page_offset_unchecked(0, 0, 1)
        } else {
            g.page_bytes()
        };
        Ok(PageTransferBinding {
            planes,
            planes_per_layer: spec.planes_per_layer as usize,
            pages: spec.pages,
            page_size: spec.page_size,
            token_bytes: spec.token_bytes(),
            page_stride,
            base,
            len,
            kind,
        })
    }

    /// Planes of `layer`, or of every layer for `None`. A layer out of range is an error.
    pub fn plane_range(&self, layer: Option<usize>) -> Result<Range<usize>> {
        let width = self.planes_per_layer;
        match layer {
            None => Ok(0..self.planes.len()),
            Some(l) if l < self.layers() => Ok(l * width..l * width + width),
            Some(l) => Err(Error::out_of_range(
                "layer",
                l as u64,
                0,
                self.layers() as u64,
            )),
        }
    }

    /// Layers of the pool.
    pub fn layers(&self) -> usize {
        self.planes.len() / self.planes_per_layer
    }

    /// Planes per layer.
    pub fn planes_per_layer(&self) -> usize {
        self.planes_per_layer
    }

    /// Planes in all.
    pub fn plane_count(&self) -> usize {
        self.planes.len()
    }

    /// Pages of the buffer.
    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// Tokens per page.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Bytes of one token row of one plane.
    pub fn token_bytes(&self) -> u64 {
        self.token_bytes
    }

    /// Bytes of one page of one plane.
    pub fn page_bytes(&self) -> u64 {
        self.token_bytes * u64::from(self.page_size)
    }

    /// Bytes between the starts of consecutive pages of one plane.
    pub fn page_stride(&self) -> u64 {
        self.page_stride
    }

    /// Where the buffer lives.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// The buffer's extent.
    pub fn extent(&self) -> (u64, u64) {
        (self.base, self.len)
    }

    /// Address of token row `token` of `page` in plane `plane`. Inputs are checked by the
    /// prepared transfer before it calls this.
    #[inline]
    pub fn row_addr(&self, plane: usize, page: u32, token: u32) -> u64 {
        self.planes[plane]
            + u64::from(page) * self.page_stride
            + u64::from(token) * self.token_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Component, Dtype};

    fn binding(component: Component, ppl: u32, layers: u32) -> PageTransferBinding {
        let spec = PoolSpec::new(component, layers, ppl, 1, 8, Dtype::Bf16, 4, 10).unwrap();
        // SAFETY: a made-up address; nothing is read or written through it in this test.
        unsafe {
            PageTransferBinding::new(
                4096,
                spec.total_bytes(),
                &spec,
                HostLayout::LayerFirst,
                MemoryKind::Host,
            )
        }
        .unwrap()
    }

    #[test]
    fn source_plane_examples() {
        // Main KV of three layers: [K0, V0, K1, V1, K2, V2]; layer 1 starts at 2, count 2.
        let kv = binding(Component::Kv, 2, 3);
        assert_eq!(kv.plane_range(Some(1)).unwrap(), 2..4);
        assert_eq!(kv.plane_range(None).unwrap(), 0..6);
        // K-only Indexer-K of three layers: [K0, K1, K2]; layer 1 starts at 1, count 1.
        let ik = binding(Component::Indexer, 1, 3);
        assert_eq!(ik.plane_range(Some(1)).unwrap(), 1..2);
        assert!(matches!(
            ik.plane_range(Some(3)),
            Err(Error::OutOfRange { .. })
        ));
    }

    #[test]
    fn wrong_length_is_refused() {
        let spec = PoolSpec::new(Component::Kv, 1, 2, 1, 8, Dtype::Bf16, 4, 10).unwrap();
        // SAFETY: construction fails before any address is used.
        let e = unsafe {
            PageTransferBinding::new(4096, 7, &spec, HostLayout::LayerFirst, MemoryKind::Host)
        };
        assert!(matches!(e, Err(Error::Plan { .. })));
    }
}
