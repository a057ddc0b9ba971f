//! Which CUDA device a rank uses, checked before any work starts.
//!
//! A rank process uses device `LOCAL_RANK`, except when it sees exactly one device: then it
//! uses device 0 (a launcher that gives each rank its own GPU through `CUDA_VISIBLE_DEVICES`,
//! e.g. `srun --gpus-per-task=1`, or several ranks sharing one GPU). Everything else — no
//! driver, no device, `LOCAL_RANK` beyond the visible devices — is one readable error, so a
//! job on a misconfigured node stops on every rank before it loads data or builds a model.

use cudarc::driver::{CudaContext, DriverError, sys::cudaError_enum};

use super::comm::cuda_error;
use super::library::{cuda_present, missing_cuda_message};
use super::options::NcclOptions;
use ddp_comm::error::{CommError, Result};

/// The number of CUDA devices this process can see (after `CUDA_VISIBLE_DEVICES`).
///
/// Safe to call on any machine: it never panics.
///
/// # Errors
/// [`CommError::Io`] with kind `NotFound` and a message starting with `libcuda not found` when
/// the NVIDIA driver library can't be loaded; a CUDA error when the driver fails to start
/// (`cuInit`), e.g. a driver older than the kernel module. No device at all is `Ok(0)`.
///
/// ```
/// match ddp_nccl::visible_cuda_devices() {
///     Ok(n) => println!("{n} CUDA device(s)"),
///     Err(e) => println!("no CUDA here: {e}"),
/// }
/// ```
pub fn visible_cuda_devices() -> Result<usize> {
    if !cuda_present() {
        return Err(CommError::io(
            "loading the CUDA driver",
            None,
            std::io::Error::new(std::io::ErrorKind::NotFound, missing_cuda_message()),
        ));
    }
    match CudaContext::device_count() {
        Ok(n) => Ok(n.max(0) as usize),
        // cuInit reports a machine whose driver sees no GPU this way.
        Err(DriverError(cudaError_enum::CUDA_ERROR_NO_DEVICE)) => Ok(0),
        Err(e) => Err(cuda_error(
            "starting the driver (cuInit/cuDeviceGetCount)",
            e,
        )),
    }
}

/// The CUDA device ordinal for the rank `local_rank` of `local_world_size` ranks on this host:
/// `local_rank`, or 0 when exactly one device is visible.
///
/// Every rank of a node with too few devices gets the error, not only the ranks beyond them,
/// so the job's log says it once per rank instead of showing stopped ranks.
///
/// # Errors
/// Those of [`visible_cuda_devices`]; [`CommError::InvalidArgument`] when no device is
/// visible or the node's ranks need more devices than are visible (the message names
/// `CUDA_VISIBLE_DEVICES` and how many ranks per node would fit).
pub fn cuda_device_for_local_rank(local_rank: usize, local_world_size: usize) -> Result<usize> {
    let visible = visible_cuda_devices()?;
    device_for_local_rank(local_rank, local_world_size, visible)
}

/// Checks that device `ordinal`, chosen by the caller, exists.
///
/// # Errors
/// Those of [`visible_cuda_devices`]; [`CommError::InvalidArgument`] naming the ordinal and
/// the number of visible devices.
pub fn check_cuda_device(ordinal: usize) -> Result<()> {
    let visible = visible_cuda_devices()?;
    if ordinal < visible {
        return Ok(());
    }
    Err(CommError::InvalidArgument(format!(
        "CUDA device {ordinal} was asked for but {} (CUDA_VISIBLE_DEVICES={})",
        describe_visible(visible),
        visible_devices_var()
    )))
}

/// The pure rule behind [`cuda_device_for_local_rank`].
pub(crate) fn device_for_local_rank(
    local_rank: usize,
    local_world_size: usize,
    visible: usize,
) -> Result<usize> {
    match visible {
        0 => Err(CommError::InvalidArgument(format!(
            "no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES={}); the NVIDIA \
             driver is loaded but sees no GPU",
            visible_devices_var()
        ))),
        1 => {
            if local_rank > 0 {
                tracing::info!(
                    local_rank,
                    "one CUDA device visible to this rank: using device 0 instead of LOCAL_RANK"
                );
            }
            Ok(0)
        }
        n if local_rank < n && local_world_size <= n => Ok(local_rank),
        n => Err(CommError::InvalidArgument(format!(
            "this node runs {} rank(s) (LOCAL_WORLD_SIZE), one per CUDA device, and LOCAL_RANK \
             {local_rank} would use device {local_rank}, but {} (CUDA_VISIBLE_DEVICES={}); \
             start at most {n} ranks per node (--nproc-per-node {n})",
            local_world_size.max(local_rank + 1),
            describe_visible(n),
            visible_devices_var()
        ))),
    }
}

