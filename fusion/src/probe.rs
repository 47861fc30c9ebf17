//! A deviceless end-to-end probe: build the forward conv + GenStats graph straight from
//! descriptors, run heuristics and finalize a plan for a device-properties document.
//!
//! It proves that cuDNN works on the machine (library, sub-libraries, device-properties JSON,
//! heuristics, plan finalize) without a GPU; the `deviceless_smoke` example and test call it.

use crate::backend::{self, Descriptor, HeurMode, PlanSite};
use crate::error::{Error, Result};
use crate::target::DeviceProps;
use cudnn_fe_sys as sys;
use std::time::Instant;
use sys::cudnnBackendAttributeName_t as A;
use sys::cudnnBackendDescriptorType_t as K;
use sys::cudnnDataType_t as D;

/// The layer shape of the probe (NHWC activations, KRSC filter, square padding and stride).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvShape {
    /// Batch.
    pub n: i64,
    /// Input channels.
    pub c: i64,
    /// Input height.
    pub h: i64,
    /// Input width.
    pub w: i64,
    /// Output channels.
    pub k: i64,
    /// Filter height.
    pub r: i64,
    /// Filter width.
    pub s: i64,
    /// Padding (both sides, both dims).
    pub pad: i64,
    /// Stride (both dims).
    pub stride: i64,
}

impl ConvShape {
    /// The project's reference layer: N=32, C=K=64, 56×56, 3×3, pad 1, stride 1.
    pub const RESNET_3X3: ConvShape = ConvShape {
        n: 32,
        c: 64,
        h: 56,
        w: 56,
        k: 64,
        r: 3,
        s: 3,
        pad: 1,
        stride: 1,
    };

    /// Output height.
    pub fn p(&self) -> i64 {
        (self.h + 2 * self.pad - self.r) / self.stride + 1
    }

    /// Output width.
    pub fn q(&self) -> i64 {
        (self.w + 2 * self.pad - self.s) / self.stride + 1
    }
}

/// What the probe saw.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeReport {
    /// The device the plan was built for.
    pub device: String,
    /// Engine configs heuristics mode A reported.
    pub reported: usize,
    /// Engine configs that passed cuDNN's support checks.
    pub usable: usize,
    /// Index (in heuristics order) of the config whose plan finalized first.
    pub chosen: usize,
    /// The engine's global index (meaningful within the pattern only).
    pub engine_index: i64,
    /// The pattern cuDNN matched (`finalizeMode` in the plan JSON), when present.
    pub pattern: Option<String>,
    /// Workspace bytes of the chosen plan.
    pub workspace: usize,
    /// Wall time from the first descriptor to the finalized plan, in milliseconds.
    pub build_ms: f64,
}

/// NHWC-packed strides for dims given in N,C,H,W order.
fn nhwc_strides(dims: [i64; 4]) -> [i64; 4] {
    let [_, c, h, w] = dims;
    [c * h * w, 1, w * c, c]
}

