//! The per-role table is complete: every role a route of a layer runs has a CPU step that
//! touches exactly the buffers its graph binds, a sync action, and (where its graph is one of
//! our kernels') the kernel preparation that names that kernel.

use super::*;
use crate::cbr::bn_sync::sync_action;
use crate::cbr::kernels::test_support::configs;
use crate::cbr::kernels::KernelStep;
use crate::cbr::layer::{route_graphs, Src};
use crate::cbr::run::{write_half_via_vec, LayerRead, WriteHalf};
use std::collections::{BTreeSet, HashMap, HashSet};

/// Every role.
const ALL: [GraphRole; 21] = [
    GraphRole::ConvStats,
    GraphRole::Stats,
    GraphRole::Finalize,
    GraphRole::Apply,
    GraphRole::DgradDreluDbn,
    GraphRole::Wgrad,
    GraphRole::DbnApply,
    GraphRole::Dgrad,
    GraphRole::ApplyPrev,
    GraphRole::Conv,
    GraphRole::BnForward,
    GraphRole::AddBranch,
    GraphRole::ReluBackward,
    GraphRole::BnBackward,
    GraphRole::ApplyReluBackward,
    GraphRole::ApplyBnBackward,
    GraphRole::DbnReduce,
    GraphRole::DbnCoefficients,
    GraphRole::ApplyDbnReduce,
    GraphRole::ApplyDbnCoefficients,
    GraphRole::ApplyDbnApply,
];

/// The batch's and the running statistics: what evaluation mode never writes.
const STATISTICS: [&str; 8] = [
    "sum",
    "sq_sum",
    "saved_mean",
    "saved_inv_std",
    "running_mean",
    "running_var",
    "running_mean_next",
    "running_var_next",
];

