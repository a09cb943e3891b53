//! `PreparedPageTransfer` (one pool: binding pair + map) and `PageTransferGroup` (the pools of
//! one cache operation: KV + Indexer-K + draft), turned into contiguous copy operations per
//! layer.

use super::binding::{MemoryKind, PageTransferBinding};
use super::map::{Granularity, PageTransferMap};
use crate::error::{Error, Result};
use crate::row::Piece;

/// Which way a transfer goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Host to device (load-back); runs on the load stream.
    Load,
    /// Device to host (write-through backup); runs on the write stream.
    Backup,
}

impl Direction {
    /// Canonical name.
    pub const fn name(self) -> &'static str {
        match self {
            Direction::Load => "load",
            Direction::Backup => "backup",
        }
    }
}

/// One contiguous copy: `len` bytes from `src` to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// A checked transfer of one pool: every address it produces lies inside its bindings.
#[derive(Debug, Clone)]
pub struct PreparedPageTransfer {
    src: PageTransferBinding,
    dst: PageTransferBinding,
    map: PageTransferMap,
    direction: Direction,
}

impl PreparedPageTransfer {
    /// Checks that the bindings hold the same geometry and that every unit of the map lies in
    /// both buffers.
    pub fn new(
        src: PageTransferBinding,
        dst: PageTransferBinding,
        map: PageTransferMap,
        direction: Direction,
    ) -> Result<Self> {
        let same = |field: &str, a: u64, b: u64| -> Result<()> {
            if a == b {
                Ok(())
            } else {
                Err(Error::plan(
                    format!("dst.{field}"),
                    b,
                    format!("{a}: the source's {field}"),
                ))
            }
        };
        let ((sb, sl), (db, dl)) = (src.extent(), dst.extent());
        if sb < db + dl && db < sb + sl {
            return Err(Error::plan(
                "dst",
                "a buffer overlapping the source",
                "separate source and destination buffers",
            ));
        }
        same(
            "planes_per_layer",
            src.planes_per_layer() as u64,
            dst.planes_per_layer() as u64,
        )?;
        same("layers", src.layers() as u64, dst.layers() as u64)?;
        same(
            "page_size",
            u64::from(src.page_size()),
            u64::from(dst.page_size()),
        )?;
        same("token_bytes", src.token_bytes(), dst.token_bytes())?;
        if src.row() != dst.row() {
            // A split page moved as bytes is exact only between pools of one row format.
            return Err(Error::plan(
                "dst.row_format",
                dst.row().to_string(),
                format!("{}: the source's row format", src.row()),
            ));
        }
        let per = |b: &PageTransferBinding| match map.granularity() {
            Granularity::Page => u64::from(b.pages()),
            Granularity::Token => u64::from(b.pages()) * u64::from(b.page_size()),
        };
        let (max_src, max_dst) = map.max_units();
        if max_src >= per(&src) {
            return Err(Error::out_of_range(
                format!("src {}", map.granularity().name()),
                max_src,
                0,
                per(&src),
            ));
        }
        if max_dst >= per(&dst) {
            return Err(Error::out_of_range(
                format!("dst {}", map.granularity().name()),
                max_dst,
                0,
                per(&dst),
            ));
        }
        Ok(PreparedPageTransfer {
            src,
            dst,
            map,
            direction,
        })
    }

    /// Layers of the pool.
    pub fn layers(&self) -> usize {
        self.src.layers()
    }

    /// Which way it goes.
    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// The map.
    pub fn map(&self) -> &PageTransferMap {
        &self.map
    }

    /// Source and destination bindings.
    pub fn bindings(&self) -> (&PageTransferBinding, &PageTransferBinding) {
        (&self.src, &self.dst)
    }

    /// Bytes of one unit of one plane.
    pub fn unit_bytes(&self) -> u64 {
        match self.map.granularity() {
            Granularity::Page => self.src.page_bytes(),
            Granularity::Token => self.src.token_bytes(),
        }
    }

    /// Bytes moved for `layer`, or for every layer.
    pub fn bytes(&self, layer: Option<usize>) -> Result<u64> {
        let planes = self.src.plane_range(layer)?.len() as u64;
        Ok(self.map.units() as u64 * self.unit_bytes() * planes)
    }

