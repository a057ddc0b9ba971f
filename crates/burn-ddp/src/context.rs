//! [`Ddp`]: this process's place in a data-parallel job (rank, world size, device, group).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use burn::tensor::{DType, Device, Tensor, TensorData};
use ddp_comm::{Compression, GroupOptions, LaunchEnv, ProcessGroup, ReduceOp};

use crate::comm::{self, SharedGroup};
use crate::cuda::{DeviceChoice, DeviceComm, NcclPolicy, NcclSetting};
use crate::error::{DdpError, Result};
use crate::grad_sync::{DEFAULT_BUCKET_CAP_BYTES, GradientSynchronizer};

/// Joins the data-parallel job described by the launch environment, with default settings.
///
/// Reads torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
/// `MASTER_PORT`, …) or Slurm's, joins the process group and installs it process-wide
/// (`crate::comm::install`) so layers such as SyncBatchNorm find it. With no launch
/// variables at all this is a world of one: the same program runs alone unchanged.
///
/// Equivalent to `Ddp::builder().init()`; see [`DdpBuilder`] for the settings.
///
/// ```no_run
/// # fn main() -> Result<(), burn_ddp::DdpError> {
/// let ddp = burn_ddp::init()?;
/// println!("rank {} of {} on {:?}", ddp.rank(), ddp.world_size(), ddp.device());
/// # Ok(()) }
/// ```
pub fn init() -> Result<Ddp> {
    Ddp::builder().init()
}

/// Settings for [`Ddp`]; build with [`Ddp::builder`], finish with [`DdpBuilder::init`].
#[derive(Clone)]
pub struct DdpBuilder {
    device: DeviceChoice,
    bucket_cap_bytes: usize,
    group_options: GroupOptions,
    env: Option<LaunchEnv>,
    /// `None`: `DDP_COMPRESSION` decides (default: none).
    compression: Option<Compression>,
    nccl: NcclSetting,
    /// The program recovers a lost rank live ([`DdpBuilder::live_recovery`]).
    live_recovery: bool,
}

impl std::fmt::Debug for DdpBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = f.debug_struct("DdpBuilder");
        s.field("device", &self.device)
            .field("bucket_cap_bytes", &self.bucket_cap_bytes)
            .field("group_options", &self.group_options)
            .field("launch_env_given", &self.env.is_some())
            .field("compression", &self.compression)
            .field("nccl", &self.nccl)
            .field("live_recovery", &self.live_recovery);
        s.finish()
    }
}

impl Default for DdpBuilder {
    fn default() -> Self {
        DdpBuilder {
            device: DeviceChoice::Auto,
            bucket_cap_bytes: DEFAULT_BUCKET_CAP_BYTES,
            group_options: GroupOptions::default(),
            env: None,
            compression: None,
            nccl: NcclSetting::default(),
            live_recovery: false,
        }
    }
}

impl DdpBuilder {
    /// Declares that this program recovers a lost rank live ([`Ddp::recover`]; `ddprun
    /// --recover live`): a process started in place of a lost rank (`DDP_REJOIN=1`) then joins
    /// the running group instead of refusing to start, skips [`Ddp::replicate_model`]'s
    /// broadcast, and must call [`Ddp::recover`] before its first step, where the survivors
    /// hand it their state. On CUDA ranks whose collectives go through NCCL the survivors
    /// re-create their communicator with the replacement's (built; not yet run on a GPU).
    pub fn live_recovery(mut self) -> Self {
        self.live_recovery = true;
        self
    }

    /// Runs this rank on `device` instead of the automatic choice. The automatic choice is
    /// PyTorch's `"cuda" if torch.cuda.is_available() else "cpu"`: CUDA device `LOCAL_RANK`
    /// when built with the `cuda` feature and the CUDA driver reports a device, otherwise the
    /// CPU backend, Flex (with a warning naming why, when built with `cuda`). A CUDA device
    /// given here must exist: `init` fails with [`DdpError::Device`] otherwise.
    ///
    /// Give the plain device; call `.autodiff()` on [`Ddp::device`] for training.
    pub fn device(mut self, device: Device) -> Self {
        self.device = DeviceChoice::Fixed(device);
        self
    }

