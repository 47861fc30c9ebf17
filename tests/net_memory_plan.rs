//! A compiled network's buffers in the amp memory plan (tier 1: no GPU, no cuDNN): with
//! `memory_plan_with_buffers`, every buffer but the input, the output and its gradient has a
//! slot (parameters in the regions, the rest in the tensor arena), slots hold their buffers
//! and never overlap, and the parameters' layout is the same as without the arena.

use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::net::cuda::{placement, Placement};
use cudnn_cbr::net::{memory_plan_with_buffers, BufferRole};
use cudnn_cbr::{compile, memory_plan, Preset, RoutePolicy};

#[test]
fn every_buffer_but_the_head_facing_ones_has_a_slot_in_the_amp_plan() {
    for preset in [Preset::Mini, Preset::ResNet18, Preset::ResNet50] {
        for route in [RouteKind::Fused, RouteKind::Unfused] {
            let net = compile(&preset.spec(3, 10, 8), 2, 32, &RoutePolicy::Uniform(route)).unwrap();
            let with = memory_plan_with_buffers(&net, 10).unwrap();
            let params_only = memory_plan(&net, 10).unwrap();
            let what = format!("{} {route:?}", preset.name());

            // The arena does not move a parameter.
            assert_eq!(with.total_bytes(), params_only.total_bytes(), "{what}");
            for p in params_only.params() {
                for r in [Region::W, Region::A, Region::G] {
                    assert_eq!(
                        with.view(p.name(), r).unwrap().offset_bytes,
                        params_only.view(p.name(), r).unwrap().offset_bytes,
                        "{what}: {}",
                        p.name()
                    );
                }
            }

            let placed = placement(&net, Some(&with)).unwrap();
            let mut arena: Vec<(usize, usize, &str)> = Vec::new();
            for (id, (b, p)) in net.buffers.iter().zip(&placed).enumerate() {
                let bytes = b.elems * b.dtype.size();
                let head_facing = [net.input, net.output, net.output_grad].contains(&id);
                match *p {
                    Placement::Own => assert!(head_facing, "{what}: `{}` is not placed", b.name),
                    Placement::Region { bytes: got, .. } => {
                        assert!(matches!(b.role, BufferRole::Param | BufferRole::ParamGrad));
                        assert_eq!(got, bytes, "{what}: `{}`", b.name);
                    }
                    Placement::Tensors { offset, bytes: got } => {
                        assert!(!head_facing, "{what}: `{}`", b.name);
                        assert_eq!(got, bytes, "{what}: `{}`", b.name);
                        assert_eq!(offset % 256, 0, "{what}: `{}`", b.name);
                        arena.push((offset, got, &b.name));
                    }
                }
            }
            // Slots are disjoint and inside the arena, which wastes only the alignment.
            arena.sort();
            for w in arena.windows(2) {
                assert!(
                    w[0].0 + w[0].1 <= w[1].0,
                    "{what}: {:?} overlaps {:?}",
                    w[0],
                    w[1]
                );
            }
            let used: usize = arena.iter().map(|a| a.1).sum();
            let end = arena.last().map_or(0, |a| a.0 + a.1);
            assert!(end <= with.tensor_bytes(), "{what}");
            assert!(
                with.tensor_bytes() < used + 256 * (arena.len() + 1),
                "{what}"
            );
            // Without the arena, only the parameters are slots.
            let own = placement(&net, Some(&params_only))
                .unwrap()
                .iter()
                .filter(|p| **p == Placement::Own)
                .count();
            let non_params = net
                .buffers
                .iter()
                .filter(|b| !matches!(b.role, BufferRole::Param | BufferRole::ParamGrad))
                .count();
            assert_eq!(own, non_params, "{what}");
        }
    }
}

#[test]
fn tensor_registration_errors_are_typed() {
    use cudnn_cbr::amp::plan::{DataType, MemoryPlanBuilder, ParamKind};
    use cudnn_cbr::amp::PlanError;
    let mut b = MemoryPlanBuilder::new();
    let bucket = b.bucket("all").unwrap();
    b.add("conv.w", ParamKind::ConvWeight, &[4, 3, 3, 4], bucket)
        .unwrap();
    assert!(matches!(
        b.add_tensor("conv.w", DataType::Half, 8),
        Err(PlanError::DuplicateName { .. })
    ));
    assert!(matches!(
        b.add_tensor("x", DataType::Half, 0),
        Err(PlanError::ZeroDim { .. })
    ));
    assert!(matches!(
        b.add_tensor("", DataType::Float, 1),
        Err(PlanError::EmptyName { .. })
    ));
    assert!(matches!(
        b.add_tensor("huge", DataType::Float, usize::MAX / 2),
        Err(PlanError::SizeOverflow { .. })
    ));
    b.add_tensor("a", DataType::Half, 3).unwrap();
    b.add_tensor("b", DataType::Float, 100).unwrap();
    let plan = b.finalize().unwrap();
    assert_eq!(plan.tensor("a").unwrap().offset_bytes(), 0);
    assert_eq!(plan.tensor("b").unwrap().offset_bytes(), 256);
    assert_eq!(plan.tensor_bytes(), 256 + 512);
    assert!(matches!(
        b.add_tensor("late", DataType::Half, 1),
        Err(PlanError::RegisterAfterFinalize { .. })
    ));
}
