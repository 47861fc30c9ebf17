//! Finite differences.

use super::*;

/// Central differences with step h = 1e-6 in f64. The loss (≈ 1–2) is computed to
/// ~1e-15 absolute, so the rounding part of the difference quotient is about
/// 1e-15 / 2e-6 ≲ 1e-9 absolute (observed: ≤ 4e-10), and the truncation part is
/// O(h²·f‴) ~ 1e-12 relative. Hence |fd − autograd| ≤ 1e-6·max(|fd|, |autograd|) + 1e-8:
/// the absolute term covers the rounding floor with 25× margin for tiny entries (some are
/// exactly 0, e.g. a BN beta whose shift a following 1×1 conv + BN cancels), the relative
/// term leaves ≥ 5× margin on entries ≥ 1e-4 (observed worst ≈ 1.5e-7), while a real bug
/// (wrong stride/padding/transposition, a missing term) gives relative errors of order
/// one. Kinks (ReLU, max-pool switches) are not crossed for these fixed seeds:
/// pre-activations are O(1) and move by ~1e-6.
pub(super) fn check_fd(c: &Case, per_tensor: usize) {
    const STEP: f64 = 1e-6;
    const RTOL: f64 = 1e-6;
    const ATOL: f64 = 1e-8;
    let r = c.run();
    let mut rng = Rng(0xFD);
    // Largest fraction of the tolerance used by any entry.
    let mut worst = 0.0f64;
    let mut checked = 0;
    for (name, dims) in param_shapes(&c.net) {
        if name.ends_with(".running_mean") || name.ends_with(".running_var") {
            continue;
        }
        let len: usize = dims.iter().product();
        let g = &r.grads[&name];
        assert_eq!(g.len(), len, "{name}: gradient length");
        let max_abs = g.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        assert!(
            max_abs > 1e-4,
            "{name}: gradient is (nearly) zero everywhere"
        );
        let mut idx: Vec<usize> = if len <= per_tensor {
            (0..len).collect()
        } else {
            (0..per_tensor).map(|_| rng.below(len)).collect()
        };
        idx.sort_unstable();
        idx.dedup();
        for i in idx {
            let mut p = c.params.clone();
            p.get_mut(&name).unwrap()[i] += STEP;
            let lp = loss(&c.net, &p, &c.images, &c.labels).unwrap();
            p.get_mut(&name).unwrap()[i] -= 2.0 * STEP;
            let lm = loss(&c.net, &p, &c.images, &c.labels).unwrap();
            let fd = (lp - lm) / (2.0 * STEP);
            let an = g[i];
            let tol = RTOL * fd.abs().max(an.abs()) + ATOL;
            let err = (fd - an).abs();
            assert!(
                err <= tol,
                "{name}[{i}]: finite difference {fd:.12e} vs autograd {an:.12e}"
            );
            worst = worst.max(err / tol);
            checked += 1;
        }
    }
    eprintln!("finite differences: {checked} entries, worst error {worst:.3} of tolerance");
}

#[test]
pub(super) fn fd_stem_and_basic_projection_block() {
    let t = Instant::now();
    check_fd(&case(net_a(), 2, 1), 6);
    eprintln!("took {:?}", t.elapsed());
}

#[test]
pub(super) fn fd_maxpool_stem_and_bottleneck_blocks() {
    let t = Instant::now();
    check_fd(&case(net_b(), 3, 2), 6);
    eprintln!("took {:?}", t.elapsed());
}
