//! The typed names of a conv layer's parameters. A layer's weight and BN parameters are its
//! layer buffers of fusion's keys ([`k::W`], [`k::GAMMA`], [`k::BETA`]), named
//! `<layer>.<key>` in the compiled network and in the amp plan; their gradients are the
//! buffers [`k::DW`], [`k::DGAMMA`], [`k::DBETA`]. [`LayerParam`] holds which buffer is which
//! parameter's value or gradient and in which amp region each lives, so the plan builder, the
//! initial weights, the CUDA binding and the CPU backend's copies read it instead of spelling
//! suffixes.

use crate::amp::plan::Region;
use cudnn_cbr_fusion::cbr::keys as k;

/// One of a conv layer's parameters (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LayerParam {
    /// The conv weight (FP16 in A for the passes, its gradient FP16 in G16).
    Weight,
    /// BN's scale γ (FP32 in W, its gradient in G).
    Gamma,
    /// BN's shift β (FP32 in W, its gradient in G).
    Beta,
}

impl LayerParam {
    /// Every layer parameter, in the plan's order within a layer.
    pub(crate) const ALL: [LayerParam; 3] =
        [LayerParam::Weight, LayerParam::Gamma, LayerParam::Beta];

    /// The layer buffer that holds it, and its amp parameter's suffix.
    pub(crate) const fn key(self) -> &'static str {
        match self {
            LayerParam::Weight => k::W.name(),
            LayerParam::Gamma => k::GAMMA.name(),
            LayerParam::Beta => k::BETA.name(),
        }
    }

    /// The layer buffer of its gradient.
    pub(crate) const fn grad_key(self) -> &'static str {
        match self {
            LayerParam::Weight => k::DW.name(),
            LayerParam::Gamma => k::DGAMMA.name(),
            LayerParam::Beta => k::DBETA.name(),
        }
    }

    /// The amp region a pass reads it from: the weight's FP16 copy in A, the BN parameters in
    /// W.
    pub(crate) const fn region(self) -> Region {
        match self {
            LayerParam::Weight => Region::A,
            LayerParam::Gamma | LayerParam::Beta => Region::W,
        }
    }

    /// The amp region its gradient goes to: G16 for the weight, G for the BN parameters.
    pub(crate) const fn grad_region(self) -> Region {
        match self {
            LayerParam::Weight => Region::G16,
            LayerParam::Gamma | LayerParam::Beta => Region::G,
        }
    }

    /// `<layer>.<key>`: the parameter in the network and in the amp plan.
    pub(crate) fn name(self, layer: &str) -> String {
        format!("{layer}.{}", self.key())
    }

    /// `<layer>.<grad key>`: its gradient's network buffer.
    pub(crate) fn grad_name(self, layer: &str) -> String {
        format!("{layer}.{}", self.grad_key())
    }

    /// The parameter whose amp suffix is `key`.
    pub(crate) fn of_key(key: &str) -> Option<LayerParam> {
        Self::ALL.into_iter().find(|p| p.key() == key)
    }

    /// The amp parameter (`<layer>.<key>`) and region a network buffer name is bound to: a
    /// parameter's value or its gradient; `None` for any other buffer.
    pub(crate) fn slot_of_buffer(buffer: &str) -> Option<(String, Region)> {
        let (layer, suffix) = buffer.rsplit_once('.')?;
        Self::ALL.into_iter().find_map(|p| {
            if suffix == p.key() {
                Some((p.name(layer), p.region()))
            } else if suffix == p.grad_key() {
                Some((p.name(layer), p.grad_region()))
            } else {
                None
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each parameter's value and gradient buffers map to its one amp parameter, in the
    /// regions the amp step reads and writes; other buffers map to none.
    #[test]
    fn buffers_map_to_their_parameter_slots() {
        let cases = [
            ("s1.b0.conv1.w", Some(("s1.b0.conv1.w", Region::A))),
            ("s1.b0.conv1.dw", Some(("s1.b0.conv1.w", Region::G16))),
            ("stem.gamma", Some(("stem.gamma", Region::W))),
            ("stem.dgamma", Some(("stem.gamma", Region::G))),
            ("stem.beta", Some(("stem.beta", Region::W))),
            ("stem.dbeta", Some(("stem.beta", Region::G))),
            ("stem.y", None),
            ("stem.running_mean", None),
            ("w", None),
        ];
        for (buffer, want) in cases {
            let got = LayerParam::slot_of_buffer(buffer);
            assert_eq!(
                got.as_ref().map(|(n, r)| (n.as_str(), *r)),
                want,
                "{buffer}"
            );
        }
        assert_eq!(LayerParam::of_key("gamma"), Some(LayerParam::Gamma));
        assert_eq!(LayerParam::of_key("dgamma"), None);
    }
}
