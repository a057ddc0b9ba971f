//! The CUDA glue of burn-ddp, in one module: NCCL on device memory ([`nccl`]), the choice of
//! each rank's device with the CUDA toolkit files its kernels need, and [`DeviceComm`], the
//! communicator through which gradient sync and SyncBatchNorm reach device memory.
//!
//! The module is compiled in every build. Without the `cuda` feature, [`DeviceComm`] is a type
//! with no values, so `Option<DeviceComm>` is always `None`. The code that uses it (the
//! gradient synchroniser's device path, SyncBatchNorm's NCCL exchange) compiles and is
//! type-checked in every build, and needs no `cfg(feature = "cuda")` of its own: the
//! feature's switches are here and on the public items that exist only with it.

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
pub(crate) use enabled::{DeviceChoice, DeviceComm, ENABLED};

#[cfg(not(feature = "cuda"))]
mod disabled;
#[cfg(not(feature = "cuda"))]
pub(crate) use disabled::{DeviceChoice, DeviceComm, ENABLED};

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
                assert!(matches!(e, DdpError::InvalidSetting(_)), "{e:?}");
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
