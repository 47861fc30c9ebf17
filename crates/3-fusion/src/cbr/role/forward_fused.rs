//! The forward roles of the fused and generic routes: conv + GenStats ([`GraphRole::ConvStats`];
//! the fused route's split form is a plain conv, then [`GraphRole::Stats`]), then BN finalize
//! ([`GraphRole::Finalize`]).

use super::common::{input_stamp, lg, plain_in, prologue_input, unwritten, Cx};
use super::forward_unfused::conv_graph;
use super::{no_kernel, EvalStep, RoleDef, RolePass};
use crate::cbr::bn_sync::SyncAction;
use crate::cbr::graphs;
use crate::cbr::kernels::OwnKernel;
use crate::cbr::keys as k;
use crate::cbr::layer::{CbrConfig, GraphRole, InputKind, LayerGraph, RouteKind, Src};
use crate::cbr::run::LayerIo;
use crate::error::Result;
use crate::exec::Scalar;
use crate::reference::{self as r, ChannelStats, ConvInput, Element, RunningStats};

/// Conv + GenStats: after it, synchronized BN sums `[Σy, Σy²]` over the replicas.
pub(super) const CONV_STATS: RoleDef = RoleDef {
    pass: RolePass::Forward(EvalStep::ConvWithoutStats),
    sync: SyncAction::ReduceStats,
    accumulates: &[k::SUM.name(), k::SQ_SUM.name()],
    kernel: no_kernel,
};

/// The statistics of a stored conv output: our `cbr_channel_stats` where it fits.
pub(super) const STATS: RoleDef = RoleDef {
    pass: RolePass::Forward(EvalStep::Skip),
    sync: SyncAction::ReduceStats,
    accumulates: &[k::SUM.name(), k::SQ_SUM.name()],
    kernel: |_, _| Some(OwnKernel::ChannelStats),
};

/// BN finalize: divides by the global element count under synchronized BN.
pub(super) const FINALIZE: RoleDef = RoleDef {
    pass: RolePass::Forward(EvalStep::FinalizeFromRunning),
    sync: SyncAction::GlobalCount,
    accumulates: &[],
    kernel: no_kernel,
};

/// Whether the fused route computes a first conv's statistics in a step of their own: cuDNN
/// 9.28 on sm_90 has only a runtime-compiled engine (about 2 s of NVRTC per shape) for conv +
/// GenStats when the input channel count is not a multiple of 8 (a stem's 3), while the plain
/// conv has precompiled ones and the statistics are one reduction over the stored output.
pub(super) fn split_stats(config: &CbrConfig) -> bool {
    config.input == InputKind::Raw && config.shape.c % 8 != 0
}

/// The fused and generic routes' conv with its statistics: conv + GenStats (with the
/// previous BN as prologue on the fused route), or on the fused route's
/// split form a plain conv, then the statistics of the stored `y`.
pub(super) fn graphs(config: &CbrConfig, kind: RouteKind) -> Vec<LayerGraph> {
    let s = &config.shape;
    let prologue = kind == RouteKind::Fused && config.input == InputKind::ThroughBn;
    let conv_in = if prologue {
        k::Y.prev()
    } else {
        plain_in(config)
    };
    if kind == RouteKind::Fused && split_stats(config) {
        let (g, [y, sum, sq_sum]) = graphs::channel_stats(s.y_dims());
        let stats = lg(
            GraphRole::Stats,
            g,
            vec![
                (y, k::Y.this()),
                (sum, k::SUM.this()),
                (sq_sum, k::SQ_SUM.this()),
            ],
        );
        return vec![conv_graph(config, conv_in), stats];
    }
    let (g, t) = graphs::conv_fprop(s, prologue, true);
    let mut b = vec![(t.x, conv_in), (t.w, k::W.this()), (t.y, k::Y.this())];
    if let Some((sc, bi)) = t.prologue {
        b.extend([(sc, k::EQ_SCALE.prev()), (bi, k::EQ_BIAS.prev())]);
    }
    if let Some((sum, sq)) = t.stats {
        b.extend([(sum, k::SUM.this()), (sq, k::SQ_SUM.this())]);
    }
    vec![lg(GraphRole::ConvStats, g, b)]
}

/// BN finalize with the layer's buffers (fused and generic routes).
pub(super) fn finalize_graph(config: &CbrConfig) -> LayerGraph {
    let s = &config.shape;
    let (g, i, o) = graphs::bn_finalize(s.k);
    lg(
        GraphRole::Finalize,
        g,
        vec![
            (i.sum, k::SUM.this()),
            (i.sq_sum, k::SQ_SUM.this()),
            (i.scale, k::GAMMA.this()),
            (i.bias, k::BETA.this()),
            // The updated running statistics get their own buffers (`*_next`, copied back
            // after the forward pass): cuDNN documents no in-place form.
            (i.prev_running_mean, k::RUNNING_MEAN.this()),
            (i.prev_running_var, k::RUNNING_VAR.this()),
            (i.epsilon, Src::Scalar(Scalar::F64(config.epsilon))),
            (i.momentum, Src::Scalar(Scalar::F64(config.momentum))),
            (i.accum_count, Src::Scalar(Scalar::I64(s.count()))),
            (o.eq_scale, k::EQ_SCALE.this()),
            (o.eq_bias, k::EQ_BIAS.this()),
            (o.saved_mean, k::SAVED_MEAN.this()),
            (o.saved_inv_std, k::SAVED_INV_STD.this()),
            (o.updated_running_mean, k::RUNNING_MEAN_NEXT.this()),
            (o.updated_running_var, k::RUNNING_VAR_NEXT.this()),
        ],
    )
}

