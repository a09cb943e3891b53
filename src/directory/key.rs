//! Object identity: (namespace, page, layer group). Identity is kept apart from location: an
//! object keeps its key when it moves between tiers.

use std::fmt;

/// The sequence or prefix an object belongs to, together with the model version that wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Namespace {
    /// Sequence or prefix id.
    pub id: u64,
    /// Model version: KV written by another version is another object.
    pub version: u32,
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@v{}", self.id, self.version)
    }
}

/// Which layers an object covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LayerGroup {
    /// Every layer (prefix tiering moves whole pages).
    All,
    /// One layer (per-layer sparse residency).
    Layer(u16),
}

impl LayerGroup {
    /// The wire encoding used by the bindings: -1 for all layers, else the layer.
    pub const fn code(self) -> i64 {
        match self {
            LayerGroup::All => -1,
            LayerGroup::Layer(l) => l as i64,
        }
    }
}

/// The unit the residency directory tracks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    /// Sequence or prefix, with model version.
    pub namespace: Namespace,
    /// Page index inside the namespace (a KV block of the sequence).
    pub page: u32,
    /// Layers covered.
    pub layers: LayerGroup,
}

impl ObjectKey {
    /// Key of `page` of sequence `id` (version `version`) in `layers`.
    pub const fn new(id: u64, version: u32, page: u32, layers: LayerGroup) -> Self {
        ObjectKey {
            namespace: Namespace { id, version },
            page,
            layers,
        }
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.layers {
            LayerGroup::All => write!(f, "({}, page {}, all layers)", self.namespace, self.page),
            LayerGroup::Layer(l) => {
                write!(f, "({}, page {}, layer {l})", self.namespace, self.page)
            }
        }
    }
}
