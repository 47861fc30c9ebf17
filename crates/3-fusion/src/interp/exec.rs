//! The node loop: bind and check every real tensor, read the inputs, run the nodes in the
//! graph's order, write each real output as it is produced.

use super::bn::{self, FinalizeIn};
use super::conv::Geometry;
use super::error::{InterpError, Result};
use super::memory::Access;
use super::pointwise;
use super::tensor::{round_to, Layout, Value};
use super::{Options, VariantPack};
use crate::exec::{Scalar, TENSOR_ALIGNMENT};
use crate::graph::{DataType, Graph, Node, TensorId};
use crate::lower::{real_tensor_layout, RealTensor};

/// A real tensor in memory, checked.
struct Placed {
    uid: i64,
    name: String,
    addr: u64,
    layout: Layout,
}

/// Runs `graph` over `mem` with the variant pack's addresses and scalars.
pub(super) fn run(
    graph: &Graph,
    pack: &VariantPack<'_>,
    mem: &mut dyn Access,
    opts: &Options,
) -> Result<()> {
    graph.validate()?;
    let n = graph.tensors().len();
    let mut produced = vec![false; n];
    for node in graph.nodes() {
        for t in node.outputs() {
            produced[t.index()] = true;
        }
    }
    let real = real_tensor_layout(graph);
    let mut values: Vec<Option<Value>> = vec![None; n];
    let mut placed: Vec<Option<Placed>> = (0..n).map(|_| None).collect();
    for r in &real {
        if r.by_value {
            values[r.id.index()] = Some(scalar_value(r, pack)?);
        } else {
            placed[r.id.index()] = Some(place(graph, r, pack, mem)?);
        }
    }
    check_overlaps(&placed, &produced)?;
    // Every input is read before anything is written.
    for (i, p) in placed.iter().enumerate() {
        let Some(p) = p.as_ref().filter(|_| !produced[i]) else {
            continue;
        };
        let bytes = read(mem, p)?;
        values[i] = Some(Value::new(p.layout.dims.clone(), p.layout.gather(&bytes)));
    }
    for (index, node) in graph.nodes().iter().enumerate() {
        let outputs = run_node(graph, index, node, &values, opts)?;
        for (t, mut data) in outputs {
            let dtype = graph.dtype(t).unwrap_or(DataType::Float);
            for v in &mut data {
                *v = round_to(dtype, *v);
            }
            let dims = dims_of(graph, t);
            // Each op sizes its result from its inputs; a graph whose declared output dims
            // disagree is refused here rather than indexed past later.
            if data.len() != dims.iter().product::<usize>() {
                return Err(super::error::node_err(
                    index,
                    node.kind(),
                    format!(
                        "computes {} values for `{}`, whose dims {dims:?} hold {}",
                        data.len(),
                        graph.tname(t),
                        dims.iter().product::<usize>()
                    ),
                ));
            }
            if let Some(p) = &placed[t.index()] {
                write(mem, p, &data)?;
            }
            values[t.index()] = Some(Value::new(dims, data));
        }
    }
    Ok(())
}

fn dims_of(graph: &Graph, t: TensorId) -> Vec<usize> {
    graph
        .get(t)
        .map(|a| a.dims.iter().map(|&d| d.max(0) as usize).collect())
        .unwrap_or_default()
}

fn scalar_value(r: &RealTensor, pack: &VariantPack<'_>) -> Result<Value> {
    let s = pack
        .scalars
        .iter()
        .find(|(u, _)| *u == r.uid)
        .map(|(_, s)| *s)
        .ok_or_else(|| InterpError::Unbound {
            uid: r.uid,
            name: r.name.clone(),
        })?;
    let (got, exact) = match s {
        Scalar::F32(v) => (DataType::Float, f64::from(v)),
        Scalar::F64(v) => (DataType::Double, v),
        Scalar::I64(v) => (DataType::Int64, v as f64),
    };
    if got != r.dtype {
        return Err(InterpError::ScalarType {
            uid: r.uid,
            name: r.name.clone(),
            got,
            expected: r.dtype,
        });
    }
    Ok(Value {
        dims: vec![1; 4],
        data: vec![exact as f32],
        exact: Some(exact),
    })
}

