//! Planning a network's graphs on several threads before [`compile`] walks its layers one by
//! one: the time to a first step is mostly cuDNN compiling its runtime-compiled graphs, once
//! per shape, and distinct graphs are independent (cuDNN allows planning distinct descriptors
//! on distinct threads; the plan cache is thread-safe).

use super::compile::{compile, RoutePolicy};
use super::spec::NetSpec;
use cudnn_cbr_fusion::cache::PlanCache;
use cudnn_cbr_fusion::cbr::kernels::{self, KernelStep, Pointwise};
use cudnn_cbr_fusion::cbr::{route_graphs, RouteKind};
use cudnn_cbr_fusion::graph::Graph;
use cudnn_cbr_fusion::{Result, Target};
use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// What [`prewarm`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prewarmed {
    /// Distinct graphs of the network on the routes asked for that cuDNN plans (those our
    /// own kernels run are not among them).
    pub graphs: usize,
    /// Of those, the ones that have a plan in the cache now.
    pub planned: usize,
    /// Threads used.
    pub threads: usize,
    /// Wall time.
    pub elapsed: Duration,
}

/// Plans every distinct graph of `spec` (at `batch` and `hw`) on each of `routes` into
/// `cache`, on `threads` threads (0: one per available core). A graph without an engine is
/// remembered by the cache as such; the compile that follows takes every plan from the cache
/// and decides its fallbacks as usual. Only the layer configs of the all-fused pairing are
/// known up front; graphs a fallback pairing needs are planned later by the compile itself.
///
/// # Errors
/// An invalid network (as [`compile`]); planning failures are not errors here.
pub fn prewarm(
    spec: &NetSpec,
    batch: usize,
    hw: usize,
    routes: &[RouteKind],
    target: &Target,
    cache: &PlanCache,
    threads: usize,
) -> Result<Prewarmed> {
    let start = Instant::now();
    let net = compile(spec, batch, hw, &RoutePolicy::Uniform(RouteKind::Fused))?;
    // Graphs our kernels run are not planned; the kernels' compile is one more work item.
    let arch = kernels::arch_for(target, Pointwise::from_env()?);
    let mut seen = HashSet::new();
    let mut graphs: Vec<Graph> = Vec::new();
    for layer in &net.layers {
        for &route in routes {
            for g in route_graphs(layer.layer.config(), route) {
                if arch.is_some_and(|a| KernelStep::for_graph(&g, a).is_some()) {
                    continue;
                }
                if let Ok(sig) = g.graph.signature() {
                    if seen.insert(sig.text().to_string()) {
                        graphs.push(g.graph);
                    }
                }
            }
        }
    }
    let threads = match threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
    .min(graphs.len() + usize::from(arch.is_some()))
    .max(1);
    let next = AtomicUsize::new(0);
    let planned = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                // Our kernels first: the longest single item. Their failure shows when the
                // compile that follows plans the layers.
                let i = match (i, arch) {
                    (0, Some(arch)) => {
                        let _ = kernels::compile(arch);
                        continue;
                    }
                    (i, Some(_)) => i - 1,
                    (i, None) => i,
                };
                let Some(g) = graphs.get(i) else { break };
                if cache.get_or_build(g, target).is_ok() {
                    planned.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    });
    Ok(Prewarmed {
        graphs: graphs.len(),
        planned: planned.into_inner(),
        threads,
        elapsed: start.elapsed(),
    })
}
