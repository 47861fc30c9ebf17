//! Loading the real cuDNN (tier 2). Without it: fails under CI, SKIPs elsewhere.

use cudnn_fe_sys::{cudnnStatus_t, library};

#[test]
fn loads_the_pinned_cudnn_and_reports_its_version() {
    let lib = match library() {
        Ok(lib) => lib,
        Err(e) if std::env::var_os("CI").is_some() => panic!("CI needs cuDNN: {e}"),
        Err(e) => {
            println!(
                "SKIP loads_the_pinned_cudnn: {}",
                e.to_string().lines().next().unwrap_or_default()
            );
            return;
        }
    };
    assert!(lib.version() >= cudnn_fe_sys::MIN_VERSION);
    let (major, _, _) = lib.version_triple();
    assert_eq!(major, 9);
    assert!(lib.supports_deviceless());
    println!("loaded cuDNN {} from {}", lib.version(), lib.path());

    // A failing status becomes a typed error with cuDNN's name for it.
    let err = cudnnStatus_t::CUDNN_STATUS_BAD_PARAM.result().unwrap_err();
    assert_eq!(err.code, 2000);
    assert!(err.name.contains("BAD_PARAM"), "{err}");
    assert!(cudnnStatus_t::CUDNN_STATUS_SUCCESS.result().is_ok());
}

#[test]
fn a_real_cudnn_call_failure_carries_the_last_error_text() {
    let Ok(lib) = library() else {
        println!("SKIP a_real_cudnn_call_failure: cuDNN not loadable");
        return;
    };
    // Finalizing an empty tensor descriptor must fail with BAD_PARAM.
    let mut desc = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the descriptor is destroyed below.
    unsafe {
        (lib.api.cudnnBackendCreateDescriptor)(
            cudnn_fe_sys::cudnnBackendDescriptorType_t::CUDNN_BACKEND_TENSOR_DESCRIPTOR,
            &mut desc,
        )
    }
    .result()
    .unwrap();
    // SAFETY: desc is a live descriptor.
    let err = unsafe { (lib.api.cudnnBackendFinalize)(desc) }
        .result()
        .unwrap_err();
    // SAFETY: desc is live and destroyed once.
    unsafe { (lib.api.cudnnBackendDestroyDescriptor)(desc) }
        .result()
        .unwrap();
    assert!(err.name.starts_with("CUDNN_STATUS_BAD_PARAM"), "{err}");
    println!("finalizing an empty tensor: {err}");
}