/// The checked placement of one real tensor: bound, non-null, aligned, inside one allocation.
fn place(
    graph: &Graph,
    r: &RealTensor,
    pack: &VariantPack<'_>,
    mem: &dyn Access,
) -> Result<Placed> {
    let (uid, name) = (r.uid, r.name.clone());
    let addr = pack
        .pointers
        .iter()
        .find(|(u, _)| *u == uid)
        .map(|(_, a)| *a)
        .ok_or_else(|| InterpError::Unbound {
            uid,
            name: name.clone(),
        })?;
    if addr == 0 {
        return Err(InterpError::Null { uid, name });
    }
    if addr % TENSOR_ALIGNMENT != 0 {
        return Err(InterpError::Misaligned {
            uid,
            name,
            addr,
            align: TENSOR_ALIGNMENT,
        });
    }
    let attrs = graph.get(r.id).ok_or_else(|| InterpError::Unbound {
        uid,
        name: name.clone(),
    })?;
    let strides = graph.strides(r.id).unwrap_or_default();
    let layout =
        Layout::new(&attrs.dims, &strides, r.dtype).map_err(|problem| InterpError::Layout {
            uid,
            name: name.clone(),
            problem,
        })?;
    let alloc = mem
        .map()
        .allocation(addr)
        .ok_or_else(|| InterpError::Unmapped {
            uid,
            name: name.clone(),
            addr,
        })?;
    if !alloc.contains(addr, layout.span) {
        return Err(InterpError::OutOfBounds {
            uid,
            name,
            addr,
            span: layout.span,
            base: alloc.base,
            len: alloc.len,
        });
    }
    Ok(Placed {
        uid,
        name,
        addr,
        layout,
    })
}

/// Outputs may not share memory with any other real tensor (their extents are disjoint).
fn check_overlaps(placed: &[Option<Placed>], produced: &[bool]) -> Result<()> {
    for (i, a) in placed.iter().enumerate() {
        let Some(a) = a.as_ref().filter(|_| produced[i]) else {
            continue;
        };
        for (j, b) in placed.iter().enumerate() {
            let Some(b) = b.as_ref().filter(|_| j != i) else {
                continue;
            };
            if a.addr < b.addr + b.layout.span && b.addr < a.addr + a.layout.span {
                return Err(InterpError::Overlap {
                    uid: a.uid,
                    name: a.name.clone(),
                    other_uid: b.uid,
                    other: b.name.clone(),
                });
            }
        }
    }
    Ok(())
}

fn unmapped(p: &Placed) -> InterpError {
    InterpError::Unmapped {
        uid: p.uid,
        name: p.name.clone(),
        addr: p.addr,
    }
}

fn read(mem: &dyn Access, p: &Placed) -> Result<Vec<u8>> {
    mem.read(p.addr, p.layout.span as usize)
        .ok_or_else(|| unmapped(p))
}

/// Stores `data` through the tensor's strides, keeping the bytes between its elements.
fn write(mem: &mut dyn Access, p: &Placed, data: &[f32]) -> Result<()> {
    let mut bytes = read(mem, p)?;
    p.layout.scatter(data, &mut bytes);
    if mem.write(p.addr, &bytes) {
        Ok(())
    } else {
        Err(unmapped(p))
    }
}

