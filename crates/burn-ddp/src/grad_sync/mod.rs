//! Gradient averaging across ranks: presence exchange, fixed-order buckets, a comm thread.
//!
//! [`GradientSynchronizer::sync`] turns each rank's [`GradientsParams`] into the average over
//! ranks, in place of PyTorch DDP's reducer:
//!
//! 1. **Order.** The module is visited (Burn's [`Module::visit`] order, the same on every rank
//!    for the same model type) and every float parameter that requires a gradient gets a slot.
//! 2. **Presence.** One `u8` Max all-reduce of a bitmap ("this rank has a gradient for slot
//!    i"), with a fingerprint of the slot layout (sizes) appended, so that ranks whose models
//!    differ fail with `DdpError::GradientLayoutMismatch` on every rank instead of mixing
//!    unrelated numbers. A slot with no gradient on any rank stays absent (the optimizer skips
//!    it, as on one process); a slot with a gradient on some ranks takes part with zeros where
//!    missing, so it becomes (sum over ranks) / world size — no `find_unused_parameters` flag.
//! 3. **Buckets.** Present slots are packed in order into buckets of at most the cap (default
//!    25 MiB of f32). Bucket boundaries depend only on the reduced bitmap and the sizes, so
//!    they are identical on every rank. Inside a bucket, runs of small gradients are copied
//!    into one buffer and reduced together; a gradient of 64 Ki values or more is reduced in
//!    the host buffer its tensor hands over (no copy on Flex) by a call of its own.
//! 4. **Pipeline.** The calling thread copies bucket k to the host while a comm thread
//!    all-reduces bucket k−1 (Mean: sum ÷ world size) and hands it back; finished buckets are
//!    turned back into tensors while later ones are still on the wire. Where the host has no
//!    spare core for the comm thread the same steps run one after another on the calling
//!    thread ([`GradientSynchronizer::with_overlap`]).
//!
//! With the `cuda` feature and an NCCL communicator (`GradientSynchronizer::with_nccl`,
//! set up by [`crate::Ddp`]), buckets whose gradients sit on that CUDA device on every rank
//! are instead concatenated on the device, all-reduced there by NCCL and sliced back, with no
//! host copy (same buckets, same order; see `crate::nccl` — built and linked in CI, not yet run on a GPU).

pub(crate) mod buckets;
mod device;
mod host;
mod presence;
mod replicas;
pub(crate) mod slots;
#[cfg(test)]
mod tests;

use std::time::{Duration, Instant};

use burn::module::Module;
use burn::optim::GradientsParams;
use ddp_comm::Compression;

use crate::comm::{self, SharedGroup};
use crate::cuda::DeviceComm;
use crate::error::{DdpError, Result};

use buckets::plan_buckets;
pub(crate) use host::IN_PLACE_MIN_ELEMS;
use slots::{SlotCollector, SlotWriter};

/// Default largest bucket: 25 MiB, PyTorch DDP's `bucket_cap_mb` default.
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 * 1024 * 1024;

/// Timings of the last [`GradientSynchronizer::sync`] call.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SyncStats {
    /// Wall time of the whole call.
    pub total: Duration,
    /// Time the comm thread spent inside all-reduce calls of buckets.
    pub all_reduce: Duration,
    /// Time spent on the presence exchange.
    pub presence: Duration,
    /// Time the calling thread spent reading gradients into host buckets.
    pub fill: Duration,
    /// Time the calling thread spent turning reduced buckets back into gradients.
    pub write_back: Duration,
    /// Number of buckets all-reduced.
    pub buckets: usize,
    /// Number of f32 values all-reduced.
    pub elements: usize,
}

/// Averages gradients across the ranks of a process group; see the [module docs](self).
///
/// Usually reached through [`crate::DdpOptimizer`]; use it directly when a loop needs the
/// averaged gradients itself (e.g. for gradient clipping by global norm).
#[derive(Debug, Clone)]
pub struct GradientSynchronizer {
    pub(crate) group: SharedGroup,
    pub(crate) world_size: usize,
    pub(crate) bucket_cap_elems: usize,
    /// Return the gradients untouched in a world of one (off only in unit tests, to run the
    /// whole pipeline in-process).
    pub(crate) skip_when_alone: bool,
    /// Overlap host copies with communication on a comm thread.
    overlap: bool,
    /// How buckets travel on the host path.
    pub(crate) compression: Compression,
    pub(crate) last: SyncStats,
    /// NCCL on a CUDA device, for buckets on that device (never in builds without `cuda`).
    pub(crate) device_comm: Option<DeviceComm>,
    /// Whether the last sync took the device (NCCL) path.
    pub(crate) last_on_device: bool,
    /// Compare the ranks' parameters before the first synchronisation
    /// ([`Self::check_replicas_once`]); off only in unit tests whose ranks build different
    /// models on purpose.
    pub(crate) check_replicas: bool,
    /// The comparison was made.
    replicas_checked: bool,
}

