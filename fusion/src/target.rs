//! What a plan is built for: a device's properties plus the cuDNN version.
//!
//! Deviceless building (cuDNN ≥ 9.8) feeds cuDNN a device-properties JSON document instead of
//! a live GPU. [`DeviceProps`] holds that document, checked for every key cuDNN requires (cuDNN
//! itself only names a missing key in its debug log).

use crate::backend::{self, Descriptor, PlanSite};
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

/// What plans are built for: device properties plus the loaded cuDNN's version. Its
/// [`identity`](Target::identity) is part of every plan-cache key.
#[derive(Debug)]
pub struct Target {
    props: DeviceProps,
    site: Site,
    cudnn_version: usize,
    identity: String,
}

#[derive(Debug)]
enum Site {
    /// Deviceless: a finalized DEVICEPROP descriptor built from the JSON.
    Deviceless(Descriptor),
    /// A live device behind a cuDNN handle (owned by the execution layer), with the DEVICEPROP
    /// descriptor cuDNN built from that handle (`None` where [`device_binding`] says the
    /// heuristics get none).
    Handle {
        // Declared first so it drops first: it was built from the handle.
        devprop: Option<Descriptor>,
        handle: crate::exec::HandleRef,
    },
}

/// Whether a target is a live device or a device-properties document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetKind {
    /// Built from a device-properties document, no GPU ([`Target::deviceless`]).
    Deviceless,
    /// Built from a cuDNN handle on a live device ([`crate::exec::Handle::target`]).
    Live,
}

/// Where the heuristics' `CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR` comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevicePropSource {
    /// The target's JSON document (`CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION`): a fixture.
    Json,
    /// The live device behind the target's handle (`CUDNN_ATTR_DEVICEPROP_HANDLE`).
    Handle,
}

/// What cuDNN is told about the device a plan is for, at each stage of planning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBinding {
    /// `CUDNN_ATTR_OPERATIONGRAPH_HANDLE` is set on the operation graph.
    pub graph_handle: bool,
    /// `CUDNN_ATTR_ENGINEHEUR_DEVICEPROP` is set on the heuristics, from this source (`None`:
    /// not set, the heuristics rank for the device of the graph's handle).
    pub heuristics_devprop: Option<DevicePropSource>,
    /// The plan is finalized on the handle (`CUDNN_ATTR_EXECUTION_PLAN_HANDLE`) instead of for
    /// the descriptor (`CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP`).
    pub plan_on_handle: bool,
}

/// The one rule for what cuDNN is told about the device: a deviceless target gives its
/// document's descriptor to the heuristics and the plan and no handle anywhere; a live target
/// gives its handle to the operation graph and the plan, and (cuDNN ≥ 9.8, which has the
/// descriptor) the descriptor of its device to the heuristics, so a live plan is ranked for
/// the device it runs on.
pub fn device_binding(kind: TargetKind, cudnn_version: usize) -> DeviceBinding {
    match kind {
        TargetKind::Deviceless => DeviceBinding {
            graph_handle: false,
            heuristics_devprop: Some(DevicePropSource::Json),
            plan_on_handle: false,
        },
        TargetKind::Live => DeviceBinding {
            graph_handle: true,
            heuristics_devprop: (cudnn_version >= cudnn_fe_sys::DEVICELESS_MIN_VERSION)
                .then_some(DevicePropSource::Handle),
            plan_on_handle: true,
        },
    }
}

fn loaded_cudnn_version() -> usize {
    cudnn_fe_sys::library().map(|l| l.version()).unwrap_or(0)
}

impl Target {
    /// A deviceless target: plans are built for `props` without a GPU (cuDNN ≥ 9.8).
    pub fn deviceless(props: DeviceProps) -> Result<Self> {
        let devprop = backend::device_prop_descriptor(&props)?;
        Ok(Self::with_site(props, Site::Deviceless(devprop)))
    }

    /// A deviceless target from a device-properties JSON file.
    pub fn deviceless_from_file(path: impl AsRef<Path>) -> Result<Self> {
        Self::deviceless(DeviceProps::from_file(path)?)
    }

    /// Makes a live target's CUDA context current on this thread: heuristics on a live
    /// target query the current device (no-op for a deviceless target).
    pub(crate) fn make_current(&self) -> Result<()> {
        match &self.site {
            Site::Deviceless(_) => Ok(()),
            Site::Handle { handle, .. } => handle.make_current(),
        }
    }

