//! Bad inputs: device-properties documents: each check of the strict parser, and files that are not files.

use super::*;

pub(super) fn props_file_err(tag: &str, make: fn(&Path), problem: &str) -> Verdict {
    let dir = scratch(tag);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("props.json");
    make(&path);
    let e = DeviceProps::from_file(&path).unwrap_err();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(matches!(e, Error::File { .. }), "{e:?}");
    assert!(e.to_string().ends_with(problem), "{e}");
    typed(e)
}

pub(super) fn props_more_rows() -> Vec<Row> {
    use serde_json::json;
    vec![
        ("device props", "an unknown key", || {
            let mut v: serde_json::Value = serde_json::from_str(H200_JSON).unwrap();
            v["l3CacheSize"] = json!(1);
            let e = DeviceProps::from_json(&v.to_string()).unwrap_err();
            assert!(e.to_string().contains("unknown key `l3CacheSize`"), "{e}");
            typed(e)
        }),
        ("device props", "a key given twice (strict JSON)", || {
            let doc = H200_JSON.replacen("{", "{\"warpSize\": 32, ", 1);
            let e = DeviceProps::from_json(&doc).unwrap_err();
            assert!(e.to_string().contains("warpSize"), "{e}");
            typed(e)
        }),
        ("device props", "an empty deviceName", || {
            props_with("deviceName", json!(""))
        }),
        ("device props", "a deviceName of 300 bytes", || {
            props_with("deviceName", json!("G".repeat(300)))
        }),
        ("device props", "a deviceName with a NUL", || {
            props_with("deviceName", json!("NVIDIA\u{0}H200"))
        }),
        ("device props", "a deviceName that is a number", || {
            props_with("deviceName", json!(200))
        }),
        (
            "device props",
            "maxThreadsPerBlock above maxThreadsPerSM",
            || {
                let mut v: serde_json::Value = serde_json::from_str(H200_JSON).unwrap();
                v["maxThreadsPerBlock"] = json!(4096);
                v["maxThreadsPerSM"] = json!(2048);
                let e = DeviceProps::from_json(&v.to_string()).unwrap_err();
                assert!(e.to_string().contains("exceeds `maxThreadsPerSM`"), "{e}");
                typed(e)
            },
        ),
        (
            "device props",
            "shared memory per block above its opt-in",
            || props_with("maxSharedMemoryPerBlock", json!(300000)),
        ),
        ("device props", "a maxBlockSize element of 0", || {
            props_with("maxBlockSize", json!([1024, 0, 64]))
        }),
        ("device props", "a maxGridSize element of 2^31", || {
            props_with("maxGridSize", json!([2147483648u64, 65535, 65535]))
        }),
        ("device props", "isTccDriver 2 (a flag)", || {
            props_with("isTccDriver", json!(2))
        }),
        (
            "device props",
            "a flag given as true in a deviceless document",
            || props_with("supportCoopLaunch", json!(true)),
        ),
        ("device props", "totalGlobalMem of 2^51 bytes", || {
            props_with("totalGlobalMem", json!(1u64 << 51))
        }),
        ("device props", "an SM clock of 0 kHz", || {
            props_with("smClockRateKHz", json!(0))
        }),
        ("device props", "a memory clock of 20 GHz", || {
            props_with("memClockRateKHz", json!(20_000_000))
        }),
        ("device props", "a negative pciDeviceId", || {
            props_with("pciDeviceId", json!(-1))
        }),
        ("device props", "a fractional SM count", || {
            props_with("multiProcessorCount", json!(131.5))
        }),
        ("device props", "a document of 100 KiB", || {
            let doc = format!("{}{}", " ".repeat(100 << 10), H200_JSON);
            let e = DeviceProps::from_json(&doc).unwrap_err();
            assert!(e.to_string().contains("at most 65536 accepted"), "{e}");
            typed(e)
        }),
        (
            "device props",
            "a live document that is not an object",
            || {
                let e = DeviceProps::from_live_json("\"NVIDIA H200\"").unwrap_err();
                assert!(e.to_string().contains("the live device"), "{e}");
                typed(e)
            },
        ),
        ("device props", "a FIFO as the file (was: a hang)", || {
            props_file_err(
                "props-fifo",
                mkfifo,
                "is a FIFO (named pipe), not a regular file",
            )
        }),
        ("device props", "a folder as the file", || {
            props_file_err(
                "props-folder",
                |p| std::fs::create_dir_all(p).unwrap(),
                "is a folder, not a regular file",
            )
        }),
        ("device props", "a 1 MiB file", || {
            props_file_err(
                "props-huge",
                |p| std::fs::write(p, vec![b' '; 1 << 20]).unwrap(),
                "at most 65536 accepted",
            )
        }),
        ("device props", "a file that is not UTF-8", || {
            props_file_err(
                "props-latin1",
                |p| std::fs::write(p, b"{\"deviceName\": \"caf\xe9\"}").unwrap(),
                "is not UTF-8 text",
            )
        }),
        ("device props", "/dev/zero as the file", || {
            let e = DeviceProps::from_file("/dev/zero").unwrap_err();
            assert!(
                e.to_string()
                    .ends_with("is a character device, not a regular file"),
                "{e}"
            );
            typed(e)
        }),
    ]
}
