//! Bad inputs: device properties.

use super::*;

pub(super) const H200_JSON: &str = include_str!("../fixtures/devprops/h200-sm90.json");

pub(super) fn props_with(key: &str, value: serde_json::Value) -> Verdict {
    let mut v: serde_json::Value = serde_json::from_str(H200_JSON).unwrap();
    v[key] = value;
    let e = DeviceProps::from_json(&v.to_string()).unwrap_err();
    assert!(
        matches!(&e, Error::DeviceProps { reason, .. } if reason.contains(key)),
        "{e:?}"
    );
    typed(e)
}

pub(super) fn props_rows() -> Vec<Row> {
    use serde_json::json;
    vec![
        ("device props", "not JSON", || {
            let e = DeviceProps::from_json("{not json").unwrap_err();
            assert!(matches!(e, Error::DeviceProps { .. }), "{e:?}");
            typed(e)
        }),
        ("device props", "not an object", || {
            let e = DeviceProps::from_json("[1, 2, 3]").unwrap_err();
            assert!(matches!(e, Error::DeviceProps { .. }), "{e:?}");
            typed(e)
        }),
        ("device props", "a required key missing", || {
            let mut v: serde_json::Value = serde_json::from_str(H200_JSON).unwrap();
            v.as_object_mut().unwrap().remove("maxRegistersPerSM");
            let e = DeviceProps::from_json(&v.to_string()).unwrap_err();
            assert!(e.to_string().contains("maxRegistersPerSM"), "{e}");
            typed(e)
        }),
        ("device props", "warpSize -32", || {
            props_with("warpSize", json!(-32))
        }),
        ("device props", "multiProcessorCount 0", || {
            props_with("multiProcessorCount", json!(0))
        }),
        ("device props", "an unknown compute capability", || {
            props_with("deviceVer", json!(950))
        }),
        ("device props", "maxGridSize of two values", || {
            props_with("maxGridSize", json!([1, 2]))
        }),
        ("device props", "a string where a count belongs", || {
            props_with("maxThreadsPerSM", json!("lots"))
        }),
        ("device props", "a file that does not exist", || {
            let e = DeviceProps::from_file("/nonexistent/devprops.json").unwrap_err();
            assert!(e.to_string().contains("/nonexistent/devprops.json"), "{e}");
            typed(e)
        }),
    ]
}
