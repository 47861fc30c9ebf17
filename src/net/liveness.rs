//! When each buffer of a compiled network holds a value the training step needs: the
//! lifetimes that let buffers share arena space ([`crate::amp::plan::Lifetime`], laid out by
//! the amp plan's tensor arena and by the CPU executor's shared arena).
//!
//! Positions number the step's order: the forward steps, then the head (it reads
//! [`CompiledNet::output`] and writes [`CompiledNet::output_grad`]), then the backward steps.
//! A buffer lives from the first step that binds it to the last (a layer step binds the
//! buffers of its graphs for that pass, this layer's and its prologue layer's; an add or a
//! pool its operands). Granularity is the step: every buffer a step binds is alive during all
//! of it, so a step's inputs never share bytes with its outputs.
//!
//! Whole-step lifetimes (bytes of their own): the input, the output and its gradient (the
//! caller's and the head's, read between passes), parameters and their gradients (the amp
//! regions' in a trainer), running statistics (kept from step to step), and any buffer no step
//! binds. Evaluation mode runs the forward steps, binding the same buffers (a pass's steps are
//! its graphs, [`cudnn_cbr_fusion::cbr::Pass::Eval`] takes the forward ones), so a layout safe
//! for training is safe for it.

use super::compile::{BufId, BufferRole, CompiledNet, Step};
use crate::amp::plan::Lifetime;
use cudnn_cbr_fusion::cbr::{Pass, Src};
use cudnn_cbr_fusion::{Error, Result};

/// Each buffer's lifetime (by [`BufId`]) over one training step of `net`.
///
/// # Errors
/// [`Error::Buffer`] when a layer's graph binds a name its table (or its prologue layer's)
/// lacks: a compiler defect, named rather than guessed around.
pub fn lifetimes(net: &CompiledNet) -> Result<Vec<Lifetime>> {
    let mut span: Vec<Option<(u32, u32)>> = vec![None; net.buffers.len()];
    let mut see = |id: BufId, at: u32| {
        let s = &mut span[id];
        *s = Some(s.map_or((at, at), |(f, _)| (f, at)));
    };
    let head = net.forward.len() as u32;
    for (i, step) in net.forward.iter().enumerate() {
        for id in step_buffers(net, step)? {
            see(id, i as u32);
        }
    }
    see(net.output, head);
    see(net.output_grad, head);
    for (i, step) in net.backward.iter().enumerate() {
        for id in step_buffers(net, step)? {
            see(id, head + 1 + i as u32);
        }
    }
    let pinned = [net.input, net.output, net.output_grad];
    Ok(net
        .buffers
        .iter()
        .enumerate()
        .map(|(id, b)| {
            let whole = pinned.contains(&id)
                || matches!(
                    b.role,
                    BufferRole::Input
                        | BufferRole::Param
                        | BufferRole::ParamGrad
                        | BufferRole::Running
                );
            match span[id] {
                Some((first, last)) if !whole => Lifetime::Span { first, last },
                _ => Lifetime::Whole,
            }
        })
        .collect())
}

/// The buffers one step binds (with repeats).
pub fn step_buffers(net: &CompiledNet, step: &Step) -> Result<Vec<BufId>> {
    Ok(match *step {
        Step::Layer { layer, pass } => layer_pass_buffers(net, layer, pass)?,
        Step::Add { a, b, out } => vec![a, b, out],
        Step::MaxPool { input, output, .. } => vec![input, output],
        Step::MaxPoolBackward {
            input,
            grad_output,
            grad_input,
            ..
        } => vec![input, grad_output, grad_input],
    })
}

/// The buffers a layer's graphs for `pass` bind: this layer's and its prologue layer's.
fn layer_pass_buffers(net: &CompiledNet, layer: usize, pass: Pass) -> Result<Vec<BufId>> {
    let l = &net.layers[layer];
    let backward = pass == Pass::Backward;
    let mut out = Vec::new();
    for step in l.layer.steps() {
        if step.role.is_backward() != backward {
            continue;
        }
        for (_, src) in &step.bindings {
            let (table, name, side) = match *src {
                Src::This(n) => (Some(&l.table), n, ""),
                Src::Prev(n) => (l.prev.map(|p| &net.layers[p].table), n, "prev."),
                Src::Scalar(_) => continue,
            };
            let id = table
                .and_then(|t| t.get(name).copied())
                .ok_or_else(|| Error::Buffer {
                    name: format!("{}: {side}{name}", l.name),
                    problem: format!("is bound by its {:?} graph but not in its table", step.role),
                })?;
            out.push(id);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::{compile, Preset, RoutePolicy};
    use cudnn_cbr_fusion::cbr::RouteKind;

    #[test]
    fn activations_live_from_their_write_to_their_last_read_and_the_rest_whole() {
        for kind in [RouteKind::Fused, RouteKind::Unfused, RouteKind::Generic] {
            let net = compile(
                &Preset::Mini.spec(3, 10, 8),
                2,
                16,
                &RoutePolicy::Uniform(kind),
            )
            .unwrap();
            let live = lifetimes(&net).unwrap();
            let head = net.forward.len() as u32;
            for (b, l) in net.buffers.iter().zip(&live) {
                match (b.role, l) {
                    (BufferRole::Running | BufferRole::Param | BufferRole::ParamGrad, _) => {
                        assert_eq!(*l, Lifetime::Whole, "{}", b.name)
                    }
                    // Activations are written in the forward pass.
                    (BufferRole::Activation, Lifetime::Span { first, .. }) => {
                        assert!(*first < head, "{}: {l:?}", b.name)
                    }
                    // Gradients exist only in the backward pass.
                    (BufferRole::Gradient, Lifetime::Span { first, .. }) => {
                        assert!(*first > head, "{}: {l:?}", b.name)
                    }
                    _ => {}
                }
            }
            assert_eq!(live[net.input], Lifetime::Whole);
            assert_eq!(live[net.output], Lifetime::Whole);
            // A block output (stored for its block's backward) lives across the head.
            let out = net.buffer_id("s0.b0.out").unwrap();
            assert!(
                matches!(live[out], Lifetime::Span { first, last } if first < head && last > head),
                "{:?}",
                live[out]
            );
            // Every per-step buffer but the head-facing ones is bound by some step: none falls
            // back to a whole-step lifetime.
            for (id, b) in net.buffers.iter().enumerate() {
                let per_step = matches!(
                    b.role,
                    BufferRole::Activation | BufferRole::Gradient | BufferRole::Scratch
                );
                if per_step && ![net.input, net.output, net.output_grad].contains(&id) {
                    assert_ne!(live[id], Lifetime::Whole, "{kind:?}: {}", b.name);
                }
            }
        }
    }
}