    /// Runs this rank on CUDA device `LOCAL_RANK` (device 0 when the rank sees only one),
    /// with no fallback: without a usable CUDA driver or device `init` fails with one
    /// [`DdpError::Device`] naming why, on every rank, before any rank joins the group. In a
    /// build without burn-ddp's `cuda` feature, `init` fails with [`DdpError::InvalidSetting`].
    ///
    /// ```no_run
    /// # fn main() -> Result<(), burn_ddp::DdpError> {
    /// let ddp = burn_ddp::Ddp::builder().cuda().init()?;
    /// # Ok(()) }
    /// ```
    pub fn cuda(mut self) -> Self {
        self.device = DeviceChoice::Cuda;
        self
    }

    /// Largest gradient bucket in bytes (default 25 MiB). Gradients are flattened to f32
    /// host buffers of at most this size; one all-reduce per bucket. A parameter larger
    /// than the cap gets a bucket of its own.
    pub fn bucket_cap_bytes(mut self, bytes: usize) -> Self {
        self.bucket_cap_bytes = bytes;
        self
    }

    /// Deadline of every collective (default 300 s or `DDP_TIMEOUT_SECS`).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.group_options.timeout = timeout;
        self
    }

    /// All process-group settings at once.
    pub fn group_options(mut self, options: GroupOptions) -> Self {
        self.group_options = options;
        self
    }

    /// How gradients travel between ranks (default: `DDP_COMPRESSION` when set —
    /// `none`, `bf16` or `fp16` —, else [`Compression::None`]).
    ///
    /// With `Bf16`/`Fp16` every bucket crosses the wire as 16-bit values, half the bytes; each
    /// rank still adds the incoming values into f32 and rounds the reduced values once, so the
    /// error does not grow with the world size (PyTorch's `bf16_compress_hook` sums in 16 bits)
    /// and every rank ends with bitwise the same gradients. Each averaged element is within
    /// about `u·|m| + 2u·A` of the exact mean `m` (`u` = 2⁻⁸ for bf16, 2⁻¹¹ for fp16, whose
    /// range ends at 65504; `A` = Σ|xᵢ|/n, the mean of the ranks' magnitudes): relative to
    /// `A`, not to `m`, so cancelling gradients keep an absolute error of about `2u·A`
    /// ([`ddp_comm::ProcessGroup::all_reduce_compressed`] states the exact bound). Worth it
    /// when the network is the bottleneck (TCP between
    /// hosts); on shared memory the casts cost about what the halved bytes save. On NCCL
    /// (feature `cuda`) buckets are cast on the device and all-reduced by NCCL's native 16-bit
    /// all-reduce, whose partial sums stay in 16 bits between ring steps.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), burn_ddp::DdpError> {
    /// use burn_ddp::ddp_comm::Compression;
    /// let ddp = burn_ddp::Ddp::builder().compression(Compression::Bf16).init()?;
    /// # Ok(()) }
    /// ```
    pub fn compression(mut self, compression: Compression) -> Self {
        self.compression = Some(compression);
        self
    }

    /// Uses `env` instead of reading the process environment.
    pub fn launch_env(mut self, env: LaunchEnv) -> Self {
        self.env = Some(env);
        self
    }

    /// Whether gradient buckets are all-reduced by NCCL on CUDA device memory (default:
    /// `DDP_NCCL` when set, else [`NcclPolicy::Auto`]: when every rank can, otherwise the host
    /// path). In a build without the `cuda` feature every policy takes the host path, and
    /// [`NcclPolicy::Required`] makes `init` fail with [`DdpError::NcclUnavailable`].
    pub fn nccl(mut self, policy: NcclPolicy) -> Self {
        self.nccl = NcclSetting::chosen(policy);
        self
    }

    /// Joins the group (or reuses the one already installed in this process) and returns
    /// the context.
    ///
    /// # Errors
    /// A missing or malformed launch variable, an unreachable rendezvous, a bucket cap of 0.
    pub fn init(self) -> Result<Ddp> {
        let compression = match self.compression {
            Some(c) => c,
            None => compression_from_env()?,
        };
        if self.bucket_cap_bytes < 4 {
            return Err(DdpError::InvalidSetting {
                setting: "DdpBuilder::bucket_cap_bytes",
                reason: format!("{} bytes is below one f32", self.bucket_cap_bytes),
            });
        }
        let env = match self.env {
            Some(env) => env,
            None => LaunchEnv::from_env().map_err(ddp_comm::CommError::from)?,
        };
        // Emulated GPU hosts (`ddprun --emulate-gpu-hosts`) are said on every rank, first.
        ddp_comm::gpu_hosts::check(|var| std::env::var(var).ok()).map_err(|reason| {
            DdpError::InvalidSetting {
                setting: ddp_comm::gpu_hosts::EMULATED_HOST_VAR,
                reason,
            }
        })?;
        if let Some(host) = ddp_comm::gpu_hosts::emulated_host() {
            tracing::warn!("{}", ddp_comm::gpu_hosts::announcement(env.rank, &host));
        }
        // The device first: a node without a usable GPU fails on every rank with one clear
        // error before any rank joins the group or loads data.
        let device = self.device.resolve(env.local_rank, env.local_world_size)?;
        let group_options = self.group_options.clone();
        let joining = comm::JoinedWith {
            job: format!(
                "rank {}/{} at {}",
                env.rank,
                env.world_size,
                env.master_endpoint()
            ),
            options: self.group_options.clone(),
        };
        let group = match comm::group() {
            Some(g) => {
                // A second `init` in one process shares the first group; with other settings
                // that would silently ignore them.
                match comm::joined_with() {
                    Some(first) if *first != joining => {
                        return Err(DdpError::InvalidSetting {
                            setting: "burn_ddp::init",
                            reason: format!(
                                "called again with other settings ({} {:?}) than the group \
                                 this process joined ({} {:?}); a process joins one group",
                                joining.job, joining.options, first.job, first.options
                            ),
                        });
                    }
                    Some(_) => {}
                    // Installed by hand (`comm::install`): the first `init` sets the rule.
                    None => comm::record_joined_with(joining),
                }
                tracing::debug!("reusing the process group already installed");
                g
            }
            None => {
                let replacing = ddp_comm::env::rejoining() && env.world_size > 1;
                if replacing && !self.live_recovery {
                    // A program that does not hand its state to a replacement: joining as a
                    // fresh rank would only collide with the lost one's slot.
                    return Err(DdpError::InvalidSetting {
                        setting: ddp_comm::env::REJOIN_VAR,
                        reason: "this process was started in place of a lost rank (ddprun \
                                 --recover live), but this program does not recover live (it \
                                 does not build its Ddp with DdpBuilder::live_recovery and \
                                 call Ddp::recover): run the job with --recover restart (the \
                                 default) and --max-restarts, which resumes from the checkpoint"
                            .into(),
                    });
                }
                let pg = if replacing {
                    ProcessGroup::rejoin(&env, self.group_options)?
                } else {
                    ProcessGroup::init(&env, self.group_options)?
                };
                let (g, fresh) = comm::install(pg);
                if fresh {
                    comm::record_joined_with(joining);
                }
                g
            }
        };
        let (rank, world_size) = {
            let g = comm::lock(&group);
            (g.rank(), g.world_size())
        };
        let replacement = ddp_comm::env::rejoining() && world_size > 1 && self.live_recovery;
        // A replacement joins a running group: the survivors make no set-up collectives, only
        // those of their re-forming (`DeviceComm::reform` in `Ddp::recover`).
        let device_comm = if replacement {
            // The survivors' side of this collective is their re-forming in `Ddp::recover`; a
            // rank lost meanwhile fails it on every rank, and every rank re-forms and says
            // again whether it uses NCCL (`Ddp::recover` does the same after every re-forming).
            let deadline = std::time::Instant::now() + group_options.connect_timeout * 3;
            loop {
                match DeviceComm::rejoin(&env, &group, &group_options, &device) {
                    Ok(c) => break c,
                    Err(e) if e.lost_a_peer() && std::time::Instant::now() < deadline => {
                        tracing::warn!(
                            rank,
                            "a rank was lost while this replacement joined ({e}); re-forming"
                        );
                        comm::lock(&group).reform()?;
                    }
                    Err(e) => return Err(e),
                }
            }
        } else {
            DeviceComm::connect(&env, &group, &group_options, &device, self.nccl)?
        };
        tracing::info!(
            rank,
            world_size,
            local_rank = env.local_rank,
            ?device,
            "ddp initialised"
        );
        if world_size > 1 && device_comm.is_none() && is_gpu(&device) {
            tracing::info!(
                ?device,
                "collectives are host-staged on this GPU: gradients and SyncBatchNorm statistics \
                 are read back to the host and reduced over shared memory / TCP"
            );
        }
        Ok(Ddp {
            group,
            rank,
            world_size,
            local_rank: env.local_rank,
            local_world_size: env.local_world_size,
            device,
            bucket_cap_bytes: self.bucket_cap_bytes,
            compression,
            device_comm,
            group_options,
            replacement: replacement.then(|| Arc::new(AtomicBool::new(true))),
            recovers_live: self.live_recovery
                && world_size > 1
                && ddp_comm::env::live_recovery_launched(),
        })
    }
}

