//! `cudnnStatus_t` → `Result`, with cuDNN's own explanation attached.

use crate::bindings::cudnnStatus_t;
use std::ffi::CStr;

/// A cuDNN call that did not return `CUDNN_STATUS_SUCCESS`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cuDNN {name} ({code}){}", if message.is_empty() { String::new() } else { format!(": {message}") })]
pub struct CudnnError {
    /// The raw status.
    pub status: cudnnStatus_t,
    /// The numeric status, for matching on codes the bindings do not name.
    pub code: u32,
    /// `cudnnGetErrorString` of the status (e.g. `CUDNN_STATUS_BAD_PARAM`).
    pub name: String,
    /// `cudnnGetLastErrorString` at the time of the failure (may be empty).
    pub message: String,
}

impl cudnnStatus_t {
    /// `Ok(())` for `CUDNN_STATUS_SUCCESS`, otherwise a [`CudnnError`] naming the status and
    /// carrying cuDNN's last error text (read from the loaded library, when there is one).
    pub fn result(self) -> Result<(), CudnnError> {
        if self == cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            return Ok(());
        }
        let (name, message) = match crate::loader::loaded() {
            Some(lib) => (lib.error_string(self), lib.last_error_string()),
            None => (format!("status {}", self.0), String::new()),
        };
        Err(CudnnError {
            status: self,
            code: self.0,
            name,
            message,
        })
    }

    /// Whether this is `CUDNN_STATUS_SUCCESS`.
    pub fn is_success(self) -> bool {
        self == cudnnStatus_t::CUDNN_STATUS_SUCCESS
    }
}

/// Copies a NUL-terminated C string owned by cuDNN into a `String` (lossy, empty for null).
///
/// # Safety
/// `ptr` must be null or point to a NUL-terminated string valid for the duration of the call.
pub(crate) unsafe fn c_str_lossy(ptr: *const std::os::raw::c_char) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: the caller guarantees a valid NUL-terminated string.
    unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}
