//! A device-properties document (what deviceless planning feeds cuDNN), checked: strict
//! JSON, every required key, each value within its field's range.

use crate::error::{Error, Result};
use std::path::Path;

/// Keys cuDNN 9.x requires in a device-properties JSON document.
pub const REQUIRED_KEYS: [&str; 24] = [
    "maxGridSize",
    "maxBlockSize",
    "regsPerBlock",
    "multiProcessorCount",
    "warpSize",
    "maxSharedMemoryPerBlock",
    "maxSharedMemoryPerBlockOptin",
    "reservedSharedMemoryPerBlock",
    "maxRegistersPerSM",
    "maxCtasPerSM",
    "maxThreadsPerBlock",
    "maxThreadsPerSM",
    "pciDeviceId",
    "isTccDriver",
    "supportCoopLaunch",
    "totalGlobalMem",
    "smClockRateKHz",
    "memClockRateKHz",
    "memoryBusWidth",
    "l2CacheSize",
    "cudaDeviceId",
    "deviceVer",
    "driverVer",
    "deviceName",
];

/// Compute capabilities (`deviceVer` = 100·major + 10·minor) that NVIDIA has shipped and cuDNN
/// 9 knows; a document naming another is rejected rather than planned for an unknown target.
pub const KNOWN_COMPUTE_CAPABILITIES: [u32; 20] = [
    500, 520, 530, 600, 610, 620, 700, 720, 750, 800, 860, 870, 890, 900, 1000, 1010, 1030, 1100,
    1200, 1210,
];

/// The most bytes of `deviceName`: cuDNN copies it into `cudaDeviceProp::name`, 256 bytes
/// with the terminating NUL (a longer name overruns that buffer and corrupts cuDNN's heap).
pub const MAX_DEVICE_NAME_BYTES: usize = 255;

/// The most bytes of a device-properties document (a real one is under 1 KiB).
pub const MAX_DOCUMENT_BYTES: u64 = 64 << 10;

/// Clock rates in kHz: at most 10 GHz.
const MAX_CLOCK_KHZ: u64 = 10_000_000;

/// Each integer key with the range its `cudaDeviceProp` field (a C `int`, or a `size_t` for
/// memory sizes) holds and a GPU can physically have: (key, least, most). The least is 1 for
/// counts and sizes; 0 where 0 is a real value (an ordinal, a flag, no reserved memory).
const INT_RANGES: [(&str, u64, u64); 19] = [
    ("regsPerBlock", 1, 1 << 20),
    ("multiProcessorCount", 1, 1 << 16),
    ("maxSharedMemoryPerBlock", 1, 1 << 24),
    ("maxSharedMemoryPerBlockOptin", 1, 1 << 24),
    ("reservedSharedMemoryPerBlock", 0, 1 << 20),
    ("maxRegistersPerSM", 1, 1 << 20),
    ("maxCtasPerSM", 1, 1 << 10),
    ("maxThreadsPerBlock", 1, 1 << 12),
    ("maxThreadsPerSM", 1, 1 << 16),
    ("pciDeviceId", 0, i32::MAX as u64),
    ("isTccDriver", 0, 1),
    ("supportCoopLaunch", 0, 1),
    ("totalGlobalMem", 1, 1 << 50),
    ("smClockRateKHz", 1, MAX_CLOCK_KHZ),
    ("memClockRateKHz", 1, MAX_CLOCK_KHZ),
    ("memoryBusWidth", 1, 1 << 16),
    ("l2CacheSize", 1, 1 << 30),
    ("cudaDeviceId", 0, 1 << 16),
    ("driverVer", 1, i32::MAX as u64),
];

/// The most a `maxGridSize` / `maxBlockSize` element may be (`int` fields).
const GRID_MAX: u64 = i32::MAX as u64;
const BLOCK_MAX: u64 = 1 << 12;

/// Checks `deviceName`: a string of 1..=[`MAX_DEVICE_NAME_BYTES`] bytes without NUL or other
/// control characters.
fn check_device_name(v: &serde_json::Value) -> std::result::Result<(), String> {
    let Some(name) = v.as_str() else {
        return Err(format!("`deviceName` must be a string, got {v}"));
    };
    if name.is_empty() {
        return Err("`deviceName` is empty".into());
    }
    if name.len() > MAX_DEVICE_NAME_BYTES {
        return Err(format!(
            "`deviceName` is {} bytes long; at most {MAX_DEVICE_NAME_BYTES} fit cudaDeviceProp's 256-byte name",
            name.len()
        ));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(format!(
            "`deviceName` contains the control character U+{:04X} (a C string ends at NUL)",
            u32::from(c)
        ));
    }
    Ok(())
}

