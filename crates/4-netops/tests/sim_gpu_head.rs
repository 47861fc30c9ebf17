//! netops' GPU tier (tests/gpu_head.rs, unchanged) on the simulated CUDA device: this binary
//! holds those tests as module `gpu_head` and runs itself again with the simulator selected
//! (`CUDNN_CBR_DEVICE=sim`, its folder first on the loader path, docs/simulator.md), eager and
//! in the adversarial stream order, so that the network kernels' own program text runs
//! through the unchanged CUDA path (NVRTC, module load, the launches, `CudaRegions` for the
//! FC). Without the simulator selected the included tests print their SKIP lines, as on any
//! machine without a GPU.

#[path = "gpu_head.rs"]
mod gpu_head;
/// The simulator's build folder and child runs, shared with amp's sim_* tests.
#[path = "../../3-amp/tests/sim/mod.rs"]
mod sim;

#[test]
fn sim_gpu_head_tests_pass_on_the_simulated_device() {
    if sim::selected() {
        return; // the child run: only the included tests run there (filtered below)
    }
    let Some(dir) = sim::built("sim_gpu_head_tests_pass_on_the_simulated_device") else {
        return;
    };
    let tests = include_str!("gpu_head.rs").matches("#[test]").count();
    assert!(tests >= 5, "gpu_head.rs has {tests} tests");
    // Passing tests' output too, so that a SKIP line cannot go unseen.
    let filters = ["gpu_head::", "--test-threads", "2", "--show-output"];
    for (mode, adversarial) in [("eager", false), ("adversarial mode", true)] {
        let ran = sim::run(mode, sim::child(&dir, adversarial).args(filters));
        assert!(ran.ok, "the GPU tests failed on the simulator ({mode})");
        assert!(
            !ran.stdout.contains("SKIP"),
            "a GPU test skipped on the simulator ({mode})"
        );
        assert!(
            ran.stdout
                .contains(&format!("test result: ok. {tests} passed")),
            "expected all {tests} GPU tests to pass ({mode})"
        );
    }
}
