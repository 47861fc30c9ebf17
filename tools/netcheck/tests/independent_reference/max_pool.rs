//! Max-pool op.

use super::*;

#[test]
pub(super) fn max_pool_tie_rule_and_negative_infinity_padding() {
    let dev = Device::Cpu;
    // One 4×4 plane, 3×3 / 2 / pad 1 → 2×2 windows:
    // (0,0): rows 0–1, cols 0–1   (1,0): rows 1–3, cols 0–1
    // (0,1): rows 0–1, cols 1–3   (1,1): rows 1–3, cols 1–3
    #[rustfmt::skip]
    let x = vec![
        0.0, 0.0, 2.0, 2.0,
        0.0, 0.0, 1.0, 2.0,
        5.0, 0.0, 0.0, 0.0,
        5.0, 0.0, 0.0, 0.0,
    ];
    let xv = Var::from_vec(x, (1, 1, 4, 4), &dev).unwrap();
    let pool = RefPool {
        kernel: 3,
        stride: 2,
        pad: 1,
    };
    let y = max_pool2d(xv.as_tensor(), &pool).unwrap();
    assert_eq!(
        y.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
        vec![0.0, 2.0, 5.0, 2.0]
    );
    let wts = Tensor::from_vec(vec![1.0, 10.0, 100.0, 1000.0], (1, 1, 2, 2), &dev).unwrap();
    let grads = (y * wts).unwrap().sum_all().unwrap().backward().unwrap();
    let dx = grads
        .get(xv.as_tensor())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    // (0,0): all zeros → first element (0,0). (0,1): 2.0 at (0,2) before (0,3) and (1,3).
    // (1,0): 5.0 at (2,0) before (3,0). (1,1): 2.0 at (1,3) is the only 2 in rows 1–3.
    #[rustfmt::skip]
    let want = vec![
        1.0, 0.0, 10.0, 0.0,
        0.0, 0.0, 0.0, 1000.0,
        100.0, 0.0, 0.0, 0.0,
        0.0, 0.0, 0.0, 0.0,
    ];
    assert_eq!(dx, want);

    // Padding never wins: all-negative input keeps negative maxima.
    let neg = Tensor::from_vec(vec![-3.0, -2.0, -4.0, -1.0], (1, 1, 2, 2), &dev).unwrap();
    let y = max_pool2d(&neg, &pool).unwrap();
    assert_eq!(
        y.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
        vec![-1.0]
    );
}