/// Sanity checks of a document's values; a key that is absent is not checked here. A
/// deviceless (`strict`) document names only keys cuDNN reads and gives clock rates; a live
/// one, written by cuDNN, may hold other keys, 0 for a clock rate it does not know, and
/// booleans for the flags.
fn check_limits(
    obj: &serde_json::Map<String, serde_json::Value>,
    strict: bool,
) -> std::result::Result<(), String> {
    if strict {
        if let Some(key) = obj.keys().find(|k| !REQUIRED_KEYS.contains(&k.as_str())) {
            return Err(format!(
                "unknown key `{}` (cuDNN reads only: {})",
                key.chars().take(64).collect::<String>(),
                REQUIRED_KEYS.join(", ")
            ));
        }
    }
    for (key, least, most) in INT_RANGES {
        let Some(v) = obj.get(key) else { continue };
        if !strict && v.is_boolean() && most == 1 {
            continue;
        }
        let least = if !strict && key.ends_with("ClockRateKHz") {
            0
        } else {
            least
        };
        if !v.as_u64().is_some_and(|n| (least..=most).contains(&n)) {
            return Err(if least == 1 {
                format!("`{key}` must be a positive integer of at most {most}, got {v}")
            } else {
                format!("`{key}` must be an integer in {least}..={most}, got {v}")
            });
        }
    }
    if let Some(v) = obj.get("warpSize") {
        if v.as_u64() != Some(32) {
            return Err(format!(
                "`warpSize` must be 32 on every NVIDIA GPU, got {v}"
            ));
        }
    }
    for (key, most) in [("maxGridSize", GRID_MAX), ("maxBlockSize", BLOCK_MAX)] {
        if let Some(v) = obj.get(key) {
            let ok = v.as_array().is_some_and(|a| {
                a.len() == 3
                    && a.iter()
                        .all(|x| x.as_u64().is_some_and(|n| (1..=most).contains(&n)))
            });
            if !ok {
                return Err(format!(
                    "`{key}` must be three positive integers of at most {most}, got {v}"
                ));
            }
        }
    }
    if let Some(v) = obj.get("deviceName") {
        check_device_name(v)?;
    }
    if let Some(v) = obj.get("deviceVer") {
        let cc = v.as_u64().and_then(|n| u32::try_from(n).ok());
        if !cc.is_some_and(|cc| KNOWN_COMPUTE_CAPABILITIES.contains(&cc)) {
            let known: Vec<String> = KNOWN_COMPUTE_CAPABILITIES
                .iter()
                .map(|c| format!("{}.{}", c / 100, (c % 100) / 10))
                .collect();
            return Err(format!(
                "`deviceVer` {v} is not a known compute capability (100·major + 10·minor; known: {})",
                known.join(", ")
            ));
        }
    }
    let get = |k: &str| obj.get(k).and_then(|v| v.as_u64());
    if let (Some(block), Some(sm)) = (get("maxThreadsPerBlock"), get("maxThreadsPerSM")) {
        if block > sm {
            return Err(format!(
                "`maxThreadsPerBlock` {block} exceeds `maxThreadsPerSM` {sm}"
            ));
        }
    }
    if let (Some(block), Some(optin)) = (
        get("maxSharedMemoryPerBlock"),
        get("maxSharedMemoryPerBlockOptin"),
    ) {
        if block > optin {
            return Err(format!(
                "`maxSharedMemoryPerBlock` {block} exceeds `maxSharedMemoryPerBlockOptin` {optin}"
            ));
        }
    }
    Ok(())
}

/// A device-properties document, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceProps {
    json: String,
    name: String,
    device_ver: u32,
    sm_count: u32,
    total_memory: u64,
    origin: Option<String>,
}

impl DeviceProps {
    /// Parses and checks a device-properties JSON document: strict JSON (no key twice), only
    /// the keys of [`REQUIRED_KEYS`], each value within the range of the `cudaDeviceProp` field
    /// cuDNN fills from it and physically meaningful (`deviceName` at most
    /// [`MAX_DEVICE_NAME_BYTES`] bytes without NUL, clock rates and counts positive, `warpSize`
    /// 32, three-element grid and block limits).
    pub fn from_json(json: &str) -> Result<Self> {
        Self::parse(json, None)
    }

