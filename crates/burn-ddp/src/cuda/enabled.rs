//! The CUDA glue in a build with the `cuda` feature: each rank's CUDA device and the toolkit
//! files its kernels need, and [`NcclComm`], NCCL on that device.

use std::any::Any;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Cube, TensorMetadata};
use burn::tensor::{DType, Device, Tensor};
use ddp_comm::{Compression, GroupOptions, LaunchEnv, ReduceOp};

use super::NcclSetting;
use super::nccl::{self, SharedNccl};
use crate::comm::SharedGroup;
use crate::error::{DdpError, Result};

/// Whether this build has the CUDA path.
pub(crate) const ENABLED: bool = true;

/// This rank's NCCL communicator and its CUDA device: collectives on device memory.
#[derive(Clone)]
pub(crate) struct NcclComm {
    nccl: SharedNccl,
    ordinal: usize,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl NcclComm {
    /// The communicator `nccl`, on its device.
    pub(crate) fn new(nccl: SharedNccl) -> Self {
        let ordinal = nccl::lock(&nccl).device_ordinal();
        NcclComm { nccl, ordinal }
    }

    /// The NCCL communicator.
    pub(crate) fn shared(&self) -> &SharedNccl {
        &self.nccl
    }

    /// The process-wide communicator, if one is installed.
    pub(crate) fn installed() -> Option<NcclComm> {
        nccl::installed().map(NcclComm::new)
    }

    /// The process-wide communicator, created and installed when there is none yet and every
    /// rank can use NCCL (see [`nccl::connect`]). Every rank must call it at the same point.
    pub(crate) fn connect(
        env: &LaunchEnv,
        group: &SharedGroup,
        options: &GroupOptions,
        device: &Device,
        setting: NcclSetting,
    ) -> Result<Option<NcclComm>> {
        if let Some(n) = nccl::installed() {
            tracing::debug!("reusing the NCCL communicator already installed");
            return Ok(Some(NcclComm::new(n)));
        }
        let created = nccl::connect(env, group, options, device, setting.policy()?)?;
        Ok(created.map(|n| NcclComm::new(nccl::install(n).0)))
    }

    /// Live recovery, first thing on a survivor: aborts the communicator, so that a collective
    /// still waiting on the lost rank returns before the host group re-forms (c10d's order).
    pub(crate) fn abort(&self) {
        nccl::lock(&self.nccl).abort();
    }

    /// Live recovery on a survivor: the communicator re-created with the group's replacement
    /// (see [`nccl::recreate`]).
    pub(crate) fn recreate(&self, group: &SharedGroup, options: &GroupOptions) -> Result<()> {
        nccl::recreate(group, options, &self.nccl)
    }

    /// Live recovery on a replacement: its communicator, created with the survivors' and
    /// installed (see [`nccl::rejoin`]).
    pub(crate) fn rejoin(
        env: &LaunchEnv,
        group: &SharedGroup,
        options: &GroupOptions,
        device: &Device,
    ) -> Result<NcclComm> {
        Ok(NcclComm::new(nccl::rejoin(env, group, options, device)?))
    }

    /// The number of ranks.
    pub(crate) fn world_size(&self) -> usize {
        nccl::lock(&self.nccl).world_size()
    }

    /// Whether `device` is the communicator's CUDA device.
    pub(crate) fn holds(&self, device: &Device) -> bool {
        nccl::cuda_ordinal(device) == Some(self.ordinal)
    }

    /// The element-wise reduction (`op`) over all ranks of every f32 tensor, in one NCCL group
    /// call, each travelling as `compression` says (see [`nccl::all_reduce_many_as`]).
    pub(crate) fn all_reduce_many(
        &self,
        tensors: Vec<Tensor<1>>,
        op: ReduceOp,
        compression: Compression,
    ) -> Result<Vec<Tensor<1>>> {
        nccl::all_reduce_many_as(&mut nccl::lock(&self.nccl), tensors, op, compression)
    }

    /// `packed` reduce-scattered by NCCL (see `DeviceComm::reduce_scatter`).
    pub(crate) fn reduce_scatter(
        &self,
        packed: Tensor<1>,
        counts: &[usize],
        op: ReduceOp,
        compression: Compression,
    ) -> Result<Tensor<1>> {
        nccl::reduce_scatter(&mut nccl::lock(&self.nccl), packed, counts, op, compression)
    }

    /// `buf`'s shards all-gathered by NCCL (see `DeviceComm::all_gather_into`).
    pub(crate) fn all_gather_into(&self, buf: Tensor<1>, counts: &[usize]) -> Result<Tensor<1>> {
        nccl::all_gather_into(&mut nccl::lock(&self.nccl), buf, counts)
    }

    /// Every rank's f32 tensor (the same length everywhere), concatenated in rank order.
    pub(crate) fn all_gather(&self, local: Tensor<1>) -> Result<Tensor<1>> {
        nccl::all_gather(&mut nccl::lock(&self.nccl), local)
    }

    /// The sum over all ranks of a `[rows, channels]` backend tensor (inside an autodiff
    /// backward pass, where the backend is only known generically: it must be Burn's `Cube`
    /// backend on the communicator's device).
    pub(crate) fn all_reduce_sum<B: Backend>(
        &self,
        local: FloatTensor<B>,
    ) -> Result<FloatTensor<B>> {
        let dtype = local.dtype();
        let [rows, channels] = local.shape().dims();
        let cube = downcast::<B, Cube>(local).map_err(|_| DdpError::InvalidSetting {
            setting: "SyncBatchNorm's device",
            reason: "NCCL carries SyncBatchNorm's collectives, but this layer runs on a \
                         non-CUDA backend; every rank must train on its CUDA device"
                .into(),
        })?;
        let flat = Tensor::<2>::from_primitive::<Cube>(cube)
            .cast(DType::F32)
            .reshape([rows * channels]);
        let summed = nccl::all_reduce(&mut nccl::lock(&self.nccl), flat, ReduceOp::Sum)?;
        let cube = summed
            .reshape([rows, channels])
            .cast(dtype)
            .try_into_primitive::<Cube>()
            .map_err(|e| DdpError::TensorData {
                what: "SyncBatchNorm sums (NCCL path)".into(),
                msg: format!("{e:?}"),
            })?;
        Ok(downcast::<Cube, B>(cube).unwrap_or_else(|_| unreachable!("the tensor came from B")))
    }
}

/// `Ok` when `FloatTensor<From>` is the same type as `FloatTensor<To>` (the backends are
/// only known generically inside the autodiff backward pass).
fn downcast<From: Backend, To: Backend>(
    t: FloatTensor<From>,
) -> std::result::Result<FloatTensor<To>, FloatTensor<From>> {
    let boxed: Box<dyn Any> = Box::new(t);
    match boxed.downcast::<FloatTensor<To>>() {
        Ok(t) => Ok(*t),
        Err(boxed) => Err(*boxed
            .downcast::<FloatTensor<From>>()
            .expect("the box holds a FloatTensor<From>")),
    }
}

/// CUDA device `LOCAL_RANK` when the driver reports any device, else Flex with a warning.
pub(super) fn auto_device(local_rank: usize, local_world_size: usize) -> Result<Device> {
    match ddp_nccl::visible_cuda_devices() {
        Ok(n) if n > 0 => cuda_device(local_rank, local_world_size),
        found => {
            let why = match found {
                Ok(_) => "no CUDA device is visible".to_string(),
                Err(e) => e.to_string(),
            };
            tracing::warn!(
                "no usable CUDA device ({why}): this rank runs on the CPU (Flex); ask for CUDA \
                 with `DdpBuilder::cuda` to make that an error. Burn's own default device \
                 (`Device::default()`, where a loaded optimizer state is first put) is still \
                 CUDA in this build unless BURN_DEVICE names another (e.g. BURN_DEVICE=flex)"
            );
            Ok(Device::flex())
        }
    }
}

/// CUDA device `LOCAL_RANK` (device 0 when the rank sees only one), checked to exist.
pub(super) fn cuda_device(local_rank: usize, local_world_size: usize) -> Result<Device> {
    let ordinal = ddp_nccl::cuda_device_for_local_rank(local_rank, local_world_size)
        .map_err(DdpError::Device)?;
    prepare_libdevice()?;
    Ok(Device::cuda(ordinal))
}

/// Makes cubecl-llvm find `libdevice.10.bc` (toolkit folders, pip wheels), so the first kernel
/// that calls exp/log does not fail mid-step: see [`ddp_nccl::cuda_toolkit::prepare_libdevice`].
fn prepare_libdevice() -> Result<()> {
    let found = ddp_nccl::cuda_toolkit::prepare_libdevice()?;
    tracing::info!(
        libdevice = %found.file.display(),
        cuda_path = %found.cuda_path.display(),
        "libdevice found for the CUDA kernels"
    );
    #[cfg(feature = "cuda-nvrtc")]
    prepare_nvrtc(&found.cuda_path)?;
    Ok(())
}

/// With the CUDA C++ backend (`cuda-nvrtc`): NVRTC must load under a name cudarc tries, and
/// `CUDA_PATH/include` must hold the CUDA headers (linked there from a toolkit or pip's
/// `nvidia-cuda-runtime` when `CUDA_PATH` is burn-ddp's own link folder), or the first kernel
/// would panic inside cubecl. See [`ddp_nccl::nvrtc_files`].
#[cfg(feature = "cuda-nvrtc")]
fn prepare_nvrtc(cuda_path: &std::path::Path) -> Result<()> {
    use ddp_nccl::cuda_toolkit::ToolkitError;
    use ddp_nccl::nvrtc_files;
    let device_err = DdpError::Toolkit;
    // SAFETY: only dlopen/dlclose of the names cudarc tries.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        let file = nvrtc_files::find_nvrtc().map_err(device_err)?;
        return Err(device_err(ToolkitError::NvrtcNotLinked { file }));
    }
    match nvrtc_files::find_headers() {
        Ok(headers) => {
            nvrtc_files::link_headers(cuda_path, &headers).map_err(device_err)?;
            tracing::info!(headers = %headers.display(), "CUDA headers for NVRTC");
            Ok(())
        }
        Err(_)
            if cuda_path
                .join("include")
                .join(nvrtc_files::PROBE_HEADER)
                .is_file() =>
        {
            Ok(())
        }
        Err(e) => Err(device_err(e)),
    }
}