/// The convolution of a `ConvStats` graph with its batch statistics: through the previous
/// layer's BN prologue where the layer reads its input so (the generic route convolves the
/// materialized activation instead), else from the plain input. The conv's input stays in
/// the scratch for this layer's wgrad.
fn conv_with_stats<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<ChannelStats<T::Acc>> {
    let p = cx.p();
    p.validate()?;
    let plain_in = cx.plain_in();
    let mut scratch = io.take_scratch();
    let prologue = cx.through_bn() && cx.kind != RouteKind::Generic;
    let mut stats = None;
    // `y` is written where the table keeps it (in a shared arena: in place).
    let done = io.write_half(k::Y.this(), p.y_elems(), &mut |y, rd| {
        let input = if prologue {
            prologue_input(rd)?
        } else {
            ConvInput::Plain(rd.half(plain_in)?)
        };
        let stamp = input_stamp(rd, prologue, plain_in);
        let w = rd.half(k::W.this())?;
        stats = Some(r::fprop_genstats_into_slice(
            &p,
            input,
            w,
            &mut scratch,
            stamp,
            y,
        )?);
        Ok(())
    });
    io.put_scratch(scratch);
    done?;
    stats.ok_or_else(|| unwritten(k::Y.name()))
}

/// [`GraphRole::ConvStats`] on the CPU.
pub(super) fn conv_stats<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    let stats = conv_with_stats(cx, io)?;
    io.set_float(k::SUM.this(), stats.sum)?;
    io.set_float(k::SQ_SUM.this(), stats.sqsum)
}

/// [`GraphRole::ConvStats`] in evaluation mode: the conv of the training graph; its
/// statistics are dropped, not stored.
pub(super) fn conv_stats_eval<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    conv_with_stats(cx, io).map(|_| ())
}

/// [`GraphRole::Stats`] on the CPU.
pub(super) fn stats<T: Element, I: LayerIo<T> + ?Sized>(cx: &Cx<'_>, io: &mut I) -> Result<()> {
    let stats = r::genstats(&cx.p().output_shape(), io.half(k::Y.this())?)?;
    io.set_float(k::SUM.this(), stats.sum)?;
    io.set_float(k::SQ_SUM.this(), stats.sqsum)
}

/// [`GraphRole::Finalize`] on the CPU, over `replicas` times the local element count.
pub(super) fn finalize<T: Element, I: LayerIo<T> + ?Sized>(cx: &Cx<'_>, io: &mut I) -> Result<()> {
    let stats = ChannelStats {
        sum: io.float(k::SUM.this())?.to_vec(),
        sqsum: io.float(k::SQ_SUM.this())?.to_vec(),
    };
    let count = cx.cfg.shape.count() as usize * cx.replicas;
    let out = finalize_running(cx, io, &stats, count)?;
    io.set_half(k::EQ_SCALE.this(), out.eq_scale)?;
    io.set_half(k::EQ_BIAS.this(), out.eq_bias)?;
    io.set_float(k::SAVED_MEAN.this(), out.saved_mean)?;
    io.set_float(k::SAVED_INV_STD.this(), out.saved_inv_std)
}

/// BN finalize of `stats` over `count` elements with this layer's `γ`, `β` and running
/// statistics, the updated running statistics written to their next-step buffers: what
/// [`GraphRole::Finalize`] and the synchronized unfused BN forward share.
pub(super) fn finalize_running<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
    stats: &ChannelStats<T::Acc>,
    count: usize,
) -> Result<r::BnFinalized<T>> {
    let mut mean = io.float(k::RUNNING_MEAN.this())?.to_vec();
    let mut var = io.float(k::RUNNING_VAR.this())?.to_vec();
    let out = r::bn_finalize(
        stats,
        io.float(k::GAMMA.this())?,
        io.float(k::BETA.this())?,
        RunningStats {
            mean: &mut mean,
            var: &mut var,
        },
        count,
        &cx.bn(),
    )?;
    io.set_float(k::RUNNING_MEAN_NEXT.this(), mean)?;
    io.set_float(k::RUNNING_VAR_NEXT.this(), var)?;
    Ok(out)
}

/// The evaluation-mode BN coefficients from the running statistics
/// ([`r::bn_eval_finalize`]): what [`GraphRole::Finalize`] and the unfused BN forward use in
/// evaluation mode.
pub(super) fn eval_finalized<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &I,
) -> Result<r::BnFinalized<T>> {
    Ok(r::bn_eval_finalize(
        io.float(k::GAMMA.this())?,
        io.float(k::BETA.this())?,
        io.float(k::RUNNING_MEAN.this())?,
        io.float(k::RUNNING_VAR.this())?,
        &cx.bn(),
    )?)
}

/// [`GraphRole::Finalize`] in evaluation mode: eq_scale and eq_bias from the running
/// statistics, nothing else written.
pub(super) fn finalize_eval<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    let out = eval_finalized(cx, io)?;
    io.set_half(k::EQ_SCALE.this(), out.eq_scale)?;
    io.set_half(k::EQ_BIAS.this(), out.eq_bias)
}
