//! Without a GPU, execution entry points return typed errors instead of panicking.

use cudnn_cbr::fusion::exec::cuda_device;
use cudnn_cbr::fusion::Error;

#[test]
fn opening_a_device_without_one_is_a_typed_error() {
    match cuda_device(0) {
        Ok(ctx) => println!(
            "SKIP opening_a_device_without_one: this machine has CUDA device {}",
            ctx.ordinal()
        ),
        Err(Error::NoDevice { reason }) => {
            assert!(!reason.is_empty());
            println!("no device, as expected: {reason}");
        }
        Err(other) => panic!("expected NoDevice, got {other}"),
    }
}