    /// Address of `unit`'s first byte, or, at token granularity, of its row's `piece` (the
    /// whole row unless the page is split into values, then scales).
    fn addr(&self, b: &PageTransferBinding, plane: usize, unit: u64, piece: Piece) -> u64 {
        match self.map.granularity() {
            Granularity::Page => b.row_addr(plane, unit as u32, 0),
            Granularity::Token => {
                let ps = u64::from(b.page_size());
                b.row_addr(plane, (unit / ps) as u32, 0) + piece.base + (unit % ps) * piece.bytes
            }
        }
    }

    /// Contiguous copies for `layer` (or every layer), merged wherever both sides continue.
    pub fn ops(&self, layer: Option<usize>, out: &mut Vec<CopyOp>) -> Result<()> {
        let whole = [Piece {
            base: 0,
            bytes: self.unit_bytes(),
        }];
        // A token's row in a split page is one range per part: each part's rows are moved in
        // their own pass, so consecutive tokens still merge into one copy per part.
        let pieces = match self.map.granularity() {
            Granularity::Page => &whole[..],
            Granularity::Token => self.src.pieces(),
        };
        for plane in self.src.plane_range(layer)? {
            for &piece in pieces {
                // At most one op per unit: one reservation instead of doublings (a restore of
                // token rows can be a million ops); merged ranges leave the rest unused.
                out.reserve(self.map.pairs().len());
                let first = out.len();
                for &(s, d) in self.map.pairs() {
                    let (src, dst) = (
                        self.addr(&self.src, plane, s, piece),
                        self.addr(&self.dst, plane, d, piece),
                    );
                    let mergeable = out.len() > first;
                    match out.last_mut() {
                        Some(op)
                            if mergeable && op.src + op.len == src && op.dst + op.len == dst =>
                        {
                            op.len += piece.bytes
                        }
                        _ => out.push(CopyOp {
                            src,
                            dst,
                            len: piece.bytes,
                        }),
                    }
                }
            }
        }
        Ok(())
    }
}

/// Several pools moved by one cache operation, layer by layer.
#[derive(Debug, Clone)]
pub struct PageTransferGroup {
    members: Vec<PreparedPageTransfer>,
}

impl PageTransferGroup {
    /// A group; every member goes the same way.
    pub fn new(members: Vec<PreparedPageTransfer>) -> Result<Self> {
        let Some(first) = members.first() else {
            return Err(Error::plan(
                "members",
                "an empty group",
                "at least one prepared transfer",
            ));
        };
        let dir = first.direction();
        if let Some((i, m)) = members
            .iter()
            .enumerate()
            .find(|(_, m)| m.direction() != dir)
        {
            return Err(Error::plan(
                format!("members[{i}].direction"),
                m.direction().name(),
                format!("{}: every member of a group goes the same way", dir.name()),
            ));
        }
        Ok(PageTransferGroup { members })
    }

    /// The members.
    pub fn members(&self) -> &[PreparedPageTransfer] {
        &self.members
    }

    /// Which way it goes.
    pub fn direction(&self) -> Direction {
        self.members[0].direction()
    }

    /// Layers: the largest member's (a member with fewer layers has nothing in the rest).
    pub fn layers(&self) -> usize {
        self.members.iter().map(|m| m.layers()).max().unwrap_or(0)
    }

    /// Whether every buffer of the group is host memory (what the cpu engine needs).
    pub fn all_host(&self) -> bool {
        self.members.iter().all(|m| {
            let (s, d) = m.bindings();
            s.kind() == MemoryKind::Host && d.kind() == MemoryKind::Host
        })
    }

    /// Copies of `layer` for every member that has it.
    pub fn layer_ops(&self, layer: usize) -> Result<Vec<CopyOp>> {
        if layer >= self.layers() {
            return Err(Error::out_of_range(
                "layer",
                layer as u64,
                0,
                self.layers() as u64,
            ));
        }
        let mut out = Vec::new();
        for m in self.members.iter().filter(|m| layer < m.layers()) {
            m.ops(Some(layer), &mut out)?;
        }
        Ok(out)
    }

    /// Bytes moved in all.
    pub fn bytes(&self) -> u64 {
        self.members
            .iter()
            .map(|m| m.bytes(None).unwrap_or(0))
            .sum()
    }
}
