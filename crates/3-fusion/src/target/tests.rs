//! Device-properties documents: the fixtures parse, limits and malformed documents are refused.

use super::*;
use crate::error::Error;

use crate::test_support::{self, H200};

#[test]
fn fixture_parses() {
    let p = DeviceProps::from_json(H200).unwrap();
    assert_eq!(p.name(), "NVIDIA H200");
    assert_eq!(p.compute_capability(), (9, 0));
    assert_eq!(p.sm_count(), 132);
}

#[test]
fn a_live_document_may_lack_keys_but_says_which() {
    let mut v: serde_json::Value = serde_json::from_str(H200).unwrap();
    v.as_object_mut().unwrap().remove("l2CacheSize");
    v.as_object_mut().unwrap().remove("deviceName");
    let p = DeviceProps::from_live_json(&v.to_string()).unwrap();
    assert_eq!(p.name(), "unknown device");
    assert_eq!(p.sm_count(), 132);
    assert_eq!(p.missing_keys(), vec!["l2CacheSize", "deviceName"]);
    assert!(DeviceProps::from_json(H200)
        .unwrap()
        .missing_keys()
        .is_empty());
    // A value of the wrong type is still an error: it is not "unknown", it is wrong.
    v["multiProcessorCount"] = serde_json::json!("many");
    assert!(DeviceProps::from_live_json(&v.to_string()).is_err());
}

#[test]
fn live_targets_give_cudnn_their_handle_and_device_deviceless_ones_their_document() {
    let live = device_binding(TargetKind::Live, 92801);
    assert_eq!(
        live,
        DeviceBinding {
            graph_handle: true,
            heuristics_devprop: Some(DevicePropSource::Handle),
            plan_on_handle: true,
        }
    );
    // Before 9.8 cuDNN has no DEVICEPROP descriptor: the graph's handle alone names the
    // device.
    let old = device_binding(TargetKind::Live, 90100);
    assert!(old.graph_handle && old.plan_on_handle);
    assert_eq!(old.heuristics_devprop, None);
    for version in [90100, 92801] {
        assert_eq!(
            device_binding(TargetKind::Deviceless, version),
            DeviceBinding {
                graph_handle: false,
                heuristics_devprop: Some(DevicePropSource::Json),
                plan_on_handle: false,
            }
        );
    }
}

#[test]
fn a_deviceless_target_follows_the_deviceless_binding() {
    if !test_support::cudnn_or_skip("a_deviceless_target_follows_the_deviceless_binding") {
        return;
    }
    let lib = cudnn_fe_sys::library().expect("checked above");
    let target = Target::deviceless(DeviceProps::from_json(H200).unwrap()).unwrap();
    assert_eq!(target.kind(), TargetKind::Deviceless);
    assert_eq!(
        target.binding(),
        device_binding(TargetKind::Deviceless, lib.version())
    );
    // What the binding says is what lowering and heuristics get: no handle for the
    // graph, the fixture's descriptor for the heuristics and the plan.
    assert!(target.graph_handle().is_none());
    assert!(target.devprop().is_some());
    assert!(matches!(target.plan_site(), PlanSite::Deviceless(_)));
    assert_eq!(target.describe(), "NVIDIA H200 (deviceless)");
}

#[test]
fn a_missing_key_is_named() {
    let mut v: serde_json::Value = serde_json::from_str(H200).unwrap();
    v.as_object_mut().unwrap().remove("l2CacheSize");
    let err = DeviceProps::from_json(&v.to_string()).unwrap_err();
    assert!(
        err.to_string().contains("missing key `l2CacheSize`"),
        "{err}"
    );
}

#[test]
fn bad_documents_are_rejected() {
    for (doc, needle) in [
        ("not json", "not valid JSON"),
        ("[1,2]", "not a JSON object"),
    ] {
        let err = DeviceProps::from_json(doc).unwrap_err();
        assert!(err.to_string().contains(needle), "{doc}: {err}");
    }
    let err = DeviceProps::from_file("/nonexistent/props.json").unwrap_err();
    assert!(err.to_string().contains("/nonexistent/props.json"), "{err}");
}

mod limits {
    use super::*;

    fn with(key: &str, value: serde_json::Value) -> String {
        let mut v: serde_json::Value = serde_json::from_str(H200).unwrap();
        v[key] = value;
        v.to_string()
    }

    #[test]
    fn implausible_limits_are_typed_errors_naming_the_key() {
        use serde_json::json;
        for (key, value) in [
            ("warpSize", json!(-32)),
            ("warpSize", json!(64)),
            ("multiProcessorCount", json!(0)),
            ("multiProcessorCount", json!(-1)),
            ("maxThreadsPerBlock", json!(0)),
            ("maxThreadsPerBlock", json!(4096)),
            ("maxSharedMemoryPerBlock", json!(1_000_000)),
            ("totalGlobalMem", json!(0)),
            ("maxGridSize", json!([1, 2])),
            ("maxBlockSize", json!([1024, 0, 64])),
            ("deviceVer", json!(910)),
            ("deviceVer", json!(-900)),
        ] {
            for doc in [
                DeviceProps::from_json(&with(key, value.clone())),
                DeviceProps::from_live_json(&with(key, value.clone())),
            ] {
                let err = doc.unwrap_err();
                assert!(
                    matches!(&err, Error::DeviceProps { reason, .. } if reason.contains(key)),
                    "{key} = {value}: {err}"
                );
            }
        }
        for fixture in ["a100-sm80", "b200-sm100", "h200-sm90"] {
            let path = format!(
                "{}/../../tests/fixtures/devprops/{fixture}.json",
                env!("CARGO_MANIFEST_DIR")
            );
            DeviceProps::from_file(path).unwrap();
        }
    }
}

