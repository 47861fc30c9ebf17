//! Every binding problem is caught before cuDNN sees a pointer (tier 2: the plan is built
//! deviceless; nothing executes).

mod common;

use cudnn_cbr::fusion::cbr::{graphs, ConvShape};
use cudnn_cbr::fusion::exec::{Bindings, Scalar};
use cudnn_cbr::fusion::graph::TensorId;
use cudnn_cbr::fusion::lower::OperationGraph;
use cudnn_cbr::fusion::plan::build_plan;
use cudnn_cbr::fusion::{BindingProblem, Error, Target};
use cudnn_cbr::runtime::DataType;

fn problem(e: Error) -> (String, BindingProblem) {
    match e {
        Error::Binding {
            tensor, problem, ..
        } => (tensor, problem),
        other => panic!("expected a binding error, got {other}"),
    }
}

#[test]
fn bad_bindings_are_rejected_with_the_tensor_named() {
    let Some(_) = common::cudnn_or_skip("bad_bindings_are_rejected_with_the_tensor_named") else {
        return;
    };
    let target = Target::deviceless_from_file(&common::devprops_fixtures()[0].1).unwrap();
    let shape = ConvShape::square(2, 16, 8, 16, 3, 1, 1);
    let (graph, t) = graphs::conv_fprop(&shape, false, false);
    let plan = build_plan(&OperationGraph::new(&graph).unwrap(), &target).unwrap();
    let x_bytes = (2 * 16 * 8 * 8) * 2;
    let w_bytes = (16 * 16 * 3 * 3) * 2;
    let y_bytes = x_bytes;
    let good = |b: &mut Bindings<'_>| {
        fake(b, t.x, 0x1000, x_bytes, DataType::Half);
        fake(b, t.w, 0x2000, w_bytes, DataType::Half);
        fake(b, t.y, 0x3000, y_bytes, DataType::Half);
    };
    let mut b = Bindings::new(&plan);
    good(&mut b);
    b.check().unwrap();

    let mut b = Bindings::new(&plan);
    fake(&mut b, t.x, 0x1000, x_bytes, DataType::Half);
    fake(&mut b, t.w, 0x2000, w_bytes, DataType::Half);
    assert_eq!(
        problem(b.check().unwrap_err()),
        ("conv_fprop#0.y".into(), BindingProblem::Missing)
    );

    let cases: Vec<(u64, usize, DataType, BindingProblem)> = vec![
        (0, y_bytes, DataType::Half, BindingProblem::Null),
        (
            0x3008,
            y_bytes,
            DataType::Half,
            BindingProblem::Misaligned {
                address: 0x3008,
                alignment: 16,
            },
        ),
        (
            0x3000,
            y_bytes - 2,
            DataType::Half,
            BindingProblem::TooSmall {
                needed: y_bytes,
                got: y_bytes - 2,
            },
        ),
        (
            0x3000,
            y_bytes * 2,
            DataType::Float,
            BindingProblem::WrongType {
                expected: DataType::Half,
                got: DataType::Float,
            },
        ),
    ];
    for (ptr, bytes, dtype, want) in cases {
        let mut b = Bindings::new(&plan);
        good(&mut b);
        fake(&mut b, t.y, ptr, bytes, dtype);
        let (tensor, got) = problem(b.check().unwrap_err());
        assert_eq!(got, want);
        assert_eq!(tensor, "conv_fprop#0.y");
    }
    // A host scalar bound to a device tensor.
    let mut b = Bindings::new(&plan);
    good(&mut b);
    let err = b.bind_scalar(t.x, Scalar::F32(1.0)).unwrap_err();
    assert!(matches!(problem(err).1, BindingProblem::WrongType { .. }));
}

#[test]
fn scalars_must_match_the_by_value_tensor() {
    let Some(_) = common::cudnn_or_skip("scalars_must_match_the_by_value_tensor") else {
        return;
    };
    let target = Target::deviceless_from_file(&common::devprops_fixtures()[0].1).unwrap();
    let (graph, i, _) = graphs::bn_finalize(16);
    let plan = build_plan(&OperationGraph::new(&graph).unwrap(), &target).unwrap();
    let mut b = Bindings::new(&plan);
    b.bind_scalar(i.epsilon, Scalar::F64(1e-5)).unwrap();
    b.bind_scalar(i.momentum, Scalar::F64(0.1)).unwrap();
    let (tensor, p) = problem(b.bind_scalar(i.accum_count, Scalar::F64(3.0)).unwrap_err());
    assert_eq!(tensor, "count");
    assert_eq!(
        p,
        BindingProblem::WrongType {
            expected: DataType::Int64,
            got: DataType::Double
        }
    );
    b.bind_scalar(i.accum_count, Scalar::I64(2048)).unwrap();
    // A device buffer on a by-value tensor is the wrong kind.
    fake(&mut b, i.epsilon, 0x1000, 8, DataType::Double);
    let (tensor, p) = problem(b.check().unwrap_err());
    assert!(tensor == "sum" || tensor == "epsilon", "{tensor}");
    assert!(matches!(
        p,
        BindingProblem::Missing | BindingProblem::WrongKind
    ));
}

/// Binds a made-up address: these bindings are only checked, never executed.
fn fake(b: &mut Bindings<'_>, t: TensorId, ptr: u64, bytes: usize, dtype: DataType) {
    // SAFETY: `Bindings::check` reads the slots only; nothing in these tests executes them.
    unsafe { b.bind_raw(t, ptr, bytes, dtype) }.unwrap();
}