/// The variable that sets [`DdpBuilder::compression`] for programs that don't expose it.
pub const COMPRESSION_VAR: &str = "DDP_COMPRESSION";

/// [`COMPRESSION_VAR`]'s value (none when unset or empty).
fn compression_from_env() -> Result<Compression> {
    match std::env::var(COMPRESSION_VAR) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().map_err(|e| DdpError::InvalidSetting {
            setting: COMPRESSION_VAR,
            reason: format!("{v:?}: {e}"),
        }),
        _ => Ok(Compression::None),
    }
}

/// Whether `device` is a GPU (a CubeCL device other than CubeCL's CPU runtime: wgpu or CUDA).
fn is_gpu(device: &Device) -> bool {
    #[cfg(feature = "cube")]
    {
        match device.clone().inner().as_dispatch() {
            #[cfg(feature = "cpu")]
            burn::backend::DispatchDevice::Cube(burn_cubecl::CubeDevice::Cpu(_)) => false,
            burn::backend::DispatchDevice::Cube(_) => true,
            _ => false,
        }
    }
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        false
    }
}

/// This process's place in a data-parallel job: rank, world size, device and the shared
/// process group. Create with [`init`] or [`Ddp::builder`].
///
/// Every collective helper here (`barrier`, `average_*`, [`Ddp::replicate_model`], the
/// gradient sync of [`crate::DdpOptimizer`]) must be called by every rank in the same order.
#[derive(Debug, Clone)]
pub struct Ddp {
    group: SharedGroup,
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
    device: Device,
    bucket_cap_bytes: usize,
    compression: Compression,
    /// NCCL on this rank's CUDA device, when every rank could create it.
    device_comm: Option<DeviceComm>,
    /// The group's deadlines (a live recovery re-creates the NCCL communicator with them).
    group_options: GroupOptions,
    /// `Some` when this process was started in place of a lost rank and joined the running
    /// group ([`DdpBuilder::live_recovery`]); the flag says it still waits for the survivors'
    /// state (its first [`Ddp::recover`]). Shared by the clones of this `Ddp`.
    pub(crate) replacement: Option<Arc<AtomicBool>>,
    /// The program recovers live ([`DdpBuilder::live_recovery`]) and its launcher replaces lost
    /// ranks (`DDP_RECOVER=live`), in a world of more than one.
    pub(crate) recovers_live: bool,
}

