//! The CUDA glue of burn-ddp, in one module: NCCL on device memory ([`nccl`]), the choice of
//! each rank's device with the CUDA toolkit files its kernels need, and [`DeviceComm`], the
//! communicator through which gradient sync, the sharded optimizer's reduce-scatter and
//! SyncBatchNorm reach device memory. Both of its implementations make their calls through
//! [`ddp_comm::Collectives`]: NCCL's on device buffers, the stand-in's on the host group.
//!
//! The module is compiled in every build. [`DeviceComm`] has one variant per implementation:
//! NCCL (feature `cuda`) and, in unit tests, a host-staged stand-in over the process group, so
//! that CPU tests run the device path's own logic (buckets packed and sliced on the device,
//! SyncBatchNorm's device exchange) against the host path. In a build without either it is a
//! type with no values and `Option<DeviceComm>` is always `None`. The code that uses it
//! compiles and is type-checked in every build, and needs no `cfg(feature = "cuda")` of its
//! own: the feature's switches are here and on the public items that exist only with it.

#[cfg(feature = "cuda")]
pub mod nccl;
mod policy;
#[cfg(all(test, feature = "cuda"))]
mod smoke;

pub(crate) use policy::NcclSetting;
pub use policy::{NCCL_POLICY_VAR, NcclPolicy};

#[cfg(feature = "cuda")]
mod enabled;
#[cfg(feature = "cuda")]
use enabled as device;
#[cfg(feature = "cuda")]
pub(crate) use enabled::ENABLED;

#[cfg(not(feature = "cuda"))]
mod disabled;
#[cfg(not(feature = "cuda"))]
use disabled as device;
#[cfg(not(feature = "cuda"))]
pub(crate) use disabled::ENABLED;

#[cfg(test)]
mod host_staged;

use burn::backend::Backend;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{Device, Tensor};
use ddp_comm::{Compression, GroupOptions, LaunchEnv, ReduceOp};

use crate::comm::SharedGroup;
use crate::error::Result;

/// Where a rank runs its model.
#[derive(Debug, Clone, Default)]
pub(crate) enum DeviceChoice {
    /// CUDA device `LOCAL_RANK` when a CUDA device is usable, else the CPU (Flex).
    #[default]
    Auto,
    /// CUDA device `LOCAL_RANK`, required ([`crate::DdpBuilder::cuda`]).
    Cuda,
    /// A device chosen by the caller.
    Fixed(Device),
}

impl DeviceChoice {
    /// The device of the rank with this local rank, checked to be usable (a CUDA device must
    /// exist, and the toolkit files its kernels need are found first).
    ///
    /// # Errors
    /// CUDA asked for and unusable, or absent from this build.
    pub(crate) fn resolve(self, local_rank: usize, local_world_size: usize) -> Result<Device> {
        match self {
            DeviceChoice::Fixed(d) => {
                device::check_device(&d)?;
                Ok(d)
            }
            DeviceChoice::Auto => device::auto_device(local_rank, local_world_size),
            DeviceChoice::Cuda => device::cuda_device(local_rank, local_world_size),
        }
    }
}

/// Collectives on the memory of this rank's device, for the gradient device path and
/// SyncBatchNorm's device exchange (see the [module docs](self)).
#[derive(Debug, Clone)]
pub(crate) enum DeviceComm {
    /// NCCL on this rank's CUDA device.
    #[cfg(feature = "cuda")]
    Nccl(enabled::NcclComm),
    /// Unit tests only: the same calls staged through the host process group.
    #[cfg(test)]
    Host(host_staged::HostStaged),
}

// Without `cuda` and outside tests the type has no values: its methods' bodies are empty
// matches that never look at their arguments.
#[cfg_attr(not(any(feature = "cuda", test)), allow(unused_variables))]
impl DeviceComm {
    /// The NCCL communicator `nccl`, on its device.
    #[cfg(feature = "cuda")]
    pub(crate) fn nccl(nccl: nccl::SharedNccl) -> Self {
        DeviceComm::Nccl(enabled::NcclComm::new(nccl))
    }

    /// The host-staged stand-in over `group` (unit tests).
    #[cfg(test)]
    pub(crate) fn host_staged(group: SharedGroup) -> Self {
        DeviceComm::Host(host_staged::HostStaged::new(group))
    }

    /// The NCCL communicator, if this is one.
    #[cfg(feature = "cuda")]
    pub(crate) fn shared(&self) -> Option<&nccl::SharedNccl> {
        match self {
            DeviceComm::Nccl(n) => Some(n.shared()),
            #[cfg(test)]
            DeviceComm::Host(_) => None,
        }
    }

    /// The process-wide communicator, if one is installed.
    #[cfg(feature = "cuda")]
    pub(crate) fn installed() -> Option<DeviceComm> {
        enabled::NcclComm::installed().map(DeviceComm::Nccl)
    }

    /// The process-wide communicator: none in a build without `cuda`.
    #[cfg(not(feature = "cuda"))]
    pub(crate) fn installed() -> Option<DeviceComm> {
        None
    }

