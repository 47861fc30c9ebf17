//! What a plan is built for: a device's properties plus the cuDNN version.
//!
//! Deviceless building (cuDNN ≥ 9.8) feeds cuDNN a device-properties JSON document instead of
//! a live GPU. [`DeviceProps`] holds that document, checked for every key cuDNN requires (cuDNN
//! itself only names a missing key in its debug log).

mod props;
#[cfg(test)]
mod tests;

pub use props::{
    DeviceProps, KNOWN_COMPUTE_CAPABILITIES, MAX_DEVICE_NAME_BYTES, MAX_DOCUMENT_BYTES,
    REQUIRED_KEYS,
};

use crate::backend::{self, Descriptor, PlanSite};
use crate::error::Result;
use std::path::Path;

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