impl Ddp {
    /// Settings for [`init`]: device, bucket cap, timeouts.
    pub fn builder() -> DdpBuilder {
        DdpBuilder::default()
    }

    /// This process's rank, `0..world_size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the job.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// This process's rank on its host (`LOCAL_RANK`): the GPU index it uses.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Number of ranks on this host (`LOCAL_WORLD_SIZE`).
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }

    /// Whether this is rank 0, the rank that logs, renders metrics and writes checkpoints.
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    /// The device this rank computes on (plain; call `.autodiff()` for training).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// How gradients travel between ranks ([`DdpBuilder::compression`]).
    pub fn compression(&self) -> Compression {
        self.compression
    }

    /// The largest gradient bucket in bytes.
    pub fn bucket_cap_bytes(&self) -> usize {
        self.bucket_cap_bytes
    }

    /// Live recovery, first thing on a survivor: aborts the NCCL communicator when the ranks
    /// use one, so that a kernel still waiting on the lost rank returns before the host group
    /// re-forms (c10d's order).
    pub(crate) fn abort_device_comm(&self) {
        DeviceComm::abort(self.device_comm.as_ref());
    }

    /// Live recovery, on a survivor once the host group re-formed: the device communicator
    /// re-formed with the replacement's ([`DeviceComm::reform`]).
    pub(crate) fn reform_device_comm(&self) -> Result<()> {
        DeviceComm::reform(self.device_comm.as_ref(), &self.group, &self.group_options)
    }

    /// How long [`Ddp::recover`] keeps re-forming after losses during a recovery before it
    /// gives up: three connect timeouts.
    pub(crate) fn recovery_deadline(&self) -> std::time::Duration {
        self.group_options.connect_timeout * 3
    }

    /// Whether this is a replacement that has not received the survivors' state yet.
    pub(crate) fn awaiting_handover(&self) -> bool {
        self.replacement
            .as_ref()
            .is_some_and(|pending| pending.load(Ordering::SeqCst))
    }

    /// A replacement received the survivors' state: from now on it is a rank like the
    /// others (a later loss finds it a survivor, `replicate_model` treats it as any rank).
    pub(crate) fn handover_done(&self) {
        if let Some(pending) = &self.replacement {
            pending.store(false, Ordering::SeqCst);
        }
    }

    /// The process group shared by everything in this process (also reachable through
    /// [`crate::comm::group`]).
    pub fn group(&self) -> &SharedGroup {
        &self.group
    }

    /// Runs `f` with the job's process group, for collectives of your own (e.g. an all-gather
    /// of a hash to check that ranks agree). Every rank must make the same calls in the same
    /// order. The group is locked for the call only, so nothing can hold it past the closure
    /// into the next burn-ddp call that communicates (which would deadlock).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), burn_ddp::DdpError> {
    /// let ddp = burn_ddp::init()?;
    /// let mut counts = [ddp.rank() as f64, 1.0];
    /// ddp.with_group(|pg| pg.all_reduce(&mut counts, burn_ddp::ddp_comm::ReduceOp::Sum))?;
    /// # Ok(()) }
    /// ```
    pub fn with_group<R>(&self, f: impl FnOnce(&mut ddp_comm::ProcessGroup) -> R) -> R {
        f(&mut comm::lock(&self.group))
    }

    /// A gradient synchroniser over this job's group with this context's bucket cap (and,
    /// with the `cuda` feature, this context's NCCL communicator when there is one).
    pub fn gradient_synchronizer(&self) -> GradientSynchronizer {
        GradientSynchronizer::new(self.group.clone(), self.bucket_cap_bytes)
            .with_compression(self.compression)
            .with_device_comm(self.device_comm.clone())
    }

    /// Whether gradient buckets and SyncBatchNorm's statistics go through NCCL on this rank's
    /// CUDA device (see [`DdpBuilder::nccl`]); always `false` in builds without `cuda`.
    pub fn uses_nccl(&self) -> bool {
        self.device_comm.is_some()
    }

    /// The NCCL communicator gradient buckets use on CUDA devices, when every rank could
    /// create one (see [`DdpBuilder::nccl`]).
    #[cfg(feature = "cuda")]
    pub fn nccl(&self) -> Option<&crate::nccl::SharedNccl> {
        self.device_comm.as_ref().and_then(DeviceComm::shared)
    }

    /// Returns once every rank has called it.
    ///
    /// # Errors
    /// A peer died or the collective timed out.
    pub fn barrier(&self) -> Result<()> {
        if self.world_size == 1 {
            return Ok(());
        }
        comm::lock(&self.group).barrier()?;
        Ok(())
    }

    /// Runs `f` on rank 0 only, then waits at a barrier so that no rank goes on before it
    /// finished (e.g. downloading a data set, writing a checkpoint). Returns `Some` on rank 0,
    /// `None` elsewhere.
    ///
    /// # Errors
    /// The barrier failed.
    pub fn run_on_main<T>(&self, f: impl FnOnce() -> T) -> Result<Option<T>> {
        let out = self.is_main().then(f);
        self.barrier()?;
        Ok(out)
    }

    /// The mean of `value` over all ranks (in f64; every rank gets the same result).
    ///
    /// # Errors
    /// A collective failed.
    pub fn average_scalar(&self, value: f64) -> Result<f64> {
        let mut v = [value];
        self.average_scalars(&mut v)?;
        Ok(v[0])
    }

    /// Replaces each element of `values` by its mean over all ranks, in one collective.
    ///
    /// # Errors
    /// A collective failed (including ranks passing different lengths).
    pub fn average_scalars(&self, values: &mut [f64]) -> Result<()> {
        if self.world_size == 1 {
            return Ok(());
        }
        comm::lock(&self.group).all_reduce(values, ReduceOp::Sum)?;
        let n = self.world_size as f64;
        values.iter_mut().for_each(|v| *v /= n);
        Ok(())
    }

    /// The element-wise mean of `tensor` over all ranks (e.g. a per-class accuracy), on the
    /// tensor's device and with its dtype. f64 tensors are reduced in f64, all other float
    /// dtypes in f32.
    ///
    /// # Errors
    /// A collective failed or the tensor could not be read back.
    pub fn average_tensor<const D: usize>(&self, tensor: Tensor<D>) -> Result<Tensor<D>> {
        if self.world_size == 1 {
            return Ok(tensor);
        }
        let device = tensor.device();
        let data = tensor.into_data();
        let dtype = data.dtype();
        let shape = data.shape().clone();
        let n = self.world_size;
        let data = if dtype == DType::F64 {
            let mut v = data_vec::<f64>(data)?;
            comm::lock(&self.group).all_reduce(&mut v, ReduceOp::Sum)?;
            v.iter_mut().for_each(|x| *x /= n as f64);
            TensorData::new(v, shape)
        } else {
            let mut v = data_vec::<f32>(data)?;
            comm::lock(&self.group).all_reduce(&mut v, ReduceOp::Sum)?;
            v.iter_mut().for_each(|x| *x /= n as f32);
            TensorData::new(v, shape).convert_dtype(dtype)
        };
        Ok(Tensor::from_data(data, &device))
    }
}

