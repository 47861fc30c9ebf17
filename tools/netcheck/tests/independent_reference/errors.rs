//! Errors, never panics.

use super::*;

#[test]
pub(super) fn bad_input_gives_errors() {
    let c = case(net_b(), 2, 31);
    let call = |net: &RefNet, p: &Named, im: &[f64], lab: &[usize]| run(net, p, im, lab).err();

    let mut p = c.params.clone();
    p.remove("s1.b0.down.gamma");
    let e = call(&c.net, &p, &c.images, &c.labels).expect("missing parameter must fail");
    assert!(e.contains("s1.b0.down.gamma"), "{e}");
    assert!(loss(&c.net, &p, &c.images, &c.labels).is_err());

    let mut p = c.params.clone();
    p.get_mut("stem.w").unwrap().pop();
    let e = call(&c.net, &p, &c.images, &c.labels).expect("short parameter must fail");
    assert!(e.contains("stem.w"), "{e}");

    let e = call(&c.net, &c.params, &c.images[1..], &c.labels).expect("short images");
    assert!(e.contains("images"), "{e}");
    let e = call(&c.net, &c.params, &c.images, &[0, 5]).expect("label out of range");
    assert!(e.contains("label"), "{e}");
    assert!(call(&c.net, &c.params, &[], &[]).is_some());

    let mut net = c.net.clone();
    net.stages[1][0].in_ch = 8;
    let e = call(&net, &c.params, &c.images, &c.labels).expect("channel mismatch");
    assert!(e.contains("s1.b0"), "{e}");
    let mut net = c.net.clone();
    net.stages[1][0].projection = false;
    assert!(call(&net, &c.params, &c.images, &c.labels).is_some());
    let mut net = c.net.clone();
    net.stem.max_pool.as_mut().unwrap().pad = 3;
    assert!(call(&net, &c.params, &c.images, &c.labels).is_some());
    let mut net = c.net.clone();
    net.stem.stride = 0;
    assert!(call(&net, &c.params, &c.images, &c.labels).is_some());
    let mut net = c.net.clone();
    net.stem.kernel = 30;
    assert!(call(&net, &c.params, &c.images, &c.labels).is_some());

    // A single value per channel in training-mode BN (batch 1, 1×1 after the strides).
    let one = case(
        RefNet {
            hw: 1,
            stem: RefStem {
                out: 2,
                kernel: 1,
                stride: 1,
                pad: 0,
                max_pool: None,
            },
            stages: vec![],
            ..net_a()
        },
        1,
        32,
    );
    let e = one.run_err();
    assert!(e.contains("BatchNorm"), "{e}");
}

impl Case {
    fn run_err(&self) -> String {
        run(&self.net, &self.params, &self.images, &self.labels).expect_err("must fail")
    }
}

#[test]
pub(super) fn net_without_blocks_and_param_shapes() {
    let net = RefNet {
        stages: vec![],
        ..net_a()
    };
    let shapes = param_shapes(&net);
    let names: Vec<&str> = shapes.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "stem.w",
            "stem.gamma",
            "stem.beta",
            "stem.running_mean",
            "stem.running_var",
            "fc.w",
            "fc.b"
        ]
    );
    assert_eq!(shapes[0].1, vec![5, 3, 3, 3]);
    assert_eq!(shapes[5].1, vec![4, 5]);
    let c = case(net, 2, 41);
    let r = c.run();
    let hand = hand_forward(&c);
    assert_close("logits", &r.forward["logits"], &hand["logits"], 1e-10);
    let shapes_b = param_shapes(&net_b());
    let w = |n: &str| shapes_b.iter().find(|(m, _)| m == n).unwrap().1.clone();
    assert_eq!(w("stem.w"), vec![7, 5, 5, 3]);
    assert_eq!(w("s0.b0.conv1.w"), vec![3, 1, 1, 7]);
    assert_eq!(w("s1.b0.conv2.w"), vec![5, 3, 3, 5]);
    assert_eq!(w("s1.b0.conv3.w"), vec![9, 1, 1, 5]);
    assert_eq!(w("s1.b0.down.w"), vec![9, 1, 1, 7]);
    assert_eq!(w("fc.w"), vec![5, 9]);
}