/// Whether a comm thread can run beside the calling thread: it needs a core besides the
/// ones the ranks of this host compute on (`LOCAL_WORLD_SIZE`, the torchrun variable).
fn overlap_pays() -> bool {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let local = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(1)
        .max(1);
    cores >= 2 * local
}

impl GradientSynchronizer {
    /// A synchroniser over `group` with buckets of at most `bucket_cap_bytes` (≥ 4).
    pub fn new(group: SharedGroup, bucket_cap_bytes: usize) -> Self {
        let world_size = comm::lock(&group).world_size();
        GradientSynchronizer {
            group,
            world_size,
            bucket_cap_elems: (bucket_cap_bytes / 4).max(1),
            skip_when_alone: true,
            overlap: overlap_pays(),
            compression: Compression::None,
            last: SyncStats::default(),
            device_comm: None,
            last_on_device: false,
            check_replicas: true,
            replicas_checked: false,
        }
    }

    /// Before the first synchronisation: every rank must hold the same trainable parameters
    /// (rank 0's, after [`crate::Ddp::replicate_model`]). A forgotten `replicate_model` would
    /// otherwise train a different model on each rank and exit 0: [`DdpError::NotReplicated`]
    /// on every rank instead. One fingerprint of the parameters' values a rank, all-gathered
    /// (8 bytes a rank), once.
    pub(crate) fn check_replicas_once<M: Module>(&mut self, module: &M) -> Result<()> {
        if !self.check_replicas || self.replicas_checked || self.world_size == 1 {
            return Ok(());
        }
        self.replicas_checked = true;
        self.check_replicas(module)
    }

    /// Leaves out the comparison of the first synchronisation: after [`crate::Ddp::recover`],
    /// which made every rank's parameters equal and where the survivors' synchronisers had
    /// made theirs already.
    pub(crate) fn skip_replica_check(&mut self) {
        self.replicas_checked = true;
    }

    /// Compares the ranks' trainable parameters now, as the first synchronisation does by
    /// itself: a fingerprint of their values on each rank, all-gathered (8 bytes a rank).
    /// Every rank must call it; [`DdpError::NotReplicated`] names the first rank whose
    /// parameters differ from rank 0's. For a check at another point (after loading weights
    /// on each rank, say), and for `cargo xtask bench ddp`'s measure of its cost.
    pub fn check_replicas<M: Module>(&mut self, module: &M) -> Result<()> {
        if self.world_size == 1 {
            return Ok(());
        }
        let fingerprint = replicas::parameters_fingerprint(module);
        let mut all = vec![0i64; self.world_size];
        comm::lock(&self.group).all_gather(&[fingerprint], &mut all)?;
        match all.iter().position(|&f| f != all[0]) {
            Some(rank) => Err(DdpError::NotReplicated { rank }),
            None => Ok(()),
        }
    }

    /// Whether the last [`Self::sync`] all-reduced its buckets with NCCL on device memory
    /// (`false` for the host path and for a world of one, which communicates nothing; always
    /// `false` in builds without the `cuda` feature).
    pub fn last_sync_on_device(&self) -> bool {
        self.last_on_device
    }

    /// All-reduces buckets with `nccl` on device memory whenever every rank's gradients are on
    /// its CUDA device (decided per call, in the presence exchange); other calls take the host
    /// path. Every rank must attach a communicator, or none. See [`crate::nccl`].
    #[cfg(feature = "cuda")]
    pub fn with_nccl(self, nccl: crate::nccl::SharedNccl) -> Self {
        self.with_device_comm(Some(DeviceComm::nccl(nccl)))
    }

    /// Attaches `device_comm` (see [`Self::with_nccl`]); `None` keeps the host path.
    pub(crate) fn with_device_comm(mut self, device_comm: Option<DeviceComm>) -> Self {
        if device_comm.is_some() {
            // A communicator in a world of one exists only when it was asked for
            // (`NcclPolicy::Required`): then every sync runs the device path, as with N ranks.
            self.skip_when_alone = false;
        }
        self.device_comm = device_comm;
        self
    }

    /// Overlap (`true`) or serialise (`false`) host copies and communication. The default
    /// overlaps when this host has at least two cores per local rank: the comm thread then
    /// has a core of its own. Without one it would take turns with the calling thread, and
    /// the all-reduce — the larger part on a CPU, where copies are mostly avoided — gets
    /// slower than the copies it hides.
    pub fn with_overlap(mut self, overlap: bool) -> Self {
        self.overlap = overlap;
        self
    }