    /// A live target on `handle`'s device, with the device-properties descriptor cuDNN builds
    /// from the handle when [`device_binding`] gives the heuristics one.
    pub(crate) fn live(props: DeviceProps, handle: crate::exec::HandleRef) -> Result<Self> {
        let devprop =
            match device_binding(TargetKind::Live, loaded_cudnn_version()).heuristics_devprop {
                Some(_) => {
                    handle.make_current()?;
                    Some(backend::device_prop_descriptor_for_handle(handle.raw())?)
                }
                None => None,
            };
        Ok(Self::with_site(props, Site::Handle { handle, devprop }))
    }

    fn with_site(props: DeviceProps, site: Site) -> Self {
        let cudnn_version = loaded_cudnn_version();
        let (major, minor) = props.compute_capability();
        let identity = format!(
            "{}|sm{major}{minor}|{}sm|cudnn{cudnn_version}|props{:016x}",
            props.name(),
            props.sm_count(),
            crate::graph::fnv1a(props.json().as_bytes())
        );
        Target {
            props,
            site,
            cudnn_version,
            identity,
        }
    }

    /// The device properties.
    pub fn props(&self) -> &DeviceProps {
        &self.props
    }

    /// `cudnnGetVersion()` of the library the plans are built with.
    pub fn cudnn_version(&self) -> usize {
        self.cudnn_version
    }

    /// Device name, compute capability, SM count, cuDNN version and a hash of the full
    /// properties document: equal identities build interchangeable plans.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Whether plans for this target can execute (it was made from a live device).
    pub fn is_live(&self) -> bool {
        self.kind() == TargetKind::Live
    }

    /// Live or deviceless.
    pub fn kind(&self) -> TargetKind {
        match self.site {
            Site::Deviceless(_) => TargetKind::Deviceless,
            Site::Handle { .. } => TargetKind::Live,
        }
    }

    /// What planning for this target tells cuDNN about the device ([`device_binding`] for
    /// its kind and cuDNN version).
    pub fn binding(&self) -> DeviceBinding {
        device_binding(self.kind(), self.cudnn_version)
    }

    /// A short description for messages: the device name and whether it is live.
    pub fn describe(&self) -> String {
        match self.kind() {
            TargetKind::Deviceless => format!("{} (deviceless)", self.props.name()),
            TargetKind::Live => format!("{} (live)", self.props.name()),
        }
    }

    /// The handle of a live target (None when deviceless): autotuning times plans on it.
    pub(crate) fn handle(&self) -> Option<&std::sync::Arc<crate::exec::Handle>> {
        match &self.site {
            Site::Deviceless(_) => None,
            Site::Handle { handle, .. } => Some(&handle.0),
        }
    }

    /// The handle the operation graph is given, as [`DeviceBinding::graph_handle`] says.
    pub(crate) fn graph_handle(&self) -> Option<&crate::exec::HandleRef> {
        match &self.site {
            Site::Handle { handle, .. } if self.binding().graph_handle => Some(handle),
            _ => None,
        }
    }

    pub(crate) fn plan_site(&self) -> PlanSite<'_> {
        match &self.site {
            Site::Deviceless(d) => PlanSite::Deviceless(d),
            Site::Handle { handle, .. } => PlanSite::Handle(handle.raw()),
        }
    }

    /// The descriptor the heuristics are given, as [`DeviceBinding::heuristics_devprop`] says.
    pub(crate) fn devprop(&self) -> Option<&Descriptor> {
        match &self.site {
            Site::Deviceless(d) => Some(d),
            Site::Handle { devprop, .. } => devprop.as_ref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200: &str = include_str!("../../tests/fixtures/devprops/h200-sm90.json");

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
        let lib = match cudnn_fe_sys::library() {
            Ok(lib) => lib,
            Err(e) if std::env::var_os("CI").is_some() => {
                panic!("cuDNN is required when CI is set: {e}")
            }
            Err(e) => {
                let e = e.to_string();
                println!(
                    "SKIP a_deviceless_target_follows_the_deviceless_binding: cuDNN not loadable ({})",
                    e.lines().next().unwrap_or("")
                );
                return;
            }
        };
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
}

#[cfg(test)]
mod limit_tests {
    use super::*;

    const H200: &str = include_str!("../../tests/fixtures/devprops/h200-sm90.json");

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
                "{}/../tests/fixtures/devprops/{fixture}.json",
                env!("CARGO_MANIFEST_DIR")
            );
            DeviceProps::from_file(path).unwrap();
        }
    }
}

#[cfg(test)]
mod document_tests {
    use super::*;
    use serde_json::json;

    const H200: &str = include_str!("../../tests/fixtures/devprops/h200-sm90.json");

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