fn describe_visible(n: usize) -> String {
    match n {
        0 => "no CUDA device is visible".to_string(),
        1 => "only 1 CUDA device is visible".to_string(),
        n => format!("only {n} CUDA devices are visible"),
    }
}

fn visible_devices_var() -> String {
    std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into())
}

/// Which CUDA device a rank uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeviceChoice {
    /// Set in [`NcclOptions::device`].
    Explicit(usize),
    /// `LOCAL_RANK`, unless exactly one device is visible (a launcher that gives each rank
    /// its own GPU through `CUDA_VISIBLE_DEVICES`, e.g. `srun --gpus-per-task=1`): then 0.
    LocalRank(usize),
}

impl DeviceChoice {
    pub(crate) fn from_options(opts: &NcclOptions, local_rank: usize) -> Self {
        match opts.device {
            Some(d) => DeviceChoice::Explicit(d),
            None => DeviceChoice::LocalRank(local_rank),
        }
    }

    pub(crate) fn resolve(self, visible: usize) -> Result<usize> {
        match self {
            DeviceChoice::Explicit(d) if d < visible => Ok(d),
            DeviceChoice::Explicit(d) => Err(CommError::InvalidArgument(format!(
                "CUDA device {d} requested (NcclOptions::device) but only {visible} device(s) \
                 are visible (CUDA_VISIBLE_DEVICES={})",
                std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into())
            ))),
            // Only this rank's own device is checked here; `cuda_device_for_local_rank`
            // checks the whole node before any work starts.
            DeviceChoice::LocalRank(r) => device_for_local_rank(r, r + 1, visible),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_rank_picks_its_device_and_one_visible_device_serves_every_rank() {
        assert_eq!(device_for_local_rank(0, 4, 4).unwrap(), 0);
        assert_eq!(device_for_local_rank(3, 4, 4).unwrap(), 3);
        assert_eq!(device_for_local_rank(1, 2, 8).unwrap(), 1);
        assert_eq!(device_for_local_rank(0, 1, 1).unwrap(), 0);
        // Two ranks sharing one GPU, or CUDA_VISIBLE_DEVICES set per rank.
        assert_eq!(device_for_local_rank(5, 8, 1).unwrap(), 0);
    }

    #[test]
    fn no_device_or_too_few_devices_is_one_clear_error() {
        let msg = device_for_local_rank(0, 1, 0).unwrap_err().to_string();
        assert!(msg.contains("no CUDA device is visible"), "{msg}");
        assert!(msg.contains("CUDA_VISIBLE_DEVICES="), "{msg}");
        let msg = device_for_local_rank(2, 3, 2).unwrap_err().to_string();
        assert!(
            msg.contains("LOCAL_RANK 2 would use device 2, but only 2 CUDA devices"),
            "{msg}"
        );
        assert!(msg.contains("--nproc-per-node 2"), "{msg}");
        // Rank 0 of that node hears it too, not only the ranks beyond the devices.
        let msg = device_for_local_rank(0, 3, 2).unwrap_err().to_string();
        assert!(msg.contains("this node runs 3 rank(s)"), "{msg}");
    }

    #[test]
    fn without_a_driver_the_checks_say_libcuda_not_found() {
        if cuda_present() {
            // A machine with the driver: the ignored device tests cover it.
            return;
        }
        for err in [
            visible_cuda_devices().unwrap_err(),
            cuda_device_for_local_rank(0, 1).unwrap_err(),
            check_cuda_device(0).unwrap_err(),
        ] {
            assert!(err.to_string().contains("libcuda not found"), "{err}");
        }
    }

    #[test]
    fn device_choice_follows_local_rank_unless_one_device_is_visible() {
        let mut o = NcclOptions::default();
        assert_eq!(DeviceChoice::from_options(&o, 3).resolve(4).unwrap(), 3);
        assert_eq!(DeviceChoice::from_options(&o, 3).resolve(1).unwrap(), 0);
        // Out of range with several devices: a clear error.
        let err = DeviceChoice::from_options(&o, 5).resolve(4).unwrap_err();
        assert!(err.to_string().contains("LOCAL_RANK 5"), "{err}");
        o.device = Some(2);
        assert_eq!(DeviceChoice::from_options(&o, 3).resolve(3).unwrap(), 2);
        let err = DeviceChoice::from_options(&o, 3).resolve(1).unwrap_err();
        assert!(err.to_string().contains("CUDA device 2 requested"), "{err}");
    }
}
