//! Without a GPU, execution entry points return typed errors instead of panicking.

use cudnn_cbr::fusion::Error;
use cudnn_cbr::runtime::cuda_device;

#[test]
fn opening_a_device_without_one_is_a_typed_error() {
    match cuda_device(0) {
        Ok(ctx) => println!(
            "SKIP opening_a_device_without_one: this machine has CUDA device {}",
            ctx.ordinal()
        ),
        Err(e) => {
            assert!(!e.reason.is_empty());
            // Both layers' errors say the same thing (`?` converts it).
            let fusion: Error = e.clone().into();
            assert!(matches!(&fusion, Error::NoDevice { reason } if *reason == e.reason));
            let amp: cudnn_cbr::amp::AmpError = e.clone().into();
            assert!(amp.is_unavailable(), "{amp}");
            println!("no device, as expected: {e}");
        }
    }
}
