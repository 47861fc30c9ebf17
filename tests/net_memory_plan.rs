//! A compiled network's buffers in the amp memory plan (tier 1: no GPU, no cuDNN): with
//! `memory_plan_with_buffers`, every buffer but the input, the output and its gradient and the
//! running statistics has a slot (parameters in the regions, the rest in the tensor arena),
//! slots hold their buffers, two slots share bytes only when no step of the pass binds both
//! (checked here from the compiled steps themselves, not from the plan's lifetimes), and the
//! parameters' layout is the same as without the arena; and every route mix of the main job's
//! network binds every buffer (`net::binding_plan`).

use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::net::liveness::step_buffers;
use cudnn_cbr::net::{binding_plan, check_binding, placement, Placement, Source};
use cudnn_cbr::net::{memory_plan_with_buffers, BufId, BufferRole, Step};
use cudnn_cbr::{net::compile, net::memory_plan, net::Preset, net::RoutePolicy};

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
                    Placement::Own => assert!(
                        head_facing || b.role == BufferRole::Running,
                        "{what}: `{}` is not placed",
                        b.name
                    ),
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
            // Every slot is inside the arena.
            let end = arena.iter().map(|a| a.0 + a.1).max().unwrap_or(0);
            assert!(end <= with.tensor_bytes(), "{what}");
            // Two slots that share a byte are never both alive: positions in step order
            // (forward, the head, backward), each buffer's first and last binding step,
            // recomputed here from the steps.
            let mut seen: Vec<Option<(usize, usize)>> = vec![None; net.buffers.len()];
            let steps = net.forward.iter().chain(&net.backward);
            for (at, step) in steps.enumerate() {
                let at = if at < net.forward.len() { at } else { at + 1 };
                for id in step_buffers(&net, step).unwrap() {
                    let s = &mut seen[id];
                    *s = Some(s.map_or((at, at), |(f, _)| (f, at)));
                }
            }
            let ids: Vec<usize> = (0..net.buffers.len())
                .filter(|&id| matches!(placed[id], Placement::Tensors { .. }))
                .collect();
            let range = |id: usize| match placed[id] {
                Placement::Tensors { offset, bytes } => offset..offset + bytes,
                _ => unreachable!(),
            };
            let mut shared = 0;
            for (i, &a) in ids.iter().enumerate() {
                for &b in &ids[i + 1..] {
                    let (ra, rb) = (range(a), range(b));
                    if ra.start < rb.end && rb.start < ra.end {
                        let (fa, la) = seen[a].unwrap();
                        let (fb, lb) = seen[b].unwrap();
                        assert!(
                            la < fb || lb < fa,
                            "{what}: `{}` and `{}` share bytes while both are alive",
                            net.buffers[a].name,
                            net.buffers[b].name
                        );
                        shared += 1;
                    }
                }
            }
            // And sharing happens: the arena is well under one slot each.
            let used: usize = arena.iter().map(|a| a.1).sum();
            assert!(shared > 0, "{what}");
            assert!(with.tensor_bytes() * 10 < used * 7, "{what}");
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
    use cudnn_cbr::amp::plan::{MemoryPlanBuilder, ParamKind};
    use cudnn_cbr::amp::PlanError;
    use cudnn_cbr::runtime::DataType;
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
    let backwards = cudnn_cbr::amp::plan::Lifetime::Span { first: 4, last: 2 };
    assert!(matches!(
        b.add_tensor_live("span", DataType::Half, 8, backwards),
        Err(PlanError::Invariant { .. })
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

/// The binding plan of every route mix of the main job's network (the trainer's default:
/// `Preset::Mini` with 8 input channels, 8 classes and width 16 on 16×16 images; batch 16
/// here), each block's first and last convs on each route (so pairs are prologues or
/// materialized), against the real memory plan: every parameter and parameter gradient has an
/// amp slot of its type with room, every other buffer is allocated, and the buffers the
/// executor reaches outside the layers (input, output and its gradient, the joins' operands)
/// are allocations of equal size where they are added together. No device involved.
#[test]
fn every_route_mix_binds_every_buffer() {
    let (batch, hw, channels, classes, width) = (16, 16, 8, 8, 16);
    let spec = Preset::Mini.spec(channels, classes, width);
    let kinds = [RouteKind::Fused, RouteKind::Unfused, RouteKind::Generic];
    let mut mixes = 0;
    for first in kinds {
        for last in kinds {
            let shapes = compile(&spec, batch, hw, &RoutePolicy::Uniform(RouteKind::Fused))
                .unwrap()
                .conv_shapes();
            let routes = shapes
                .iter()
                .map(|(n, _)| (n.clone(), if n.ends_with("conv1") { first } else { last }))
                .collect();
            let policy = RoutePolicy::PerLayer {
                routes,
                default: RouteKind::Fused,
            };
            let net = compile(&spec, batch, hw, &policy).unwrap();
            let plan = memory_plan(&net, classes).unwrap();
            let sources = binding_plan(&net, true).unwrap();
            for (b, source) in net.buffers.iter().zip(&sources) {
                let (bytes, dtype) = match source {
                    Source::Param { key, region } => {
                        let v = plan
                            .view(key, *region)
                            .unwrap_or_else(|e| panic!("{first:?}/{last:?} {}: {e}", b.name));
                        (v.len_bytes, v.dtype)
                    }
                    Source::Own => (b.elems * b.dtype.size(), b.dtype),
                };
                check_binding(b, bytes, dtype)
                    .unwrap_or_else(|e| panic!("{first:?}/{last:?}: {e}"));
            }
            let own_bytes = |id: BufId| {
                assert_eq!(sources[id], Source::Own, "{}", net.buffers[id].name);
                net.buffers[id].elems * 2
            };
            let image = batch * hw * hw * channels * 2;
            assert_eq!(own_bytes(net.input), image);
            let pooled = batch * net.out_hw * net.out_hw * net.features * 2;
            assert_eq!(
                (own_bytes(net.output), own_bytes(net.output_grad)),
                (pooled, pooled)
            );
            let mut joins = 0;
            for step in &net.backward {
                if let Step::Add { a, b, out } = *step {
                    let sizes = (own_bytes(out), own_bytes(a), own_bytes(b));
                    assert!(sizes.0 == sizes.1 && sizes.1 == sizes.2, "{sizes:?}");
                    joins += 1;
                }
            }
            assert_eq!(joins, 2, "one join per block");
            mixes += 1;
        }
    }
    assert_eq!(mixes, 9);
}