    /// This rank's communicator, created and installed when there is none yet and every rank
    /// can use NCCL; `None` otherwise. Every rank must call it at the same point.
    ///
    /// # Errors
    /// A host collective failed; NCCL was required and some rank cannot use it.
    #[cfg(feature = "cuda")]
    pub(crate) fn connect(
        env: &LaunchEnv,
        group: &SharedGroup,
        options: &GroupOptions,
        device: &Device,
        setting: NcclSetting,
    ) -> Result<Option<DeviceComm>> {
        Ok(enabled::NcclComm::connect(env, group, options, device, setting)?.map(DeviceComm::Nccl))
    }

    /// This rank's communicator: none in a build without `cuda`.
    ///
    /// # Errors
    /// NCCL was required ([`NcclPolicy::Required`]).
    #[cfg(not(feature = "cuda"))]
    pub(crate) fn connect(
        _env: &LaunchEnv,
        _group: &SharedGroup,
        _options: &GroupOptions,
        _device: &Device,
        setting: NcclSetting,
    ) -> Result<Option<DeviceComm>> {
        disabled::refuse_required_nccl(setting)?;
        Ok(None)
    }

    /// Whether this is an NCCL communicator.
    fn is_nccl(&self) -> bool {
        match *self {
            #[cfg(feature = "cuda")]
            DeviceComm::Nccl(_) => true,
            #[cfg(test)]
            DeviceComm::Host(_) => false,
        }
    }

    /// Live recovery, on a survivor before its host group re-forms: aborts `comm`'s NCCL
    /// communicator (a kernel still waiting on the lost rank returns; see
    /// [`DeviceComm::reform`] for the next one).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn abort(comm: Option<&DeviceComm>) {
        #[cfg(feature = "cuda")]
        if let Some(DeviceComm::Nccl(n)) = comm {
            n.abort();
        }
    }

    /// Live recovery, on a survivor once its host `group` re-formed: the survivors tell the
    /// group, the lost rank's replacement included (in [`DeviceComm::rejoin`]), whether the
    /// ranks use NCCL; then `comm`'s NCCL communicator is aborted and created again with the
    /// replacement's. Every survivor calls it at the same point.
    ///
    /// # Errors
    /// The announcement's broadcast; creating the communicator.
    // Without `cuda` there is no communicator to re-create or join.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn reform(
        comm: Option<&DeviceComm>,
        group: &SharedGroup,
        options: &GroupOptions,
    ) -> Result<()> {
        if !announce_nccl(group, comm.is_some_and(DeviceComm::is_nccl))? {
            return Ok(());
        }
        match comm {
            #[cfg(feature = "cuda")]
            Some(DeviceComm::Nccl(n)) => n.recreate(group, options),
            _ => Ok(()),
        }
    }

    /// Live recovery, on a replacement right after it joined the running host `group`: hears
    /// from the survivors whether the ranks use NCCL ([`DeviceComm::reform`] on the survivors) and,
    /// if they do, creates its communicator on `device` with theirs.
    ///
    /// # Errors
    /// The announcement's broadcast; the ranks use NCCL and this one cannot; creating the
    /// communicator.
    // Without `cuda` there is no communicator to re-create or join.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn rejoin(
        env: &LaunchEnv,
        group: &SharedGroup,
        options: &GroupOptions,
        device: &Device,
    ) -> Result<Option<DeviceComm>> {
        if !announce_nccl(group, false)? {
            return Ok(None);
        }
        #[cfg(feature = "cuda")]
        {
            let nccl = enabled::NcclComm::rejoin(env, group, options, device)?;
            Ok(Some(DeviceComm::Nccl(nccl)))
        }
        #[cfg(not(feature = "cuda"))]
        {
            disabled::refuse_nccl_rejoin()?;
            Ok(None)
        }
    }

    /// The number of ranks.
    pub(crate) fn world_size(&self) -> usize {
        match *self {
            #[cfg(feature = "cuda")]
            DeviceComm::Nccl(ref n) => n.world_size(),
            #[cfg(test)]
            DeviceComm::Host(ref h) => h.world_size(),
        }
    }

    /// Whether `device` is the communicator's device.
    pub(crate) fn holds(&self, device: &Device) -> bool {
        match *self {
            #[cfg(feature = "cuda")]
            DeviceComm::Nccl(ref n) => n.holds(device),
            #[cfg(test)]
            DeviceComm::Host(ref h) => h.holds(device),
        }
    }

    /// The element-wise reduction (`op`) over all ranks of every f32 tensor, each travelling
    /// as `compression` says.
    pub(crate) fn all_reduce_many(
        &self,
        tensors: Vec<Tensor<1>>,
        op: ReduceOp,
        compression: Compression,
    ) -> Result<Vec<Tensor<1>>> {
        match *self {
            #[cfg(feature = "cuda")]
            DeviceComm::Nccl(ref n) => n.all_reduce_many(tensors, op, compression),
            #[cfg(test)]
            DeviceComm::Host(ref h) => h.all_reduce_many(tensors, op, compression),
        }
    }

    /// The f32 tensor `packed`, one shard per rank in rank order (rank `p`'s of `counts[p]`
    /// values), reduced (`op`) across ranks with this rank's shard kept: returns `packed`'s
    /// length with this rank's shard reduced (the rest unspecified), values on the wire as
    /// `compression` says.
    pub(crate) fn reduce_scatter(
        &self,
        packed: Tensor<1>,
        counts: &[usize],
        op: ReduceOp,
        compression: Compression,
    ) -> Result<Tensor<1>> {
        match *self {
            #[cfg(feature = "cuda")]
            DeviceComm::Nccl(ref n) => n.reduce_scatter(packed, counts, op, compression),
            #[cfg(test)]
            DeviceComm::Host(ref h) => h.reduce_scatter(packed, counts, op, compression),
        }
    }

    /// Every rank's shard of the f32 tensor `buf` (rank `p`'s of `counts[p]` values, in rank
    /// order) gathered into every rank's copy: returns `buf` with every shard its owner's.
    pub(crate) fn all_gather_into(&self, buf: Tensor<1>, counts: &[usize]) -> Result<Tensor<1>> {
        match *self {
            #[cfg(feature = "cuda")]
            DeviceComm::Nccl(ref n) => n.all_gather_into(buf, counts),
            #[cfg(test)]
            DeviceComm::Host(ref h) => h.all_gather_into(buf, counts),
        }
    }

    /// Every rank's f32 tensor (the same length everywhere), concatenated in rank order.
    pub(crate) fn all_gather(&self, local: Tensor<1>) -> Result<Tensor<1>> {
        match *self {
            #[cfg(feature = "cuda")]
            DeviceComm::Nccl(ref n) => n.all_gather(local),
            #[cfg(test)]
            DeviceComm::Host(ref h) => h.all_gather(local),
        }
    }

    /// The sum over all ranks of a `[rows, channels]` backend tensor (inside an autodiff
    /// backward pass, where the backend is only known generically).
    pub(crate) fn all_reduce_sum<B: Backend>(
        &self,
        local: FloatTensor<B>,
    ) -> Result<FloatTensor<B>> {
        match *self {
            #[cfg(feature = "cuda")]
            DeviceComm::Nccl(ref n) => n.all_reduce_sum::<B>(local),
            #[cfg(test)]
            DeviceComm::Host(ref h) => h.all_reduce_sum::<B>(local),
        }
    }
}

