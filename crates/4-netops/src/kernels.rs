//! The CUDA C sources of the network's own kernels, embedded: two NVRTC programs
//! ([`HEAD`], [`POOL`]), compiled like amp's ([`cudnn_cbr_amp::kernels::KernelSource`], amp's
//! [`COMMON_HEADER`](cudnn_cbr_amp::kernels::COMMON_HEADER) prepended: its conversion rules and
//! vector helpers) into one [`cudnn_cbr_amp::cuda::KernelSet`] per context
//! ([`crate::cuda::NetKernels::for_context`]). The CPU twin of every entry point lives in
//! [`crate::head`] or [`crate::pool`].

#![forbid(unsafe_code)]

use cudnn_cbr_amp::kernels::{KernelSource, ParamType};

/// Entry-point names, shared by the sources and the kernel-launch module.
pub mod entry {
    /// Global average pooling over NHWC FP16, FP32 out. Twin: `head::gap_forward`.
    pub const GAP_FORWARD: &str = "net_gap_forward";
    /// Global average pooling backward, FP32 in, FP16 out. Twin: `head::gap_backward`.
    pub const GAP_BACKWARD: &str = "net_gap_backward";
    /// FC forward, FP32 features and weights, FP16 logits. Twin: `head::fc_forward`.
    pub const FC_FORWARD: &str = "net_fc_forward";
    /// FC backward: FP32 dW, db, dx from FP16 dlogits. Twin: `head::fc_backward`.
    pub const FC_BACKWARD: &str = "net_fc_backward";
    /// FP16 + FP16 (the residual gradient join). Twin: `head::add_f16`.
    pub const ADD_F16: &str = "net_add_f16";
    /// One step's loss and accuracy appended to a device log. Twin: `head::head_metrics`
    /// and `head::metrics_log_append`.
    pub const HEAD_METRICS: &str = "net_head_metrics";
    /// Max-pool forward over NHWC FP16 (first maximum wins). Twin: `pool::max_pool_forward`.
    pub const MAX_POOL_FORWARD: &str = "net_max_pool_forward";
    /// Max-pool backward (gather, FP32 sums, FP16 out). Twin: `pool::max_pool_backward`.
    pub const MAX_POOL_BACKWARD: &str = "net_max_pool_backward";
}

/// The parameter list of an entry point, in order: what the launch module passes, checked
/// before every launch; the NVRTC test checks it against the compiled PTX. `None` for a name
/// that is not an entry point.
pub fn signature(entry_point: &str) -> Option<&'static [ParamType]> {
    use ParamType::U64;
    Some(match entry_point {
        // (a, pooled, batch, pixels, features) and (dpooled, da, batch, pixels, features)
        entry::GAP_FORWARD | entry::GAP_BACKWARD => &[U64, U64, U64, U64, U64],
        // (x, w, b, logits, batch, features, classes)
        entry::FC_FORWARD => &[U64, U64, U64, U64, U64, U64, U64],
        // (dlogits, x, w, dw, db, dx, batch, features, classes)
        entry::FC_BACKWARD => &[U64, U64, U64, U64, U64, U64, U64, U64, U64],
        // (a, b, out, n)
        entry::ADD_F16 => &[U64, U64, U64, U64],
        // (logits, labels, loss, log, batch, classes, capacity)
        entry::HEAD_METRICS => &[U64, U64, U64, U64, U64, U64, U64],
        // (x, y, batch, h, w, c, oh, ow, kernel, stride, pad)
        entry::MAX_POOL_FORWARD => &[U64, U64, U64, U64, U64, U64, U64, U64, U64, U64, U64],
        // (x, dy, dx, batch, h, w, c, oh, ow, kernel, stride, pad)
        entry::MAX_POOL_BACKWARD => &[U64, U64, U64, U64, U64, U64, U64, U64, U64, U64, U64, U64],
        _ => return None,
    })
}

/// The network head (pooling, FC, metrics) and the FP16 gradient join.
pub const HEAD: KernelSource = KernelSource {
    name: "head",
    file: "net_head.cu",
    source: include_str!("../kernels/net_head.cu"),
    entry_points: &[
        entry::GAP_FORWARD,
        entry::GAP_BACKWARD,
        entry::FC_FORWARD,
        entry::FC_BACKWARD,
        entry::ADD_F16,
        entry::HEAD_METRICS,
    ],
};

/// The stem's max-pool, forward and backward.
pub const POOL: KernelSource = KernelSource {
    name: "pool",
    file: "net_pool.cu",
    source: include_str!("../kernels/net_pool.cu"),
    entry_points: &[entry::MAX_POOL_FORWARD, entry::MAX_POOL_BACKWARD],
};

/// Every kernel source of the network's own ops.
pub const ALL: [KernelSource; 2] = [HEAD, POOL];

#[cfg(test)]
mod tests {
    use super::*;
    use cudnn_cbr_amp::kernels::check_table;

    #[test]
    fn the_table_matches_its_sources_and_signatures() {
        assert_eq!(check_table(&ALL, signature), Ok(()));
        assert_eq!(signature("nope"), None);
    }

    #[test]
    fn no_entry_point_is_amps() {
        // Errors and profiles name a kernel by its entry point alone: amp's and ours must differ.
        for e in ALL.iter().flat_map(|k| k.entry_points) {
            assert_eq!(
                cudnn_cbr_amp::kernels::signature(e),
                None,
                "{e} is also amp's"
            );
        }
    }
}
