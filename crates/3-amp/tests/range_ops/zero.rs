//! Zero.

use super::*;

#[test]
pub(super) fn zeroing_writes_positive_zero_everywhere() {
    let mut b = vec![0xabu8; 77];
    zero_bytes(&mut b);
    assert!(b.iter().all(|&x| x == 0));
    let mut f = vec![-3.5f32, f32::NAN, -0.0];
    zero_f32(&mut f);
    assert!(f.iter().all(|x| x.to_bits() == 0));
    let mut h = vec![f16::NEG_INFINITY, f16::from_f32(-0.0)];
    zero_f16(&mut h);
    assert!(h.iter().all(|x| x.to_bits() == 0));
}
