//! The canonical signature plans are cached under.
//!
//! It covers structure (node kinds and wiring), shapes, strides, element types, virtual and
//! by-value flags, node attributes and the compute precision — but not names or unique ids, so
//! the same layer built twice, or by two layers with equal shapes, gets the same key.

use super::{Graph, TensorId};
use std::collections::HashMap;
use std::fmt::Write;
use std::hash::{Hash, Hasher};

/// A canonical description of a graph, with its hash precomputed so a cache lookup costs one
/// u64 hash plus one string comparison.
#[derive(Debug, Clone)]
pub struct GraphSignature {
    text: String,
    hash: u64,
}

impl GraphSignature {
    /// The canonical text (stable across processes and builds of this crate version).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// A 64-bit FNV-1a hash of the text (stable across processes; used in file names).
    pub fn hash64(&self) -> u64 {
        self.hash
    }

    pub(crate) fn from_text(text: String) -> Self {
        let hash = fnv1a(text.as_bytes());
        GraphSignature { text, hash }
    }
}

impl PartialEq for GraphSignature {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.text == other.text
    }
}

impl Eq for GraphSignature {}

impl Hash for GraphSignature {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// FNV-1a: tiny, deterministic, good enough for a cache key that is also compared in full.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

pub(crate) fn signature(g: &Graph) -> GraphSignature {
    let mut canon: HashMap<TensorId, usize> = HashMap::new();
    let mut text = format!("compute={};", g.precision().compute);
    for node in g.nodes() {
        let _ = write!(text, "{}[{}](", node.kind(), node.attr_signature());
        for (k, t) in node.inputs().into_iter().enumerate() {
            write_tensor(g, &mut canon, &mut text, if k == 0 { "" } else { "," }, t);
        }
        text.push_str(")->(");
        for (k, t) in node.outputs().into_iter().enumerate() {
            write_tensor(g, &mut canon, &mut text, if k == 0 { "" } else { "," }, t);
        }
        text.push_str(");");
    }
    GraphSignature::from_text(text)
}

fn write_tensor(
    g: &Graph,
    canon: &mut HashMap<TensorId, usize>,
    text: &mut String,
    sep: &str,
    t: TensorId,
) {
    let next = canon.len();
    let id = *canon.entry(t).or_insert(next);
    let a = &g.tensors()[t.index()];
    let _ = write!(
        text,
        "{sep}t{id}:{:?}/{:?}/{}{}{}",
        a.dims,
        g.strides(t).unwrap_or_default(),
        g.dtype(t).map(|d| d.name()).unwrap_or("?"),
        if a.is_virtual { "/v" } else { "" },
        if a.by_value { "/bv" } else { "" },
    );
}
