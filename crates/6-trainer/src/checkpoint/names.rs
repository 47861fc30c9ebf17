//! Tensor names and layouts: torchvision's names for ours, the conv weights' KRSC ↔ OIHW
//! transposes, and the per-tensor checksum.

use crate::{FNV_OFFSET, FNV_PRIME};

/// FNV-1a 64 of `bytes` (the per-tensor checksum in the `checksums` metadata field).
pub fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(FNV_OFFSET, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(FNV_PRIME)
    })
}

/// Torchvision's name for one of our parameters or running statistics (`stem.w` →
/// `conv1.weight`, `s1.b0.down.gamma` → `layer2.0.downsample.1.weight`, `fc.b` → `fc.bias`);
/// `None` for a name that is not one.
pub fn torch_name(ours: &str) -> Option<String> {
    match ours {
        "fc.w" => return Some("fc.weight".into()),
        "fc.b" => return Some("fc.bias".into()),
        _ => {}
    }
    let (layer, field) = ours.rsplit_once('.')?;
    let (conv, bn) = if layer == "stem" {
        ("conv1".to_string(), "bn1".to_string())
    } else {
        let mut it = layer.split('.');
        let stage: usize = it.next()?.strip_prefix('s')?.parse().ok()?;
        let block: usize = it.next()?.strip_prefix('b')?.parse().ok()?;
        let role = it.next()?;
        if it.next().is_some() {
            return None;
        }
        let base = format!("layer{}.{block}", stage.checked_add(1)?);
        match role {
            "down" => (
                format!("{base}.downsample.0"),
                format!("{base}.downsample.1"),
            ),
            r => {
                let n = r.strip_prefix("conv")?;
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                (format!("{base}.conv{n}"), format!("{base}.bn{n}"))
            }
        }
    };
    Some(match field {
        "w" => format!("{conv}.weight"),
        "gamma" => format!("{bn}.weight"),
        "beta" => format!("{bn}.bias"),
        "running_mean" | "running_var" => format!("{bn}.{field}"),
        _ => return None,
    })
}

/// KRSC (`[k, r, s, c]`) → OIHW (`[k, c, r, s]`).
pub fn krsc_to_oihw(v: &[f32], shape: [usize; 4]) -> Vec<f32> {
    let [k, r, s, c] = shape;
    let mut out = vec![0.0; v.len()];
    for ki in 0..k {
        for ri in 0..r {
            for si in 0..s {
                for ci in 0..c {
                    out[((ki * c + ci) * r + ri) * s + si] = v[((ki * r + ri) * s + si) * c + ci];
                }
            }
        }
    }
    out
}

/// OIHW (`[k, c, r, s]`) → KRSC (`[k, r, s, c]`); `shape` is the KRSC shape.
pub fn oihw_to_krsc(v: &[f32], shape: [usize; 4]) -> Vec<f32> {
    let [k, r, s, c] = shape;
    let mut out = vec![0.0; v.len()];
    for ki in 0..k {
        for ri in 0..r {
            for si in 0..s {
                for ci in 0..c {
                    out[((ki * r + ri) * s + si) * c + ci] = v[((ki * c + ci) * r + ri) * s + si];
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_torchvisions() {
        for (ours, theirs) in [
            ("stem.w", "conv1.weight"),
            ("stem.gamma", "bn1.weight"),
            ("stem.beta", "bn1.bias"),
            ("stem.running_mean", "bn1.running_mean"),
            ("s0.b0.conv1.w", "layer1.0.conv1.weight"),
            ("s0.b1.conv2.gamma", "layer1.1.bn2.weight"),
            ("s3.b2.conv3.running_var", "layer4.2.bn3.running_var"),
            ("s1.b0.down.w", "layer2.0.downsample.0.weight"),
            ("s1.b0.down.beta", "layer2.0.downsample.1.bias"),
            ("fc.w", "fc.weight"),
            ("fc.b", "fc.bias"),
        ] {
            assert_eq!(torch_name(ours).as_deref(), Some(theirs), "{ours}");
        }
        for bad in [
            "stem",
            "s0.b0.conv1.x",
            "s0.conv1.w",
            "sx.b0.conv1.w",
            "s0.b0.convx.w",
        ] {
            assert_eq!(torch_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn conv_weights_round_trip_through_oihw() {
        let shape = [3, 2, 5, 4];
        let v: Vec<f32> = (0..3 * 2 * 5 * 4).map(|i| i as f32).collect();
        let o = krsc_to_oihw(&v, shape);
        // Element (k=2, r=1, s=3, c=1): KRSC index ((2·2+1)·5+3)·4+1 = 113; OIHW index
        // ((2·4+1)·2+1)·5+3 = 98.
        assert_eq!(o[98], v[113]);
        assert_ne!(o, v);
        assert_eq!(oihw_to_krsc(&o, shape), v);
    }

    #[test]
    fn checksums_see_every_byte() {
        let a = checksum(b"abcd");
        assert_ne!(a, checksum(b"abce"));
        assert_ne!(a, checksum(b"abc"));
        assert_eq!(checksum(b""), FNV_OFFSET);
    }
}
