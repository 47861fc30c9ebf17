//! Evaluating with the EMA weights on the device, where the network and the head read the
//! trained ones.
//!
//! A network binds its conv weights to their slots in A and its BN and FC parameters to W. E16
//! has A's layout and E has W's (one FP16 layout, the FP32 regions at twice its offsets:
//! [`crate::plan`]), so evaluating with the EMA is evaluating with A and W holding E16's and
//! E's bytes: [`CudaRegions::swap_in_ema`] copies A and W aside on the device and E16 and E
//! over them, [`CudaRegions::swap_back`] copies the trained weights back, bit for bit. Every
//! copy is device to device in the regions' stream order: nothing waits for the host. The
//! evaluation then reads what the CPU step's EMA evaluation reads: conv weights from E16 (the
//! FP16 copy is what inference reads), BN and FC parameters from E.

use super::{driver_error, CudaRegions, CudaSlice};
use crate::error::AmpError;
use crate::plan::Region;

/// The trained A and W, kept aside while the EMA's bytes are in their place
/// ([`CudaRegions::swap_in_ema`]); give it back to [`CudaRegions::swap_back`].
#[derive(Debug)]
#[must_use = "the trained weights come back only through CudaRegions::swap_back"]
pub struct TrainedWeights {
    a: CudaSlice<u8>,
    w: CudaSlice<u8>,
}

impl CudaRegions {
    /// Puts the EMA weights where the trained ones are read (module docs), keeping the trained
    /// ones aside.
    ///
    /// # Errors
    /// [`crate::PlanError::RegionAbsent`] for a plan without the EMA regions; a driver error.
    pub fn swap_in_ema(&mut self) -> Result<TrainedWeights, AmpError> {
        let stream = self.stream().clone();
        let keep = |regions: &Self, r: Region| -> Result<CudaSlice<u8>, AmpError> {
            stream
                .clone_dtod(regions.region(r)?)
                .map_err(|e| driver_error(format!("keep region {r} aside"), e))
        };
        // Checked before anything is copied, so a plan without an EMA changes nothing.
        self.region(Region::E16)?;
        self.region(Region::E)?;
        let aside = TrainedWeights {
            a: keep(self, Region::A)?,
            w: keep(self, Region::W)?,
        };
        for (from, to) in [(Region::E16, Region::A), (Region::E, Region::W)] {
            // Both regions borrowed at once (same lengths: one layout).
            let (mut src, mut dst) = (None, None);
            for (r, slice) in self.regions_mut() {
                if r == from {
                    src = Some(slice);
                } else if r == to {
                    dst = Some(slice);
                }
            }
            let (Some(src), Some(dst)) = (src, dst) else {
                return Err(crate::PlanError::RegionAbsent { region: from }.into());
            };
            stream
                .memcpy_dtod(&*src, dst)
                .map_err(|e| driver_error(format!("copy region {from} over {to}"), e))?;
        }
        Ok(aside)
    }

    /// Puts the trained weights kept by [`CudaRegions::swap_in_ema`] back, bit for bit.
    ///
    /// # Errors
    /// A driver error.
    pub fn swap_back(&mut self, aside: TrainedWeights) -> Result<(), AmpError> {
        let stream = self.stream().clone();
        for (r, kept) in [(Region::A, &aside.a), (Region::W, &aside.w)] {
            stream
                .memcpy_dtod(kept, self.region_mut(r)?)
                .map_err(|e| driver_error(format!("restore region {r}"), e))?;
        }
        Ok(())
    }
}
