//! The training loop's errors ([`TrainError`]) and how the library's errors map onto them.

use crate::{checkpoint, cifar, cuda};
use cudnn_cbr::amp::AmpError;

/// Errors of the training loop.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The amp layer refused something.
    #[error(transparent)]
    Amp(#[from] AmpError),
    /// The memory plan refused a registration.
    #[error(transparent)]
    Plan(#[from] cudnn_cbr::amp::PlanError),
    /// A CBR layer failed.
    #[error(transparent)]
    Fusion(#[from] cudnn_cbr::fusion::Error),
    /// The configuration cannot work.
    #[error("bad training configuration: {0}")]
    Config(String),
    /// No usable CUDA device (no driver library, no device, or it cannot be opened).
    #[error("no usable CUDA device: {reason}")]
    NoDevice {
        /// Why.
        reason: String,
    },
    /// cuDNN cannot be loaded.
    #[error("cuDNN not loadable: {reason}")]
    NoCudnn {
        /// The loader's account (the paths tried).
        reason: String,
    },
    /// NVRTC (needed for the amp kernels) cannot be loaded or compile them.
    #[error("NVRTC unusable: {reason}")]
    NoNvrtc {
        /// Why.
        reason: String,
    },
    /// A CUDA driver call of the training loop failed (a copy, a capture, a graph launch).
    #[error("CUDA driver call failed while trying to {what}: {message}")]
    Driver {
        /// What the loop was doing.
        what: String,
        /// The driver's error.
        message: String,
    },
    /// A layer has no route (fused, unfused or generic) on this device.
    #[error("layer `{layer}` has no cuDNN route on this device: {reason}")]
    NoRoute {
        /// The layer (its parameter prefix and shape).
        layer: String,
        /// cuDNN's account for both routes.
        reason: String,
    },
    /// The dataset cannot be read or does not fit the network.
    #[error(transparent)]
    Data(#[from] cifar::CifarError),
    /// A checkpoint cannot be saved or loaded.
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    /// The training curves cannot be written.
    #[error("cannot write the training curves to {path}: {message}")]
    Curves {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        message: String,
    },
}

impl TrainError {
    /// Whether the error says that the CUDA executor cannot run on this machine (no device,
    /// no cuDNN, no NVRTC, a layer without a route), as opposed to a failure while running.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            TrainError::NoDevice { .. }
                | TrainError::NoCudnn { .. }
                | TrainError::NoNvrtc { .. }
                | TrainError::NoRoute { .. }
        )
    }
}

impl From<cudnn_cbr::classifier::ClassifierError> for TrainError {
    fn from(e: cudnn_cbr::classifier::ClassifierError) -> Self {
        use cudnn_cbr::classifier::ClassifierError as C;
        match e {
            C::Fusion(e) => TrainError::Fusion(e),
            C::Amp(e) => cuda::amp_error(e),
            C::Net(e) => cuda::net_error(e),
            C::Driver { what, message } => TrainError::Driver { what, message },
            C::Input(m) | C::Config(m) => TrainError::Config(m),
            C::NoDevice { reason } => TrainError::NoDevice { reason },
            C::NoCudnn { reason } => TrainError::NoCudnn { reason },
            C::NoNvrtc { reason } => TrainError::NoNvrtc { reason },
        }
    }
}
