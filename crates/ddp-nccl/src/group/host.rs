//! The host-slice helpers of [`NcclGroup`]: each stages through device memory and runs the
//! device collective.

use cudarc::driver::CudaSlice;

use super::NcclGroup;
use crate::comm::cuda_error;
use crate::element::NcclElement;
use ddp_comm::ReduceOp;
use ddp_comm::error::{CommError, Result};

impl NcclGroup {
    /// [`NcclGroup::all_reduce`] on a host slice, staged through device memory.
    /// An empty slice returns at once (it must be empty on every rank).
    pub fn all_reduce_host<T: NcclElement>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.usable()?;
        if buf.is_empty() {
            return Ok(());
        }
        let mut dev = self.to_device(buf)?;
        self.all_reduce(&mut dev, op)?;
        self.copy_back(&dev, buf)
    }

    /// [`NcclGroup::broadcast`] on a host slice, staged through device memory.
    pub fn broadcast_host<T: NcclElement>(&mut self, buf: &mut [T], root: usize) -> Result<()> {
        self.usable()?;
        self.check_root(root, "broadcast")?;
        if buf.is_empty() {
            return Ok(());
        }
        let mut dev = self.to_device(buf)?;
        self.broadcast(&mut dev, root)?;
        self.copy_back(&dev, buf)
    }

    /// [`NcclGroup::all_gather`] on host slices (`output.len() == input.len() * world_size`),
    /// staged through device memory.
    pub fn all_gather_host<T: NcclElement>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        self.usable()?;
        if output.len() != input.len().saturating_mul(self.world_size) {
            return Err(CommError::InvalidArgument(format!(
                "all_gather: output holds {} elements but input ({}) x world size ({}) = {}",
                output.len(),
                input.len(),
                self.world_size,
                input.len().saturating_mul(self.world_size)
            )));
        }
        if input.is_empty() {
            return Ok(());
        }
        let dev_in = self.to_device(input)?;
        let mut dev_out = self
            .stream
            .alloc_zeros::<T>(output.len())
            .map_err(|e| cuda_error("allocating the gather buffer", e))?;
        self.all_gather(&dev_in, &mut dev_out)?;
        self.copy_back(&dev_out, output)
    }

    fn to_device<T: NcclElement>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        self.stream
            .clone_htod(host)
            .map_err(|e| cuda_error("copying to the device", e))
    }

    fn copy_back<T: NcclElement>(&mut self, dev: &CudaSlice<T>, host: &mut [T]) -> Result<()> {
        // The collective has completed, so this synchronous copy cannot wait on a peer.
        self.stream
            .memcpy_dtoh(dev, host)
            .map_err(|e| cuda_error("copying back to the host", e))?;
        self.ctx
            .check_err()
            .map_err(|e| cuda_error("copying back to the host", e))
    }
}
