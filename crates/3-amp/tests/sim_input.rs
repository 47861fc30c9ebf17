//! `amp::cuda::DoubleInput` (a training loop's batches copied on a stream of their own into
//! two device buffers, ordered by events) on the simulated CUDA device (docs/simulator.md):
//! this binary runs itself again with the simulator selected, eagerly and in the adversarial
//! stream order (a stream's work runs only when a wait or synchronize needs it), where a read
//! of a batch without the event join would see the buffer's previous contents.

mod sim;

use cudnn_cbr_amp::cuda::{DevRangeMut, DoubleInput};
use cudnn_cbr_amp::plan::ByteRange;
use cudnn_cbr_runtime::cuda_device;
use std::process::Command;

const CHILD: &str = "CUDNN_CBR_SIM_INPUT_CHILD";

/// Batch `i`: `len` bytes, distinct per batch and position.
fn batch(i: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (i as usize * 37 + j * 3 + 1) as u8)
        .collect()
}

fn child() {
    let ctx = cuda_device(0).expect("the simulated device");
    let stream = ctx.default_stream();
    let mut input = DoubleInput::new(&stream, 64).unwrap();
    let mut a = stream.alloc_zeros::<u8>(40).unwrap();
    let mut b = stream.alloc_zeros::<u8>(8).unwrap();

    // Refusals, each naming what is wrong: too much, nothing staged, a slot still full,
    // destinations that do not match the parts.
    let e = input.stage(0, &[&[0u8; 60], &[0u8; 8]]).unwrap_err();
    assert!(e.to_string().contains("together"), "{e}");
    let e = input
        .consume(0, &stream, &mut [DevRangeMut::whole(&mut a)])
        .unwrap_err();
    assert!(e.to_string().contains("nothing staged"), "{e}");
    input.stage(0, &[&batch(0, 40), &batch(100, 8)]).unwrap();
    let e = input.stage(2, &[&batch(2, 40)]).unwrap_err();
    assert!(e.to_string().contains("not consumed"), "{e}");
    let e = input
        .consume(0, &stream, &mut [DevRangeMut::whole(&mut a)])
        .unwrap_err();
    assert!(e.to_string().contains("destinations"), "{e}");
    let short = DevRangeMut::new(&mut b, ByteRange::new(0, 4)).unwrap();
    let e = input
        .consume(0, &stream, &mut [DevRangeMut::whole(&mut a), short])
        .unwrap_err();
    assert!(e.to_string().contains("destination"), "{e}");

    // Batches staged one ahead, as the training loop does: consume i, stage i + 1, read.
    for i in 0..7u64 {
        input
            .consume(
                i,
                &stream,
                &mut [DevRangeMut::whole(&mut a), DevRangeMut::whole(&mut b)],
            )
            .unwrap();
        input
            .stage(i + 1, &[&batch(i + 1, 40), &batch(i + 101, 8)])
            .unwrap();
        assert_eq!(stream.clone_dtoh(&a).unwrap(), batch(i, 40), "batch {i}");
        assert_eq!(
            stream.clone_dtoh(&b).unwrap(),
            batch(i + 100, 8),
            "batch {i}"
        );
    }
    println!("DOUBLE INPUT OK");
}

#[test]
fn batches_arrive_in_order_in_both_stream_orders() {
    let test = "batches_arrive_in_order_in_both_stream_orders";
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    let Some(dir) = sim::built(test) else {
        return;
    };
    for adversarial in [false, true] {
        let mut cmd = Command::new(std::env::current_exe().expect("this test binary"));
        sim::select(&mut cmd, &dir)
            .args([test, "--exact", "--nocapture"])
            .env(CHILD, "1");
        if adversarial {
            cmd.env("CUDNN_CBR_SIM_ADVERSARIAL", "1");
        }
        let out = cmd.output().expect("run the test under the simulator");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("DOUBLE INPUT OK"),
            "adversarial {adversarial}:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