/// Whether the job's ranks use NCCL, as the survivors of a lost rank say (`uses_nccl`: the
/// same on every survivor; a replacement, whichever its rank, says `false`): a one-byte
/// max-all-reduce over the host `group`.
///
/// # Errors
/// The all-reduce's.
fn announce_nccl(group: &SharedGroup, uses_nccl: bool) -> Result<bool> {
    let mut flag = [u8::from(uses_nccl)];
    crate::comm::lock(group).all_reduce(&mut flag, ddp_comm::ReduceOp::Max)?;
    Ok(flag[0] == 1)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use burn::tensor::Device;
    use ddp_comm::{GroupOptions, LaunchEnv, ProcessGroup};

    use super::*;
    use crate::error::DdpError;

    /// CUDA asked of a build without the `cuda` feature, or of a machine without a GPU: one
    /// clear error, in every build (a GPU machine gets its device).
    #[test]
    fn cuda_without_the_feature_or_a_device_is_one_clear_error() {
        match (ENABLED, DeviceChoice::Cuda.resolve(0, 1)) {
            // A machine with a GPU.
            (true, Ok(_)) => {}
            (true, Err(e)) => assert!(
                e.to_string()
                    .starts_with("no usable device for this rank: "),
                "{e}"
            ),
            (false, Err(e)) => {
                assert!(matches!(e, DdpError::InvalidSetting { .. }), "{e:?}");
                assert!(e.to_string().contains("`cuda` feature"), "{e}");
            }
            (false, Ok(device)) => panic!("a build without cuda gave {device:?}"),
        }
    }

    /// `NcclPolicy::Required` where NCCL cannot run (a CPU device, or a build without `cuda`)
    /// fails `init`'s connection step with `NcclUnavailable`; the other policies take the host
    /// path.
    #[test]
    fn nccl_required_on_the_cpu_is_an_error_and_auto_is_the_host_path() {
        let env = LaunchEnv::single_process();
        let group = Arc::new(Mutex::new(ProcessGroup::single()));
        let connect = |policy| {
            DeviceComm::connect(
                &env,
                &group,
                &GroupOptions::default(),
                &Device::flex(),
                NcclSetting::chosen(policy),
            )
        };
        let err = connect(NcclPolicy::Required).unwrap_err();
        assert!(matches!(err, DdpError::NcclUnavailable(_)), "{err:?}");
        for policy in [NcclPolicy::Auto, NcclPolicy::Disabled] {
            assert!(connect(policy).unwrap().is_none(), "{policy:?}");
        }
    }
}
