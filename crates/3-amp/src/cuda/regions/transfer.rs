//! Host transfers of [`CudaRegions`]: parameters, whole regions and S copied in (in stream
//! order) and out (waiting for the stream: for checkpoints and tests, not the loop).

use half::f16;

use super::CudaRegions;
use crate::cuda::driver_error;
use crate::error::{AmpError, ExecError};
use crate::plan::{ByteRange, DataType, Region};
use crate::range::Scalars;

// Named only by doc links.
#[cfg(doc)]
use crate::step::AmpExecutor;

fn wrong_dtype(op: &'static str, region: Region, want: DataType) -> AmpError {
    ExecError::WrongRegion {
        op,
        region,
        role: "typed transfer",
        needs: match want {
            DataType::Half => "an FP16 region (A, G16, E16)",
            // Regions hold FP16 or FP32 only.
            _ => "an FP32 region (W, G, M, E)",
        },
    }
    .into()
}

impl CudaRegions {
    pub(super) fn upload_bytes(
        &mut self,
        region: Region,
        at: ByteRange,
        bytes: &[u8],
    ) -> Result<(), AmpError> {
        let stream = self.stream.clone();
        self.order_after_collectives(&stream, region, at)?;
        let buf = &mut self.get_mut(region)?.buf;
        let mut view = buf.slice_mut(at.start..at.end);
        stream
            .memcpy_htod(bytes, &mut view)
            .map_err(|e| driver_error(format!("copy into region {region}"), e))
    }

    fn download_bytes(&self, region: Region, at: ByteRange) -> Result<Vec<u8>, AmpError> {
        self.order_after_collectives(&self.stream, region, at)?;
        let view = self.get(region)?.buf.slice(at.start..at.end);
        self.stream
            .clone_dtoh(&view)
            .map_err(|e| driver_error(format!("copy out of region {region}"), e))
    }

    fn data_range(
        &self,
        name: &str,
        region: Region,
        want: DataType,
        op: &'static str,
        elems: Option<usize>,
    ) -> Result<ByteRange, AmpError> {
        let v = self.plan.view(name, region)?;
        if v.dtype != want {
            return Err(wrong_dtype(op, region, want));
        }
        if let Some(n) = elems {
            if n != v.elems {
                return Err(crate::RangeOpError::LengthMismatch {
                    op,
                    what: "data",
                    expected: v.elems,
                    got: n,
                }
                .into());
            }
        }
        Ok(v.data_range())
    }

    /// Copies `data` into parameter `name`'s slot of FP32 `region` (asynchronously: the host
    /// data is staged at once, the copy runs in stream order).
    ///
    /// # Errors
    /// [`crate::RangeOpError::LengthMismatch`] when `data` is not the parameter's element
    /// count, [`ExecError::WrongRegion`] for an FP16 region, plan lookup errors; a driver
    /// error.
    pub fn upload_f32(&mut self, region: Region, name: &str, data: &[f32]) -> Result<(), AmpError> {
        let r = self.data_range(
            name,
            region,
            DataType::Float,
            "upload_f32",
            Some(data.len()),
        )?;
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.upload_bytes(region, r, &bytes)
    }

    /// Copies `data` into parameter `name`'s slot of FP16 `region` (e.g. a conv gradient
    /// into G16).
    ///
    /// # Errors
    /// As [`CudaRegions::upload_f32`].
    pub fn upload_f16(&mut self, region: Region, name: &str, data: &[f16]) -> Result<(), AmpError> {
        let r = self.data_range(name, region, DataType::Half, "upload_f16", Some(data.len()))?;
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.upload_bytes(region, r, &bytes)
    }

    /// Overwrites a whole region from its byte image (little-endian; S is its 256 bytes).
    ///
    /// # Errors
    /// [`ExecError::OutOfBounds`] when `bytes` is not the region's length; a driver error.
    pub fn upload_region_bytes(&mut self, region: Region, bytes: &[u8]) -> Result<(), AmpError> {
        let len = self.plan.region_range(region)?.len();
        if bytes.len() != len {
            return Err(ExecError::OutOfBounds {
                op: "upload_region_bytes",
                what: region.to_string(),
                start: 0,
                end: bytes.len(),
                len,
            }
            .into());
        }
        if region == Region::S {
            Scalars::from_bytes(bytes)?;
        }
        self.upload_bytes(region, ByteRange::new(0, len), bytes)
    }

    /// Reads parameter `name` out of FP32 `region`. Waits for the stream: for checkpoints
    /// and tests, not for the training loop.
    ///
    /// # Errors
    /// [`ExecError::WrongRegion`] for an FP16 region, plan lookup errors; a driver error.
    pub fn download_f32(&self, region: Region, name: &str) -> Result<Vec<f32>, AmpError> {
        let r = self.data_range(name, region, DataType::Float, "download_f32", None)?;
        let bytes = self.download_bytes(region, r)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Reads parameter `name` out of FP16 `region`. Waits for the stream.
    ///
    /// # Errors
    /// As [`CudaRegions::download_f32`].
    pub fn download_f16(&self, region: Region, name: &str) -> Result<Vec<f16>, AmpError> {
        let r = self.data_range(name, region, DataType::Half, "download_f16", None)?;
        let bytes = self.download_bytes(region, r)?;
        Ok(bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]))
            .collect())
    }

    /// A whole region's bytes (S: its 256-byte image). Waits for the stream.
    ///
    /// # Errors
    /// [`crate::PlanError::RegionAbsent`]; a driver error.
    pub fn download_region_bytes(&self, region: Region) -> Result<Vec<u8>, AmpError> {
        let len = self.plan.region_range(region)?.len();
        self.download_bytes(region, ByteRange::new(0, len))
    }

    /// Waits for the stream, then reads S. For tests and the end of a run; in the loop use
    /// [`AmpExecutor::request_scalars`] and [`AmpExecutor::poll_scalars`].
    ///
    /// # Errors
    /// A driver error.
    pub fn read_scalars_blocking(&self) -> Result<Scalars, AmpError> {
        let bytes = self.download_region_bytes(Region::S)?;
        Ok(Scalars::from_bytes(&bytes)?)
    }
}
