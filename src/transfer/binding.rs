//! `PageTransferBinding`: one pool buffer's planes, as a copy engine sees them.
//!
//! Planes are listed layer-major, as the source does: `[K0, V0, K1, V1, ...]` for K/V pools and
//! `[K0, K1, ...]` for K-only pools, so layer `l` uses planes `[l * ppl, l * ppl + ppl)`.

use crate::error::{Error, Result};
use crate::layout::HostLayout;
use crate::pool::PoolSpec;
use crate::row::{Piece, RowFormat};
use std::ops::Range;

/// Where a buffer lives, which decides which engines may touch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Pageable or pinned host memory, addressed by host pointers.
    Host,
    /// CUDA device memory.
    Device,
}

/// How a layer-flattened view ([`PageTransferBinding::flatten_layers`]) numbers page `h` of
/// layer `l`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerPageOrder {
    /// `l * pages + h`.
    LayerFirst {
        /// Pages per layer.
        pages: u32,
    },
    /// `h * layers + l`.
    LayerPageFirst {
        /// Layers.
        layers: u32,
    },
}

impl LayerPageOrder {
    /// The flat page of page `page` at `layer`.
    #[inline]
    pub fn flat(self, page: u32, layer: u16) -> u32 {
        match self {
            LayerPageOrder::LayerFirst { pages } => u32::from(layer) * pages + page,
            LayerPageOrder::LayerPageFirst { layers } => page * layers + u32::from(layer),
        }
    }
}

/// Refuses a null base and a range past the end of the address space.
fn check_extent(base: u64, len: u64) -> Result<()> {
    if base == 0 {
        return Err(Error::plan(
            "base",
            "a null pointer",
            "the buffer's address",
        ));
    }
    base.checked_add(len).map(|_| ()).ok_or_else(|| {
        Error::plan(
            "base + len",
            "an overflow",
            "a buffer inside the address space",
        )
    })
}

/// One pool buffer's planes: base address of each (layer, plane), page stride and sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageTransferBinding {
    planes: Vec<u64>,
    planes_per_layer: usize,
    pages: u32,
    page_size: u32,
    token_bytes: u64,
    row: RowFormat,
    /// Where a token's row sits in a page: one piece, or one per part of a split page.
    pieces: Vec<Piece>,
    page_stride: u64,
    base: u64,
    len: u64,
    kind: MemoryKind,
    /// The CUDA device ordinal of device memory, when known.
    device: Option<u32>,
}

impl PageTransferBinding {
    /// The binding, marked as memory of CUDA device `ordinal` (what the engines check).
    pub fn on_device(mut self, ordinal: u32) -> Self {
        self.device = Some(ordinal);
        self
    }

