//! One interface over the executors of a compiled network: each executor says how to run one
//! kind of step ([`NetExecutor`]); [`run_pass`] walks the compiled forward or backward order,
//! the one place that order is read. [`super::CpuNet`] (host memory, reference ops) and
//! [`super::CudaNet`] (device memory, cuDNN plans and amp kernels) implement it.

use super::compile::{BufId, CompiledNet, Step};
use super::spec::PoolSpec;
use cudnn_cbr_fusion::cbr::Pass;
use cudnn_cbr_fusion::reference::Nhwc;

/// How one executor runs each kind of step of a [`CompiledNet`].
pub trait NetExecutor {
    /// The executor's error.
    type Error;

    /// The network it runs.
    fn compiled(&self) -> &CompiledNet;

    /// One layer's forward or backward graphs.
    fn layer_pass(&mut self, layer: usize, pass: Pass) -> Result<(), Self::Error>;

    /// `out = a + b` (FP16 storage: rounded once).
    fn add(&mut self, a: BufId, b: BufId, out: BufId) -> Result<(), Self::Error>;

    /// Max-pool forward from `input` (of `shape`) into `output`.
    fn max_pool(
        &mut self,
        pool: &PoolSpec,
        shape: &Nhwc,
        input: BufId,
        output: BufId,
    ) -> Result<(), Self::Error>;

    /// Max-pool backward: `grad_output` to each window's first maximum of `input`, into
    /// `grad_input`.
    fn max_pool_backward(
        &mut self,
        pool: &PoolSpec,
        shape: &Nhwc,
        input: BufId,
        grad_output: BufId,
        grad_input: BufId,
    ) -> Result<(), Self::Error>;
}

/// A borrowed executor runs as the executor itself (the CPU classifier's pass over the network
/// its backend owns).
impl<E: NetExecutor + ?Sized> NetExecutor for &mut E {
    type Error = E::Error;

    fn compiled(&self) -> &CompiledNet {
        (**self).compiled()
    }

    fn layer_pass(&mut self, layer: usize, pass: Pass) -> Result<(), Self::Error> {
        (**self).layer_pass(layer, pass)
    }

    fn add(&mut self, a: BufId, b: BufId, out: BufId) -> Result<(), Self::Error> {
        (**self).add(a, b, out)
    }

    fn max_pool(
        &mut self,
        pool: &PoolSpec,
        shape: &Nhwc,
        input: BufId,
        output: BufId,
    ) -> Result<(), Self::Error> {
        (**self).max_pool(pool, shape, input, output)
    }

    fn max_pool_backward(
        &mut self,
        pool: &PoolSpec,
        shape: &Nhwc,
        input: BufId,
        grad_output: BufId,
        grad_input: BufId,
    ) -> Result<(), Self::Error> {
        (**self).max_pool_backward(pool, shape, input, grad_output, grad_input)
    }
}

/// Runs one pass of the compiled network on `exec`: [`Pass::Forward`] and
/// [`Pass::Backward`] walk the compiled forward and backward orders ([`Pass::Backward`]
/// expects the output's gradient, [`CompiledNet::output_grad`], written); [`Pass::Eval`]
/// walks the forward order with every layer step in evaluation mode (BN from the running
/// statistics, nothing statistical written), the adds and pools as in training.
pub fn run_pass<E: NetExecutor + ?Sized>(exec: &mut E, pass: Pass) -> Result<(), E::Error> {
    run_pass_observed(exec, pass, &mut |_, _| Ok(()))
}

/// Runs one step on `exec`.
fn run_step<E: NetExecutor + ?Sized>(exec: &mut E, step: Step) -> Result<(), E::Error> {
    match step {
        Step::Layer { layer, pass } => exec.layer_pass(layer, pass),
        Step::Add { a, b, out } => exec.add(a, b, out),
        Step::MaxPool {
            pool,
            shape,
            input,
            output,
        } => exec.max_pool(&pool, &shape, input, output),
        Step::MaxPoolBackward {
            pool,
            shape,
            input,
            grad_output,
            grad_input,
        } => exec.max_pool_backward(&pool, &shape, input, grad_output, grad_input),
    }
}

/// What [`run_pass_observed`] calls after each step: the executor and the step's index.
pub type AfterStep<'a, E> = dyn FnMut(&mut E, usize) -> Result<(), <E as NetExecutor>::Error> + 'a;

/// [`run_pass`], calling `after(exec, i)` once step `i` of the pass has run (been enqueued, on
/// a GPU): where a data-parallel step starts summing the gradients that are final
/// ([`super::GradSchedule`]).
pub fn run_pass_observed<E: NetExecutor + ?Sized>(
    exec: &mut E,
    pass: Pass,
    after: &mut AfterStep<'_, E>,
) -> Result<(), E::Error> {
    let count = pass_steps(exec.compiled(), pass).len();
    for i in 0..count {
        // Steps are small copies: read one, then let the executor borrow itself mutably.
        let step = match pass_steps(exec.compiled(), pass)[i] {
            Step::Layer { layer, .. } if pass == Pass::Eval => Step::Layer { layer, pass },
            other => other,
        };
        run_step(exec, step)?;
        after(exec, i)?;
    }
    Ok(())
}

fn pass_steps(net: &CompiledNet, pass: Pass) -> &[Step] {
    match pass {
        Pass::Backward => &net.backward,
        Pass::Forward | Pass::Eval => &net.forward,
    }
}