fn data_vec<E: burn::tensor::Element>(data: TensorData) -> Result<Vec<E>> {
    data.convert::<E>()
        .try_into_vec::<E>()
        .map_err(|e| DdpError::TensorData {
            what: "metric".into(),
            msg: format!("{e:?}"),
        })
}

impl crate::comm::GroupHandle for Ddp {
    fn process_group(&self) -> &SharedGroup {
        &self.group
    }
}

/// The loader's view of this rank: batches of
/// [`ShardedDataLoaderBuilder::build_for`](crate::data::ShardedDataLoaderBuilder::build_for)
/// land on the device with autodiff, where the model trains.
impl crate::data::RankOfJob for Ddp {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn training_device(&self) -> Device {
        self.device.clone().autodiff()
    }
}

#[cfg(test)]
mod tests {
    use burn::data::dataloader::batcher::Batcher;
    use burn::data::dataset::InMemDataset;
    use burn::tensor::Device;

    use crate::data::ShardedDataLoaderBuilder;

    /// `build_for(…, &ddp)` puts batches on the device a training step needs: the Ddp device
    /// with autodiff, so a loss computed from them can be differentiated.
    #[test]
    fn build_for_puts_batches_on_the_autodiff_device() {
        /// Records the device each batch was built on.
        #[derive(Clone)]
        struct DeviceOf;
        impl Batcher<usize, Device> for DeviceOf {
            fn batch(&self, _items: Vec<usize>, device: &Device) -> Device {
                device.clone()
            }
        }
        let ddp = crate::Ddp::builder()
            .device(Device::flex())
            .init()
            .expect("a world of one");
        let loader = ShardedDataLoaderBuilder::new(DeviceOf)
            .batch_size(4)
            .build_for(InMemDataset::new((0..8).collect()), &ddp)
            .unwrap();
        let devices: Vec<Device> = loader.batches().map(|b| b.unwrap()).collect();
        assert_eq!(devices.len(), 2);
        for d in devices {
            assert_eq!(d, ddp.device().clone().autodiff());
        }
    }
}
