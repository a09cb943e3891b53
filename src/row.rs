//! Packed per-token row formats: a token's row (per plane, per layer) as named parts with their
//! dtypes, and how a page lays its rows out.
//!
//! DeepSeek-V3.2's caches are not plain heads: its MLA row is 512 FP8 latent bytes, 4 fp32
//! scales and 64 bf16 RoPE dims (656 B), and its Indexer-K page holds the 64 tokens' FP8 values
//! first and their fp32 scales after them (8,448 B). A [`RowFormat`] says which parts a row has
//! and whether the page keeps each token's row whole ([`PageLayout::Interleaved`]) or each
//! part's rows together ([`PageLayout::ValuesThenScales`]). A page is one byte range per layer
//! either way, so plans, budgets and whole-page copies never look inside it; only a token's
//! row in a split page is several ranges, which [`RowFormat::pieces`] gives.

use crate::error::{Error, Result};
use crate::layout::Dtype;

/// Most parts a row may have.
pub const MAX_PARTS: usize = 4;

/// What a part of a row holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PartKind {
    /// The quantized (or plain) values.
    Values,
    /// Their dequantization scales.
    Scales,
    /// Unquantized rotary dimensions.
    Rope,
}

impl PartKind {
    /// Canonical name.
    pub const fn name(self) -> &'static str {
        match self {
            PartKind::Values => "values",
            PartKind::Scales => "scales",
            PartKind::Rope => "rope",
        }
    }

    /// Parses a part name.
    pub fn parse(field: &str, s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "values" => Ok(PartKind::Values),
            "scales" => Ok(PartKind::Scales),
            "rope" => Ok(PartKind::Rope),
            _ => Err(Error::config(
                field,
                format!("{s:?}"),
                "one of values, scales, rope",
            )),
        }
    }
}

/// A named run of `count` elements of `dtype` in a token's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowPart {
    /// What it holds.
    pub kind: PartKind,
    /// Element type.
    pub dtype: Dtype,
    /// Elements.
    pub count: u32,
}

impl RowPart {
    /// Bytes of the part in one row.
    pub const fn bytes(&self) -> u64 {
        self.count as u64 * self.dtype.itemsize()
    }
}

/// How a page lays out its token rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PageLayout {
    /// Each token's row whole, one after another.
    Interleaved,
    /// Each part's rows together, in part order: all the page's values, then all its scales
    /// (then any other part), as SGLang's DSA Indexer-K page.
    ValuesThenScales,
}

impl PageLayout {
    /// Canonical name.
    pub const fn name(self) -> &'static str {
        match self {
            PageLayout::Interleaved => "interleaved",
            PageLayout::ValuesThenScales => "values_then_scales",
        }
    }

    /// Parses a page layout name.
    pub fn parse(field: &str, s: &str) -> Result<Self> {
        match s.trim() {
            "interleaved" => Ok(PageLayout::Interleaved),
            "values_then_scales" => Ok(PageLayout::ValuesThenScales),
            _ => Err(Error::config(
                field,
                format!("{s:?}"),
                "one of interleaved, values_then_scales",
            )),
        }
    }
}

/// A token row's parts and the page layout. Fixed-size, so pool specs stay `Copy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowFormat {
    parts: [RowPart; MAX_PARTS],
    len: u8,
    layout: PageLayout,
}

/// Where one part of token `t`'s row sits in a page: at `base + t * bytes`, `bytes` long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Offset in the page of the part's row of token 0.
    pub base: u64,
    /// Bytes of the part in one row (also the stride between tokens' rows).
    pub bytes: u64,
}

impl RowFormat {
    /// A plain row: one part of `count` values of `dtype`, interleaved (every pool without a
    /// packed format).
    pub fn plain(dtype: Dtype, count: u32) -> Self {
        let part = RowPart {
            kind: PartKind::Values,
            dtype,
            count,
        };
        RowFormat {
            parts: [part; MAX_PARTS],
            len: 1,
            layout: PageLayout::Interleaved,
        }
    }

    /// A packed row of `parts` in `layout`, whose bytes must add up to `row_bytes` (the pool's
    /// `heads x head_dim x itemsize`). Errors name the field and what is allowed.
    pub fn new(parts: &[RowPart], layout: PageLayout, row_bytes: u64) -> Result<Self> {
        if parts.is_empty() || parts.len() > MAX_PARTS {
            return Err(Error::config(
                "row_parts",
                format!("{} parts", parts.len()),
                format!("1 to {MAX_PARTS} parts"),
            ));
        }
        for (i, p) in parts.iter().enumerate() {
            if p.count == 0 {
                return Err(Error::config(
                    format!("row_parts[{i}].count"),
                    0,
                    "an integer >= 1",
                ));
            }
            if parts[..i].iter().any(|q| q.kind == p.kind) {
                return Err(Error::config(
                    format!("row_parts[{i}].name"),
                    p.kind.name(),
                    "a part name not used before in the row",
                ));
            }
        }
        let sum: u64 = parts.iter().map(RowPart::bytes).sum();
        if sum != row_bytes {
            return Err(Error::config(
                "row_parts",
                format!("parts of {sum} bytes"),
                format!(
                    "parts adding up to the row's {row_bytes} bytes (heads x head_dim x itemsize)"
                ),
            ));
        }
        let mut all = [parts[0]; MAX_PARTS];
        all[..parts.len()].copy_from_slice(parts);
        Ok(RowFormat {
            parts: all,
            len: parts.len() as u8,
            layout,
        })
    }