mod documents {
    use super::*;
    use serde_json::json;

    fn with(key: &str, value: serde_json::Value) -> String {
        let mut v: serde_json::Value = serde_json::from_str(H200).unwrap();
        v[key] = value;
        v.to_string()
    }

    fn reason(doc: &str) -> String {
        match DeviceProps::from_json(doc).unwrap_err() {
            Error::DeviceProps { reason, .. } => reason,
            e => panic!("not a device-properties error: {e:?}"),
        }
    }

    #[test]
    fn device_names_fit_cuda_device_props_256_byte_name() {
        let name = "N".repeat(MAX_DEVICE_NAME_BYTES);
        let p = DeviceProps::from_json(&with("deviceName", json!(name))).unwrap();
        assert_eq!(p.name().len(), 255);
        for len in [256, 300, 10_000] {
            let r = reason(&with("deviceName", json!("N".repeat(len))));
            assert!(
                r.contains(&format!("is {len} bytes long; at most 255")),
                "{r}"
            );
        }
        // 128 two-byte characters are 256 bytes: the limit is in bytes, as in C.
        let r = reason(&with("deviceName", json!("é".repeat(128))));
        assert!(r.contains("is 256 bytes long"), "{r}");
        let r = reason(&with("deviceName", json!("NVIDIA\u{0}H200")));
        assert!(r.contains("U+0000"), "{r}");
        assert!(reason(&with("deviceName", json!(""))).contains("empty"));
        assert!(reason(&with("deviceName", json!(7))).contains("must be a string"));
    }

    #[test]
    fn every_integer_is_within_its_c_type_and_physically_meaningful() {
        for (key, value, needle) in [
            ("smClockRateKHz", json!(-1_410_000), "positive integer"),
            ("memClockRateKHz", json!(0), "positive integer"),
            ("smClockRateKHz", json!(10_000_001), "at most 10000000"),
            ("l2CacheSize", json!(0), "positive integer"),
            ("maxCtasPerSM", json!(0), "positive integer"),
            ("totalGlobalMem", json!(1u64 << 60), "at most"),
            ("pciDeviceId", json!(1u64 << 31), "in 0..=2147483647"),
            ("cudaDeviceId", json!(-1), "in 0..=65536"),
            ("isTccDriver", json!(2), "in 0..=1"),
            ("supportCoopLaunch", json!(true), "in 0..=1"),
            ("driverVer", json!(1.5), "positive integer"),
            ("regsPerBlock", json!(1e300), "positive integer"),
            (
                "maxGridSize",
                json!([2147483648u64, 1, 1]),
                "three positive",
            ),
            ("maxBlockSize", json!([1024, 1024, 64, 1]), "three positive"),
            ("maxBlockSize", json!("1024x1024x64"), "three positive"),
        ] {
            let r = reason(&with(key, value.clone()));
            assert!(
                r.contains(key) && r.contains(needle),
                "{key} = {value}: {r}"
            );
        }
        assert!(reason(&with("reservedSharedMemoryPerBlock", json!(-1))).contains("0..="));
        DeviceProps::from_json(&with("reservedSharedMemoryPerBlock", json!(0))).unwrap();
    }

    #[test]
    fn a_key_given_twice_or_unknown_is_refused_in_a_document_for_cudnn() {
        let doc = H200.replacen("\"warpSize\": 32", "\"warpSize\": 32, \"warpSize\": 32", 1);
        assert_ne!(doc, H200);
        let r = reason(&doc);
        assert!(r.contains("duplicate key `warpSize`"), "{r}");
        let r = reason(&with("frobnicate", json!(1)));
        assert!(r.contains("unknown key `frobnicate`"), "{r}");
        let big = format!("{}{}", " ".repeat(MAX_DOCUMENT_BYTES as usize), H200);
        assert!(reason(&big).contains("at most 65536"));
    }

    #[test]
    fn a_live_document_may_hold_what_cudnn_writes() {
        let mut v: serde_json::Value = serde_json::from_str(H200).unwrap();
        v["isTccDriver"] = json!(false);
        v["supportCoopLaunch"] = json!(true);
        v["smClockRateKHz"] = json!(0);
        v["someNewKey"] = json!("value");
        DeviceProps::from_live_json(&v.to_string()).unwrap();
        assert!(DeviceProps::from_json(&v.to_string()).is_err());
        v["deviceName"] = json!("N".repeat(256));
        assert!(DeviceProps::from_live_json(&v.to_string()).is_err());
    }
}