    /// The CUDA device ordinal of device memory, when known.
    pub fn device(&self) -> Option<u32> {
        self.device
    }

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
        check_extent(base, len)?;
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
            row: spec.row,
            pieces: spec.row.pieces(u64::from(spec.page_size)),
            page_stride,
            base,
            len,
            kind,
            device: None,
        })
    }

    /// Describes a buffer of `pages` opaque blocks: block `i` is the `page_bytes` bytes at
    /// `base + i * page_stride` (one layer, one plane, moved as bytes). How an engine's own
    /// block tensors are seen (vLLM's `(num_blocks, page_size_bytes)` int8 views, a page
    /// possibly padded past what is copied).
    ///
    /// # Safety
    /// As for [`Self::new`]: `base..base + len` is one allocation that stays valid, and only
    /// the copy engines write it while a transfer over it is in flight.
    pub unsafe fn blocks(
        base: u64,
        len: u64,
        pages: u32,
        page_bytes: u64,
        page_stride: u64,
        kind: MemoryKind,
    ) -> Result<Self> {
        check_extent(base, len)?;
        let count = u32::try_from(page_bytes)
            .ok()
            .filter(|&b| b > 0)
            .ok_or_else(|| Error::plan("page_bytes", page_bytes, "1 <= page_bytes < 2^32"))?;
        if page_bytes > page_stride {
            return Err(Error::plan(
                "page_bytes",
                page_bytes,
                format!("at most the block stride, {page_stride}"),
            ));
        }
        if pages == 0 {
            return Err(Error::plan("pages", 0, "at least one block"));
        }
        u64::from(pages - 1)
            .checked_mul(page_stride)
            .and_then(|o| o.checked_add(page_bytes))
            .filter(|&e| e <= len)
            .ok_or_else(|| {
                Error::plan(
                    "len",
                    len,
                    format!(
                        "at least {pages} blocks of {page_bytes} bytes at stride {page_stride}"
                    ),
                )
            })?;
        // One-byte elements: the bytes are moved as they are.
        let row = RowFormat::plain(crate::layout::Dtype::Fp8E4m3, count);
        Ok(PageTransferBinding {
            planes: vec![base],
            planes_per_layer: 1,
            pages,
            page_size: 1,
            token_bytes: page_bytes,
            pieces: row.pieces(1),
            row,
            page_stride,
            base,
            len,
            kind,
            device: None,
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

    /// The token row's format.
    pub fn row(&self) -> &RowFormat {
        &self.row
    }

    /// The byte ranges of a token's row within a page (one unless the page is split).
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
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

    /// The same buffer seen as one layer of `pages x layers` pages, so that a copy engine can
    /// move one layer of one page (a per-layer object) between it and a one-layer pool.
    /// Returns the view and how page `h` of layer `l` is numbered in it. Works for both host
    /// layouts: layer-first numbers it `l * pages + h`, layer-page-first `h * layers + l`.
    pub fn flatten_layers(&self) -> Result<(PageTransferBinding, LayerPageOrder)> {
        let layers = self.layers() as u64;
        let pb = self.page_bytes();
        let pages = u64::from(self.pages);
        let order = if layers == 1 {
            LayerPageOrder::LayerFirst { pages: self.pages }
        } else {
            let step = self.planes[self.planes_per_layer] - self.planes[0];
            if self.page_stride == pb && step == pages * pb {
                LayerPageOrder::LayerFirst { pages: self.pages }
            } else if self.page_stride == layers * pb && step == pb {
                LayerPageOrder::LayerPageFirst {
                    layers: layers as u32,
                }
            } else {
                return Err(Error::plan(
                    "binding",
                    format!("page stride {} and layer step {step}", self.page_stride),
                    "a pool in layer_first or layer_page_first layout",
                ));
            }
        };
        let flat = pages * layers;
        let flat_pages = u32::try_from(flat)
            .map_err(|_| Error::plan("pages x layers", flat, "at most 2^32 - 1 pages"))?;
        Ok((
            PageTransferBinding {
                planes: self.planes[..self.planes_per_layer].to_vec(),
                planes_per_layer: self.planes_per_layer,
                pages: flat_pages,
                page_size: self.page_size,
                token_bytes: self.token_bytes,
                row: self.row,
                pieces: self.pieces.clone(),
                page_stride: pb,
                base: self.base,
                len: self.len,
                kind: self.kind,
                device: self.device,
            },
            order,
        ))
    }

    /// [`Self::row_addr`], or None where `plane`, `page` or `token` is outside the pool: for
    /// callers that read or write a row the scheduler named (a wrong slot is then an error to
    /// report, not a read outside the buffer).
    pub fn row_addr_checked(&self, plane: usize, page: u32, token: u32) -> Option<u64> {
        (plane < self.planes.len() && page < self.pages && token < self.page_size)
            .then(|| self.row_addr(plane, page, token))
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

/// Refuses a host binding whose pages are not its device binding's (page size, planes a
/// layer, row bytes and format): every copy between them would fail, each write-through
/// counted as a failed backup until the device filled with pages it could not evict.
pub fn check_same_rows(
    (df, d): (&str, &PageTransferBinding),
    (hf, h): (&str, &PageTransferBinding),
) -> Result<()> {
    let shape = |b: &PageTransferBinding| (b.page_size, b.planes_per_layer, b.token_bytes, b.row);
    let say = |(ps, planes, bytes, row): (u32, usize, u64, RowFormat)| {
        format!("pages of {ps} tokens, {planes} planes a layer, {bytes}-byte rows ({row})")
    };
    let (ds, hs) = (shape(d), shape(h));
    if ds != hs {
        return Err(Error::config(hf, say(hs), format!("{df}'s: {}", say(ds))));
    }
    Ok(())
}

/// Refuses bindings whose buffers overlap (one buffer bound as two pools, or two views of the
/// same memory): the copies of one would read and write the other's pages.
pub fn check_disjoint(bindings: &[(&str, &PageTransferBinding)]) -> Result<()> {
    for (i, (fa, a)) in bindings.iter().enumerate() {
        for (fb, b) in &bindings[i + 1..] {
            let ((a0, al), (b0, bl)) = (a.extent(), b.extent());
            if a.kind == b.kind && a0 < b0.saturating_add(bl) && b0 < a0.saturating_add(al) {
                return Err(Error::config(
                    *fb,
                    format!(
                        "a buffer overlapping {fa}'s ({b0:#x}, {bl} bytes; {fa} at {a0:#x}, \
                         {al} bytes)"
                    ),
                    "a buffer of its own for each pool",
                ));
            }
        }
    }
    Ok(())
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
    fn a_checked_row_address_is_none_outside_the_pool() {
        // KV, 2 layers: 4 planes of 10 pages of 4 tokens.
        let b = binding(Component::Kv, 2, 2);
        assert_eq!(b.row_addr_checked(3, 9, 3), Some(b.row_addr(3, 9, 3)));
        assert_eq!(b.row_addr_checked(4, 0, 0), None, "plane");
        assert_eq!(b.row_addr_checked(0, 10, 0), None, "page");
        assert_eq!(b.row_addr_checked(0, u32::MAX, 0), None, "a -1 slot");
        assert_eq!(b.row_addr_checked(0, 0, 4), None, "row");
    }

    #[test]
    fn flattened_layers_address_the_same_rows() {
        for layout in [HostLayout::LayerFirst, HostLayout::LayerPageFirst] {
            let spec = PoolSpec::new(Component::Kv, 3, 2, 1, 8, Dtype::Bf16, 4, 10).unwrap();
            // SAFETY: a made-up address; only addresses are computed.
            let b = unsafe {
                PageTransferBinding::new(4096, spec.total_bytes(), &spec, layout, MemoryKind::Host)
            }
            .unwrap();
            let (flat, order) = b.flatten_layers().unwrap();
            assert_eq!((flat.layers(), flat.pages()), (1, 30));
            for l in 0..3u16 {
                for h in 0..10 {
                    for plane in 0..2 {
                        assert_eq!(
                            flat.row_addr(plane, order.flat(h, l), 3),
                            b.row_addr(l as usize * 2 + plane, h, 3),
                            "{layout:?} page {h} layer {l}"
                        );
                    }
                }
            }
        }
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
