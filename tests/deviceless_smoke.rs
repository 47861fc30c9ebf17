//! Tier 2: real cuDNN builds and plans the forward conv + GenStats graph for every
//! device-properties fixture, with no GPU.

mod common;

use cudnn_cbr::fusion::probe::{self, ConvShape};
use cudnn_cbr::fusion::DeviceProps;

#[test]
fn conv_genstats_plans_for_every_fixture() {
    let Some(lib) = common::cudnn_or_skip("conv_genstats_plans_for_every_fixture") else {
        return;
    };
    assert!(
        lib.supports_deviceless(),
        "cuDNN {} cannot plan deviceless",
        lib.version()
    );
    for (label, path) in common::devprops_fixtures() {
        let props = DeviceProps::from_file(&path).unwrap();
        let r = probe::conv_genstats(&props, ConvShape::RESNET_3X3)
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        println!(
            "{label}: {} engine configs reported, {} usable, plan #{} (engine {}) finalized, \
             pattern {:?}, workspace {} B, {:.1} ms",
            r.reported, r.usable, r.chosen, r.engine_index, r.pattern, r.workspace, r.build_ms
        );
        assert!(r.usable > 0, "{label}: no usable engine config");
        assert!(r.reported >= r.usable, "{label}: {r:?}");
        assert!(r.chosen < r.usable, "{label}: {r:?}");
    }
}

#[test]
fn a_rejected_device_document_is_a_typed_error() {
    // Every key present, but the values make no sense: refused before cuDNN sees them.
    let (_, path) = &common::devprops_fixtures()[0];
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["deviceVer"] = serde_json::json!(12);
    v["multiProcessorCount"] = serde_json::json!(0);
    let err = DeviceProps::from_json(&v.to_string()).unwrap_err();
    assert!(
        err.to_string().contains("multiProcessorCount") || err.to_string().contains("deviceVer"),
        "{err}"
    );
    // A plausible but old device (sm_50) passes the checks; cuDNN then has no engine for the
    // FP16 NHWC conv, and that is a typed error too.
    let Some(_) = common::cudnn_or_skip("a_rejected_device_document_is_a_typed_error") else {
        return;
    };
    v["deviceVer"] = serde_json::json!(500);
    v["multiProcessorCount"] = serde_json::json!(16);
    let props = DeviceProps::from_json(&v.to_string()).unwrap();
    let result = probe::conv_genstats(&props, ConvShape::RESNET_3X3);
    assert!(result.is_err(), "an sm_50 device got a plan: {result:?}");
}