/// A buffer of this layer (`false`) or of the previous one (`true`), by name.
type Name = (bool, &'static str);

fn name_of(src: Src) -> Option<Name> {
    match src {
        Src::This(n) => Some((false, n)),
        Src::Prev(n) => Some((true, n)),
        Src::Scalar(_) => None,
    }
}

/// An f64 buffer table over a layer's buffers (every one zero-filled at its size, γ at 1 and
/// the variances at 1 so that every op's input is valid) that records what a step touches.
struct Recorder {
    bufs: HashMap<Name, Vec<f64>>,
    touched: std::cell::RefCell<BTreeSet<Name>>,
    written: BTreeSet<Name>,
}

impl Recorder {
    fn new(layer: &CbrLayer) -> Self {
        let mut bufs = HashMap::new();
        let tables = [(false, layer.buffers()), (true, layer.prev_buffers())];
        for (prev, table) in tables {
            for b in table {
                let one = matches!(b.name, "gamma" | "running_var" | "saved_inv_std");
                let v = if one { 1.0 } else { 0.0 };
                bufs.insert((prev, b.name), vec![v; b.elems]);
            }
        }
        Recorder {
            bufs,
            touched: Default::default(),
            written: BTreeSet::new(),
        }
    }

    fn get(&self, src: Src) -> Result<&[f64]> {
        let name = name_of(src).expect("a buffer, not a scalar");
        self.touched.borrow_mut().insert(name);
        self.bufs
            .get(&name)
            .map(Vec::as_slice)
            .ok_or_else(|| Error::Buffer {
                name: format!("{name:?}"),
                problem: "is not a buffer of the layer".into(),
            })
    }

    fn set(&mut self, src: Src, v: Vec<f64>) -> Result<()> {
        let name = name_of(src).expect("a buffer, not a scalar");
        self.touched.borrow_mut().insert(name);
        self.written.insert(name);
        self.bufs.insert(name, v);
        Ok(())
    }
}

impl LayerRead<f64> for Recorder {
    fn half(&self, src: Src) -> Result<&[f64]> {
        self.get(src)
    }
    fn float(&self, src: Src) -> Result<&[f64]> {
        self.get(src)
    }
}

impl LayerIo<f64> for Recorder {
    fn write_half(&mut self, out: Src, len: usize, f: &mut WriteHalf<'_, f64>) -> Result<()> {
        write_half_via_vec(self, out, len, f)
    }
    fn set_half(&mut self, src: Src, v: Vec<f64>) -> Result<()> {
        self.set(src, v)
    }
    fn set_float(&mut self, src: Src, v: Vec<f64>) -> Result<()> {
        self.set(src, v)
    }
}

/// For every route kind and configuration in use, each role in `route_graphs` has: a CPU step
/// that reads and writes exactly the buffers its graph binds; a sync action whose buffers
/// the graph binds (and a whole-BN split only on the unfused route); accumulated outputs
/// among its bindings; and, where its graph is one of our kernels, the kernel preparation
/// that names that kernel (and none where it is not). Every role appears somewhere.
#[test]
fn the_per_role_table_is_complete() {
    let mut seen = HashSet::new();
    for config in configs() {
        for kind in RouteKind::ALL {
            let layer = CbrLayer::for_cpu(config, kind).unwrap();
            let mut io = Recorder::new(&layer);
            for lg in route_graphs(&config, kind) {
                let role = lg.role;
                let at = format!("{} {kind:?} {role:?}", config.shape.label());
                seen.insert(role);
                let def = role.def();
                let bound: BTreeSet<Name> = lg
                    .bindings
                    .iter()
                    .filter_map(|(_, s)| name_of(*s))
                    .collect();
                // The CPU step touches what the graph binds, no more and no less.
                io.touched.borrow_mut().clear();
                io.written.clear();
                cpu_step(&layer, role, &mut io, 1).unwrap_or_else(|e| panic!("{at}: {e}"));
                assert_eq!(*io.touched.borrow(), bound, "{at}: CPU step vs graph");
                let trained = std::mem::take(&mut io.written);
                // The sync action's buffers are the graph's.
                match sync_action(role) {
                    SyncAction::ReduceStats => {
                        assert!(bound.contains(&(false, "sum")), "{at}");
                        assert!(bound.contains(&(false, "sq_sum")), "{at}");
                    }
                    SyncAction::Coefficients { side, outputs, .. } => {
                        for o in outputs {
                            assert!(bound.contains(&(false, o)), "{at}: {o}");
                        }
                        let prev = side == BnSide::Prev;
                        for n in ["gamma", "saved_inv_std", "saved_mean", "dgamma", "dbeta"] {
                            assert!(bound.contains(&(prev, n)), "{at}: {n}");
                        }
                    }
                    SyncAction::Split => assert_eq!(kind, RouteKind::Unfused, "{at}"),
                    SyncAction::GlobalCount => assert_eq!(role, GraphRole::Finalize, "{at}"),
                    SyncAction::Local => {}
                }
                for a in def.accumulates {
                    assert!(bound.iter().any(|(_, n)| n == a), "{at}: accumulates {a}");
                }
                // The kernel preparation: the role's kernel is the graph's.
                let declared = (def.kernel)(&config, kind);
                assert_eq!(
                    declared,
                    OwnKernel::for_graph(&lg.graph),
                    "{at}: own kernel"
                );
                let by_role = KernelStep::for_role(&lg, &config, kind, "sm_90");
                assert_eq!(by_role, KernelStep::for_graph(&lg, "sm_90"), "{at}");
                // Evaluation mode: a forward role's step touches only what its graph binds and
                // writes what its training step writes, less the batch's and the running
                // statistics (nothing statistical is written); a backward role's is refused.
                io.touched.borrow_mut().clear();
                let eval = cpu_eval_step(&layer, role, &mut io);
                match def.pass {
                    RolePass::Backward => assert!(eval.is_err(), "{at}: eval of a backward role"),
                    RolePass::Forward(step) => {
                        eval.unwrap_or_else(|e| panic!("{at}: eval: {e}"));
                        assert!(io.touched.borrow().is_subset(&bound), "{at}: eval vs graph");
                        let expected: BTreeSet<Name> = trained
                            .iter()
                            .filter(|(_, n)| !STATISTICS.contains(n))
                            .copied()
                            .collect();
                        assert_eq!(io.written, expected, "{at}: eval step {step:?} writes");
                    }
                }
                io.written.clear();
            }
            // Forward roles first, then backward ones, as the passes split them.
            let passes: Vec<bool> = layer.steps().iter().map(|s| s.role.is_backward()).collect();
            assert!(passes.windows(2).all(|w| w[0] <= w[1]), "{kind:?}");
        }
    }
    for role in ALL {
        assert!(
            seen.contains(&role),
            "{role:?} is in no route of the configurations"
        );
    }
}