fn tensor(uid: i64, dtype: D, dims: [i64; 4]) -> Result<Descriptor> {
    let mut t = Descriptor::new(K::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    t.set_one(A::CUDNN_ATTR_TENSOR_DATA_TYPE, dtype)?
        .set(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &dims)?
        .set(A::CUDNN_ATTR_TENSOR_STRIDES, &nhwc_strides(dims))?
        .set_one(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, uid)?
        .set_one(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16i64)?;
    t.finalize()?;
    Ok(t)
}

/// Builds conv fprop + GenStats (FP16 NHWC in/out, FP32 stats) for `shape` and plans it for
/// `props`, deviceless.
pub fn conv_genstats(props: &DeviceProps, shape: ConvShape) -> Result<ProbeReport> {
    let start = Instant::now();
    let devprop = backend::device_prop_descriptor(props)?;
    let ConvShape {
        n,
        c,
        h,
        w,
        k,
        r,
        s,
        ..
    } = shape;
    let x = tensor(1, D::CUDNN_DATA_HALF, [n, c, h, w])?;
    let wt = tensor(2, D::CUDNN_DATA_HALF, [k, c, r, s])?;
    let y = tensor(3, D::CUDNN_DATA_HALF, [n, k, shape.p(), shape.q()])?;
    let sum = tensor(6, D::CUDNN_DATA_FLOAT, [1, k, 1, 1])?;
    let sqsum = tensor(7, D::CUDNN_DATA_FLOAT, [1, k, 1, 1])?;

    let mut conv = Descriptor::new(K::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
    conv.set_one(A::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, 2i64)?
        .set_one(A::CUDNN_ATTR_CONVOLUTION_COMP_TYPE, D::CUDNN_DATA_FLOAT)?
        .set_one(
            A::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
            sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
        )?
        .set(A::CUDNN_ATTR_CONVOLUTION_DILATIONS, &[1i64, 1])?
        .set(
            A::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES,
            &[shape.stride, shape.stride],
        )?
        .set(
            A::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS,
            &[shape.pad, shape.pad],
        )?
        .set(
            A::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS,
            &[shape.pad, shape.pad],
        )?;
    conv.finalize()?;

    let mut fprop = Descriptor::new(K::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR)?;
    fprop
        .set_descriptors(A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, &[&x])?
        .set_descriptors(A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, &[&wt])?
        .set_descriptors(A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, &[&y])?
        .set_descriptors(
            A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
            &[&conv],
        )?
        .set_one(A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, 1.0f32)?
        .set_one(A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, 0.0f32)?;
    fprop.finalize()?;

    let mut stats = Descriptor::new(K::CUDNN_BACKEND_OPERATION_GEN_STATS_DESCRIPTOR)?;
    stats
        .set_one(
            A::CUDNN_ATTR_OPERATION_GENSTATS_MODE,
            sys::cudnnGenStatsMode_t::CUDNN_GENSTATS_SUM_SQSUM,
        )?
        .set_one(
            A::CUDNN_ATTR_OPERATION_GENSTATS_MATH_PREC,
            D::CUDNN_DATA_FLOAT,
        )?
        .set_descriptors(A::CUDNN_ATTR_OPERATION_GENSTATS_XDESC, &[&y])?
        .set_descriptors(A::CUDNN_ATTR_OPERATION_GENSTATS_SUMDESC, &[&sum])?
        .set_descriptors(A::CUDNN_ATTR_OPERATION_GENSTATS_SQSUMDESC, &[&sqsum])?;
    stats.finalize()?;

    let mut graph = Descriptor::new(K::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
    graph.set_descriptors(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, &[&fprop, &stats])?;
    graph.finalize()?;

    let heur = backend::heuristics(&graph, HeurMode::A, Some(&devprop))?;
    let mut last = String::from("no config to try");
    for (i, cfg) in heur.configs.iter().enumerate() {
        match backend::finalize_plan(cfg, PlanSite::Deviceless(&devprop)) {
            Ok(plan) => {
                let json = backend::plan_json(&plan).unwrap_or_default();
                return Ok(ProbeReport {
                    device: props.name().to_string(),
                    reported: heur.reported,
                    usable: heur.configs.len(),
                    chosen: i,
                    engine_index: backend::engine_info(cfg)?.global_index,
                    pattern: finalize_mode(&json),
                    workspace: backend::plan_workspace_size(&plan)?,
                    build_ms: start.elapsed().as_secs_f64() * 1e3,
                });
            }
            Err(e) => last = e.to_string(),
        }
    }
    if heur.configs.is_empty() {
        return Err(Error::NoEngine {
            graph: "conv_fprop+genstats".into(),
            target: props.name().to_string(),
            mode: "A".into(),
            reported: heur.reported,
            usable: 0,
        });
    }
    Err(Error::NoPlan {
        graph: "conv_fprop+genstats".into(),
        target: props.name().to_string(),
        tried: heur.configs.len(),
        last,
    })
}

/// Pulls `"finalizeMode": "..."` out of a plan's JSON without parsing the whole document.
fn finalize_mode(json: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    fn find(v: &serde_json::Value) -> Option<String> {
        match v {
            serde_json::Value::Object(m) => m
                .get("finalizeMode")
                .and_then(|x| x.as_str().map(str::to_string))
                .or_else(|| m.values().find_map(find)),
            serde_json::Value::Array(a) => a.iter().find_map(find),
            _ => None,
        }
    }
    find(&v)
}