    /// The parts, in row order.
    pub fn parts(&self) -> &[RowPart] {
        &self.parts[..usize::from(self.len)]
    }

    /// The page layout.
    pub fn layout(&self) -> PageLayout {
        self.layout
    }

    /// Bytes of one row.
    pub fn bytes(&self) -> u64 {
        self.parts().iter().map(RowPart::bytes).sum()
    }

    /// Whether a token's row is more than one byte range of its page.
    pub fn is_split(&self) -> bool {
        self.layout == PageLayout::ValuesThenScales && self.len > 1
    }

    /// The byte ranges of a token's row in a page of `page_size` tokens: one for a whole row,
    /// one per part in a split page.
    pub fn pieces(&self, page_size: u64) -> Vec<Piece> {
        if !self.is_split() {
            return vec![Piece {
                base: 0,
                bytes: self.bytes(),
            }];
        }
        let mut base = 0;
        self.parts()
            .iter()
            .map(|p| {
                let piece = Piece {
                    base,
                    bytes: p.bytes(),
                };
                base += page_size * p.bytes();
                piece
            })
            .collect()
    }

    /// Offset in a page of `page_size` tokens of part `part` of token `token`'s row. Inputs
    /// are checked by the caller.
    pub fn part_offset(&self, page_size: u64, token: u64, part: usize) -> u64 {
        let before: u64 = self.parts()[..part].iter().map(RowPart::bytes).sum();
        if self.is_split() {
            page_size * before + token * self.parts()[part].bytes()
        } else {
            token * self.bytes() + before
        }
    }
}

/// DeepSeek-V3.2's Indexer-K row: 128 FP8 e4m3 values and one fp32 scale (132 bytes), whose
/// pages are laid out values, then scales.
pub const DEEPSEEK_V32_INDEXER: [RowPart; 2] = [
    RowPart {
        kind: PartKind::Values,
        dtype: Dtype::Fp8E4m3,
        count: 128,
    },
    RowPart {
        kind: PartKind::Scales,
        dtype: Dtype::F32,
        count: 1,
    },
];

impl std::fmt::Display for RowFormat {
    /// `values fp8_e4m3 x128 + scales fp32 x1 (values_then_scales)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, p) in self.parts().iter().enumerate() {
            let sep = if i == 0 { "" } else { " + " };
            write!(f, "{sep}{} {} x{}", p.kind.name(), p.dtype.name(), p.count)?;
        }
        write!(f, " ({})", self.layout.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn indexer() -> RowFormat {
        RowFormat::new(&DEEPSEEK_V32_INDEXER, PageLayout::ValuesThenScales, 132).unwrap()
    }

    #[test]
    fn deepseek_indexer_page_is_values_then_scales() {
        let f = indexer();
        assert_eq!(f.bytes(), 132);
        assert_eq!(
            f.to_string(),
            "values fp8_e4m3 x128 + scales fp32 x1 (values_then_scales)"
        );
        // Token 5 of a 64-token page: values at 5 x 128, its scale at 64 x 128 + 5 x 4.
        assert_eq!(f.part_offset(64, 5, 0), 640);
        assert_eq!(f.part_offset(64, 5, 1), 8192 + 20);
        let p = f.pieces(64);
        assert_eq!(
            p,
            vec![
                Piece {
                    base: 0,
                    bytes: 128
                },
                Piece {
                    base: 8192,
                    bytes: 4
                }
            ]
        );
    }

    #[test]
    fn interleaved_rows_are_one_piece() {
        let kv = RowFormat::new(
            &[
                RowPart {
                    kind: PartKind::Values,
                    dtype: Dtype::Fp8E4m3,
                    count: 512,
                },
                RowPart {
                    kind: PartKind::Scales,
                    dtype: Dtype::F32,
                    count: 4,
                },
                RowPart {
                    kind: PartKind::Rope,
                    dtype: Dtype::Bf16,
                    count: 64,
                },
            ],
            PageLayout::Interleaved,
            656,
        )
        .unwrap();
        assert!(!kv.is_split());
        assert_eq!(
            kv.pieces(64),
            vec![Piece {
                base: 0,
                bytes: 656
            }]
        );
        assert_eq!(kv.part_offset(64, 2, 2), 2 * 656 + 512 + 16);
    }

    #[test]
    fn bad_formats_name_the_field() {
        let v = RowPart {
            kind: PartKind::Values,
            dtype: Dtype::Fp8E4m3,
            count: 128,
        };
        let field = |r: Result<RowFormat>| match r.unwrap_err() {
            Error::Config { field, .. } => field,
            e => panic!("{e:?}"),
        };
        assert_eq!(
            field(RowFormat::new(&[v], PageLayout::Interleaved, 132)),
            "row_parts"
        );
        assert_eq!(
            field(RowFormat::new(&[v, v], PageLayout::Interleaved, 256)),
            "row_parts[1].name"
        );
        assert_eq!(
            field(RowFormat::new(&[], PageLayout::Interleaved, 0)),
            "row_parts"
        );
        let zero = RowPart { count: 0, ..v };
        assert_eq!(
            field(RowFormat::new(&[zero], PageLayout::Interleaved, 0)),
            "row_parts[0].count"
        );
        assert!(PartKind::parse("name", "latent").is_err());
        assert!(PageLayout::parse("page_layout", "scales_first").is_err());
    }
}