/// Checks that a CUDA device chosen by the caller exists (other devices need no check).
pub(super) fn check_device(device: &Device) -> Result<()> {
    if let Some(ordinal) = nccl::cuda_ordinal(device) {
        ddp_nccl::check_cuda_device(ordinal).map_err(DdpError::Device)?;
        prepare_libdevice()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Ddp;
    use burn::backend::Flex;

    #[test]
    fn downcast_accepts_only_the_same_primitive_type() {
        let t = Tensor::<1>::from_floats([1.0, 2.0], &Device::flex())
            .try_into_primitive::<Flex>()
            .expect("a Flex tensor");
        let same = downcast::<Flex, Flex>(t).unwrap_or_else(|_| panic!("Flex is Flex"));
        let same = match downcast::<Flex, burn::backend::Cube>(same) {
            Ok(_) => panic!("a Flex tensor is not a Cube one"),
            Err(same) => same,
        };
        let back = Tensor::<1>::from_primitive::<Flex>(same);
        assert_eq!(
            back.into_data().try_to_vec::<f32>().ok(),
            Some(vec![1.0, 2.0])
        );
    }

    /// Built with CUDA on a machine without a usable GPU (CI): `init` fails with one readable
    /// error before it joins a group when CUDA is asked for (`cuda()` or an explicit CUDA
    /// device); the automatic choice runs on the CPU.
    #[test]
    fn init_without_a_cuda_driver_is_one_clear_error() {
        if ddp_nccl::visible_cuda_devices().is_ok_and(|n| n > 0) {
            // A GPU machine: `cargo xtask gpu-check` runs the CUDA path itself.
            return;
        }
        let auto = Ddp::builder()
            .launch_env(ddp_comm::LaunchEnv::single_process())
            .init()
            .unwrap();
        assert_eq!(
            nccl::cuda_ordinal(auto.device()),
            None,
            "{:?}",
            auto.device()
        );
        let builders = [
            Ddp::builder().cuda(),
            Ddp::builder().device(Device::cuda(0)),
        ];
        for builder in builders {
            let err = builder
                .launch_env(ddp_comm::LaunchEnv::single_process())
                .init()
                .unwrap_err();
            assert!(matches!(err, DdpError::Device(_)), "{err:?}");
            let msg = err.to_string();
            assert!(msg.starts_with("no usable device for this rank: "), "{msg}");
            assert!(
                msg.contains("libcuda not found") || msg.contains("no CUDA device"),
                "{msg}"
            );
        }
    }
}