    /// Reads and checks a device-properties JSON file: a regular file (not a FIFO or a
    /// folder) of at most [`MAX_DOCUMENT_BYTES`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let origin = path.display().to_string();
        let json = cudnn_cbr_runtime::untrusted::read_regular_text(path, MAX_DOCUMENT_BYTES)
            .map_err(|problem| Error::File {
                what: "device-properties file",
                path: origin.clone(),
                problem,
            })?;
        Self::parse(&json, Some(origin))
    }

    /// Reads the document a live device's cuDNN handle serialized. Unlike [`from_json`]
    /// (documents for deviceless planning, where cuDNN needs every key), missing keys are
    /// tolerated: a live target plans through the handle, and the document only names the
    /// device and keys the plan cache (absent values read as "unknown" and 0).
    ///
    /// [`from_json`]: DeviceProps::from_json
    pub fn from_live_json(json: &str) -> Result<Self> {
        Self::parse_with(json, Some("the live device".into()), false)
    }

    /// The keys of [`REQUIRED_KEYS`] this document lacks (empty for any document that
    /// [`from_json`](DeviceProps::from_json) accepted).
    pub fn missing_keys(&self) -> Vec<&'static str> {
        let value: serde_json::Value = serde_json::from_str(&self.json).unwrap_or_default();
        REQUIRED_KEYS
            .iter()
            .copied()
            .filter(|k| value.get(k).is_none())
            .collect()
    }

    fn parse(json: &str, origin: Option<String>) -> Result<Self> {
        Self::parse_with(json, origin, true)
    }

    fn parse_with(json: &str, origin: Option<String>, strict: bool) -> Result<Self> {
        let fail = |reason: String| Error::DeviceProps {
            source_name: origin.clone(),
            reason,
        };
        if json.len() as u64 > MAX_DOCUMENT_BYTES {
            return Err(fail(format!(
                "the document is {} bytes, at most {MAX_DOCUMENT_BYTES} accepted",
                json.len()
            )));
        }
        let value = cudnn_cbr_runtime::untrusted::parse_strict_json(json)
            .map_err(|e| fail(format!("not valid JSON: {e}")))?;
        let obj = value
            .as_object()
            .ok_or_else(|| fail("the document is not a JSON object".into()))?;
        if strict {
            if let Some(missing) = REQUIRED_KEYS.iter().find(|k| !obj.contains_key(**k)) {
                return Err(fail(format!("missing key `{missing}`")));
            }
        }
        check_limits(obj, strict).map_err(fail)?;
        let uint = |key: &str| match obj.get(key) {
            None if !strict => Ok(0),
            v => v
                .and_then(|v| v.as_u64())
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| fail(format!("`{key}` is not an unsigned integer"))),
        };
        let name = match obj.get("deviceName") {
            None if !strict => "unknown device",
            v => v
                .and_then(|v| v.as_str())
                .ok_or_else(|| fail("`deviceName` is not a string".into()))?,
        };
        Ok(DeviceProps {
            json: json.trim().to_string(),
            name: name.to_string(),
            device_ver: uint("deviceVer")?,
            sm_count: uint("multiProcessorCount")?,
            // Range-checked by `check_limits` (1 B to 1 PiB) where present.
            total_memory: obj
                .get("totalGlobalMem")
                .and_then(|v| v.as_u64())
                .unwrap_or(0),
            origin,
        })
    }

    /// The JSON document as given to cuDNN.
    pub fn json(&self) -> &str {
        &self.json
    }

    /// `deviceName`, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability as (major, minor), from `deviceVer` (900 → (9, 0)).
    pub fn compute_capability(&self) -> (u32, u32) {
        (self.device_ver / 100, (self.device_ver % 100) / 10)
    }

    /// `multiProcessorCount`.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// `totalGlobalMem`: the device's memory in bytes (0 when a live document lacks it).
    pub fn total_memory(&self) -> u64 {
        self.total_memory
    }

    /// Where the document came from (a file path), when known.
    pub fn origin(&self) -> Option<&str> {
        self.origin.as_deref()
    }
}