/// One node's outputs, unrounded, each with its tensor.
fn run_node(
    graph: &Graph,
    index: usize,
    node: &Node,
    values: &[Option<Value>],
    opts: &Options,
) -> Result<Vec<(TensorId, Vec<f32>)>> {
    let kind = node.kind();
    let id = (index, kind);
    let get = |t: TensorId| -> Result<&Value> {
        values
            .get(t.index())
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                super::error::node_err(
                    index,
                    kind,
                    format!(
                    "reads `{}` before any node produces it (nodes must be in topological order)",
                    graph.tname(t)
                ),
                )
            })
    };
    let dims4 = |what: &str, t: TensorId| -> Result<[usize; 4]> {
        let v = Value::new(dims_of(graph, t), vec![]);
        bn::dims4(id, what, &v)
    };
    // A conv's operands, rounded to the graph's I/O type when asked (FP16 tensor-core convs).
    let operand = |t: TensorId| -> Result<Vec<f32>> {
        let v = get(t)?;
        let io = graph.precision().io;
        Ok(if opts.round_conv_operands {
            v.data.iter().map(|&x| round_to(io, x)).collect()
        } else {
            v.data.clone()
        })
    };
    Ok(match node {
        Node::ConvFprop { x, w, y, attrs } => {
            let g = Geometry::new(id, dims4("x", *x)?, dims4("w", *w)?, dims4("y", *y)?, attrs)?;
            vec![(*y, g.fprop(&operand(*x)?, &operand(*w)?))]
        }
        Node::ConvDgrad { dy, w, dx, attrs } => {
            let g = Geometry::new(
                id,
                dims4("dx", *dx)?,
                dims4("w", *w)?,
                dims4("dy", *dy)?,
                attrs,
            )?;
            vec![(*dx, g.dgrad(&operand(*dy)?, &operand(*w)?))]
        }
        Node::ConvWgrad { x, dy, dw, attrs } => {
            let g = Geometry::new(
                id,
                dims4("x", *x)?,
                dims4("dw", *dw)?,
                dims4("dy", *dy)?,
                attrs,
            )?;
            vec![(*dw, g.wgrad(&operand(*x)?, &operand(*dy)?))]
        }
        Node::Pointwise { attrs, inputs, y } => {
            let ins = inputs.iter().map(|&t| get(t)).collect::<Result<Vec<_>>>()?;
            vec![(
                *y,
                pointwise::pointwise(id, attrs, &ins, &dims_of(graph, *y))?,
            )]
        }
        Node::Reduction { x, y, attrs } => {
            vec![(
                *y,
                pointwise::reduce(id, attrs.mode, get(*x)?, &dims_of(graph, *y))?,
            )]
        }
        Node::GenStats { x, sum, sq_sum } => {
            let (s, q) = bn::genstats(id, get(*x)?)?;
            vec![(*sum, s), (*sq_sum, q)]
        }
        Node::BnFinalize {
            inputs: i,
            outputs: o,
        } => {
            let sum = get(i.sum)?;
            let c = sum.data.len();
            let v =
                |what: &str, t: TensorId| -> Result<&[f32]> { bn::vector(id, what, get(t)?, c) };
            let f = bn::finalize(
                id,
                &FinalizeIn {
                    sum: v("sum", i.sum)?,
                    sq_sum: v("sq_sum", i.sq_sum)?,
                    gamma: v("scale", i.scale)?,
                    beta: v("bias", i.bias)?,
                    running_mean: v("prev_running_mean", i.prev_running_mean)?,
                    running_var: v("prev_running_var", i.prev_running_var)?,
                    eps: bn::scalar(id, "epsilon", get(i.epsilon)?)?,
                    factor: bn::scalar(id, "momentum", get(i.momentum)?)?,
                    count: bn::scalar(id, "accum_count", get(i.accum_count)?)?,
                },
            )?;
            vec![
                (o.eq_scale, f.eq_scale),
                (o.eq_bias, f.eq_bias),
                (o.saved_mean, f.mean),
                (o.saved_inv_std, f.inv_std),
                (o.updated_running_mean, f.running_mean),
                (o.updated_running_var, f.running_var),
            ]
        }
        Node::DbnWeight {
            inputs: i,
            outputs: o,
        } => {
            let [dg, db, a, b, c] = bn::dbn_weight(
                id,
                get(i.x)?,
                get(i.mean)?,
                get(i.inv_std)?,
                get(i.scale)?,
                get(i.dy)?,
            )?;
            vec![
                (o.dscale, dg),
                (o.dbias, db),
                (o.eq_dy_scale, a),
                (o.eq_x_scale, b),
                (o.eq_bias, c),
            ]
        }
        Node::BatchNorm {
            inputs: i,
            outputs: o,
        } => {
            let running = match (i.prev_running_mean, i.prev_running_var) {
                (Some(m), Some(v)) => Some((get(m)?, get(v)?)),
                _ => None,
            };
            let [y, mean, inv, rm, rv] = bn::norm_forward(
                id,
                get(i.x)?,
                get(i.scale)?,
                get(i.bias)?,
                bn::scalar(id, "epsilon", get(i.epsilon)?)?,
                bn::scalar(id, "momentum", get(i.momentum)?)?,
                running,
            )?;
            let mut out = vec![(o.y, y), (o.mean, mean), (o.inv_variance, inv)];
            out.extend(o.next_running_mean.map(|t| (t, rm)));
            out.extend(o.next_running_var.map(|t| (t, rv)));
            out
        }
        Node::BatchNormBackward {
            inputs: i,
            outputs: o,
        } => {
            let [dx, dg, db] = bn::norm_backward(
                id,
                get(i.dy)?,
                get(i.x)?,
                get(i.scale)?,
                get(i.mean)?,
                get(i.inv_variance)?,
            )?;
            vec![(o.dx, dx), (o.dscale, dg), (o.dbias, db)]
        }
    })
}
