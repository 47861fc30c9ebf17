//! A compiled network's buffers in the amp memory plan (tier 1: no GPU, no cuDNN): with
//! `memory_plan_with_buffers`, every buffer but the input, the output and its gradient and the
//! running statistics has a slot (parameters in the regions, the rest in the tensor arena),
//! slots hold their buffers, two slots share bytes only when no step of the pass binds both
//! (checked here from the compiled steps themselves, not from the plan's lifetimes), and the
//! parameters' layout is the same as without the arena.

use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::net::cuda::{placement, Placement};
use cudnn_cbr::net::liveness::step_buffers;
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
    use cudnn_cbr::sys::DataType;
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