    /// Sends buckets as 16-bit values, accumulating in f32 (see
    /// [`DdpBuilder::compression`](crate::DdpBuilder::compression)). Every rank must use the
    /// same setting. On the NCCL device path buckets are cast to 16 bits on the device and
    /// all-reduced by NCCL's native bf16/fp16 all-reduce, which keeps its partial sums in 16
    /// bits between ring steps (as PyTorch's compression hooks do; not yet run on a GPU).
    pub fn with_compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    /// How buckets travel on the host path; see [`Self::with_compression`].
    pub fn compression(&self) -> Compression {
        self.compression
    }

    /// Whether host copies and communication overlap; see [`Self::with_overlap`].
    pub fn overlap(&self) -> bool {
        self.overlap
    }

    /// A synchroniser over the process-wide group ([`crate::comm::group`]), or a world of one
    /// when none is installed.
    /// With the `cuda` feature, the process-wide NCCL communicator (`nccl::installed`) is
    /// attached when one is installed.
    pub fn from_installed(bucket_cap_bytes: usize) -> Self {
        let group =
            comm::group().unwrap_or_else(|| comm::install(ddp_comm::ProcessGroup::single()).0);
        Self::new(group, bucket_cap_bytes).with_device_comm(DeviceComm::installed())
    }

    /// Timings of the last call to [`Self::sync`].
    pub fn last_stats(&self) -> SyncStats {
        self.last
    }

    /// The process group it synchronises over.
    pub(crate) fn group(&self) -> &SharedGroup {
        &self.group
    }

    /// The largest bucket in bytes.
    pub fn bucket_cap_bytes(&self) -> usize {
        self.bucket_cap_elems * 4
    }

    /// Replaces every gradient of `module`'s trainable parameters in `grads` by its average
    /// over all ranks. Gradients of ids that are not parameters of `module` are left alone.
    ///
    /// Every rank must call this with the same model structure, at the same point.
    ///
    /// # Errors
    /// A collective failed (dead peer, timeout), the ranks' trainable parameters differ, or a
    /// gradient could not be read back from its device. After an error the gradients are
    /// unusable and the process group is broken; end the process.
    pub fn sync<M: Module>(
        &mut self,
        module: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams> {
        let start = Instant::now();
        let _span =
            ddp_comm::trace::span("grad_sync", "ddp").arg("compression", self.compression.name());
        if self.world_size == 1 && self.skip_when_alone {
            self.last = SyncStats {
                total: start.elapsed(),
                ..SyncStats::default()
            };
            self.last_on_device = false;
            return Ok(grads);
        }
        self.check_replicas_once(module)?;
        let mut collector = SlotCollector {
            grads: &mut grads,
            slots: Vec::new(),
        };
        module.visit(&mut collector);
        let mut slots = collector.slots;

        let presence_start = Instant::now();
        let presence::Presence {
            present,
            on_device,
            any_tcp,
        } = self.exchange_presence(&slots, self.device_vote(&slots))?;
        let presence = presence_start.elapsed();
        let host_wire = host_wire(self.compression, any_tcp);

        let buckets = plan_buckets(&slots, &present, self.bucket_cap_elems);
        let elements = buckets.iter().map(|b| b.len).sum();
        self.last_on_device = on_device;
        let mut times = if on_device {
            self.reduce_buckets_on_device(&mut slots, &buckets)?
        } else {
            self.reduce_buckets(&mut slots, &buckets, host_wire)?
        };

        let write_start = Instant::now();
        let mut writer = SlotWriter {
            grads: &mut grads,
            slots: slots.iter_mut(),
        };
        module.visit(&mut writer);
        times.write_back += write_start.elapsed();
        self.last = SyncStats {
            total: start.elapsed(),
            all_reduce: times.all_reduce,
            presence,
            fill: times.fill,
            write_back: times.write_back,
            buckets: buckets.len(),
            elements,
        };
        tracing::trace!(stats = ?self.last, "gradients synchronised");
        Ok(grads)
    }
}

/// The wire format of the host path: `requested`, except in a group whose every link is
/// shared memory, where 16-bit values save no wire time and their casts only cost memory
/// bandwidth (measured: shm 10.7 ms → 14.3 ms with bf16), so f32 travels — said once.
pub(crate) fn host_wire(requested: Compression, any_tcp: bool) -> Compression {
    if requested == Compression::None || any_tcp {
        return requested;
    }
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        tracing::warn!(
            "gradient compression {requested} not used: every link of this group stays on \
             one host (shared memory or a Unix socket), where 16-bit gradients are slower than \
             f32 (they pay only over TCP, between hosts); gradients travel as f32"
        );
    });
    Compression::None
}

/// Where the calling thread and the comm thread spent a sync.
#[derive(Debug, Default)]
pub(crate) struct PipelineTimes {
    pub(crate) all_reduce: Duration,
    pub(crate) fill: Duration,
    pub(crate) write_back: Duration,
}
