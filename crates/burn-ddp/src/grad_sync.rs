//! Gradient averaging across ranks: presence exchange, fixed-order buckets, a comm thread.
//!
//! [`GradientSynchronizer::sync`] turns each rank's [`GradientsParams`] into the average over
//! ranks, in place of PyTorch DDP's reducer:
//!
//! 1. **Order.** The module is visited (Burn's [`Module::visit`] order, the same on every rank
//!    for the same model type) and every float parameter that requires a gradient gets a slot.
//! 2. **Presence.** One `u8` Max all-reduce of a bitmap ("this rank has a gradient for slot
//!    i"), with a fingerprint of the slot layout (sizes) appended, so that ranks whose models
//!    differ fail with [`DdpError::GradientLayoutMismatch`] on every rank instead of mixing
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
//! With the `cuda` feature and an NCCL communicator ([`GradientSynchronizer::with_nccl`],
//! set up by [`crate::Ddp`]), buckets whose gradients sit on that CUDA device on every rank
//! are instead concatenated on the device, all-reduced there by NCCL and sliced back, with no
//! host copy (same buckets, same order; see [`crate::nccl`] — built and linked in CI, not yet run on a GPU).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Shape, Tensor, TensorData};
use ddp_comm::ReduceOp;

use crate::comm::{self, SharedGroup};
use crate::error::{DdpError, Result};

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
    group: SharedGroup,
    world_size: usize,
    bucket_cap_elems: usize,
    /// Return the gradients untouched in a world of one (off only in unit tests, to run the
    /// whole pipeline in-process).
    skip_when_alone: bool,
    /// Overlap host copies with communication on a comm thread.
    overlap: bool,
    last: SyncStats,
    /// NCCL communicator and its CUDA ordinal, for buckets on that device.
    #[cfg(feature = "cuda")]
    nccl: Option<(crate::nccl::SharedNccl, usize)>,
    /// Whether the last sync took the device (NCCL) path.
    #[cfg(feature = "cuda")]
    last_on_device: bool,
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

/// One trainable float parameter in visit order.
struct Slot {
    id: ParamId,
    shape: Shape,
    numel: usize,
    dtype: DType,
    device: Device,
    /// This rank's gradient, flattened (taken out of the `GradientsParams`).
    grad: Option<Tensor<1>>,
    /// The averaged gradient (flat, f32, possibly a view into its bucket's tensor), once its
    /// bucket came back.
    reduced: Option<Tensor<1>>,
}

/// Visits trainable float params and takes their gradients out.
struct SlotCollector<'a> {
    grads: &'a mut GradientsParams,
    slots: Vec<Slot>,
}

impl ModuleVisitor for SlotCollector<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.is_require_grad() {
            return;
        }
        let grad = self.grads.remove::<D>(param.id);
        let (shape, dtype, device) = match &grad {
            Some(g) => (g.shape(), g.dtype(), g.device()),
            None => {
                let v = param.val();
                (v.shape(), v.dtype(), v.device().without_autodiff())
            }
        };
        let numel = shape.num_elements();
        self.slots.push(Slot {
            id: param.id,
            shape,
            numel,
            dtype,
            device,
            grad: grad.map(|g| g.reshape([numel])),
            reduced: None,
        });
    }
}

/// Registers averaged gradients back with the right rank `D`.
struct SlotWriter<'a> {
    grads: &'a mut GradientsParams,
    slots: std::slice::IterMut<'a, Slot>,
}

impl ModuleVisitor for SlotWriter<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.is_require_grad() {
            return;
        }
        let Some(slot) = self.slots.next() else {
            return;
        };
        debug_assert_eq!(slot.id, param.id);
        if let Some(flat) = slot.reduced.take() {
            // f32 (host path), or already the gradient's dtype (device path): stay on device.
            let grad = if slot.dtype == DType::F32 || flat.dtype() == slot.dtype {
                let flat = if flat.device() == slot.device {
                    flat
                } else {
                    flat.to_device(&slot.device)
                };
                flat.reshape(slot.shape.clone())
            } else {
                let data = flat.into_data().convert_dtype(slot.dtype);
                Tensor::<1>::from_data(data, &slot.device).reshape(slot.shape.clone())
            };
            self.grads.register::<D>(slot.id, grad);
        }
    }
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
            last: SyncStats::default(),
            #[cfg(feature = "cuda")]
            nccl: None,
            #[cfg(feature = "cuda")]
            last_on_device: false,
        }
    }

    /// Whether the last [`Self::sync`] all-reduced its buckets with NCCL on device memory
    /// (`false` for the host path and for a world of one, which communicates nothing).
    #[cfg(feature = "cuda")]
    pub fn last_sync_on_device(&self) -> bool {
        self.last_on_device
    }

    /// All-reduces buckets with `nccl` on device memory whenever every rank's gradients are on
    /// its CUDA device (decided per call, in the presence exchange); other calls take the host
    /// path. Every rank must attach a communicator, or none. See [`crate::nccl`].
    #[cfg(feature = "cuda")]
    pub fn with_nccl(mut self, nccl: crate::nccl::SharedNccl) -> Self {
        let ordinal = crate::nccl::lock(&nccl).device_ordinal();
        self.nccl = Some((nccl, ordinal));
        // A communicator in a world of one exists only when it was asked for
        // (`NcclPolicy::Required`): then every sync runs the device path, as with N ranks.
        self.skip_when_alone = false;
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

    /// Whether host copies and communication overlap; see [`Self::with_overlap`].
    pub fn overlap(&self) -> bool {
        self.overlap
    }

    /// A synchroniser over the process-wide group ([`crate::comm::group`]), or a world of one
    /// when none is installed.
    /// With the `cuda` feature, the process-wide NCCL communicator ([`comm::nccl`]) is
    /// attached when one is installed.
    pub fn from_installed(bucket_cap_bytes: usize) -> Self {
        let group =
            comm::group().unwrap_or_else(|| comm::install(ddp_comm::ProcessGroup::single()).0);
        let sync = Self::new(group, bucket_cap_bytes);
        #[cfg(feature = "cuda")]
        let sync = match comm::nccl() {
            Some(n) => sync.with_nccl(n),
            None => sync,
        };
        sync
    }

    /// Timings of the last call to [`Self::sync`].
    pub fn last_stats(&self) -> SyncStats {
        self.last
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
        if self.world_size == 1 && self.skip_when_alone {
            self.last = SyncStats {
                total: start.elapsed(),
                ..SyncStats::default()
            };
            #[cfg(feature = "cuda")]
            {
                self.last_on_device = false;
            }
            return Ok(grads);
        }
        let mut collector = SlotCollector {
            grads: &mut grads,
            slots: Vec::new(),
        };
        module.visit(&mut collector);
        let mut slots = collector.slots;

        let presence_start = Instant::now();
        let (present, on_device) = self.exchange_presence(&slots, self.device_vote(&slots))?;
        let presence = presence_start.elapsed();

        let buckets = plan_buckets(&slots, &present, self.bucket_cap_elems);
        let elements = buckets.iter().map(|b| b.len).sum();
        #[cfg(feature = "cuda")]
        {
            self.last_on_device = on_device;
        }
        let mut times = if on_device {
            self.reduce_buckets_on_device(&mut slots, &buckets)?
        } else {
            self.reduce_buckets(&mut slots, &buckets)?
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

    /// This rank's vote for the device (NCCL) path: `None` without a communicator (the
    /// exchange then carries no vote, as in builds without `cuda`), else whether every
    /// gradient lives on the communicator's CUDA device.
    #[cfg(feature = "cuda")]
    fn device_vote(&self, slots: &[Slot]) -> Option<bool> {
        let (_, ordinal) = self.nccl.as_ref()?;
        Some(
            slots
                .iter()
                .all(|s| crate::nccl::cuda_ordinal(&s.device) == Some(*ordinal)),
        )
    }

    #[cfg(not(feature = "cuda"))]
    fn device_vote(&self, _slots: &[Slot]) -> Option<bool> {
        None
    }

    /// All-reduces (Max) the presence bitmap plus a layout fingerprint (and, with a
    /// `device_vote`, the pair `[yes, no]`); returns which slots have a gradient on at least
    /// one rank, and whether every rank voted for the device path.
    fn exchange_presence(
        &self,
        slots: &[Slot],
        device_vote: Option<bool>,
    ) -> Result<(Vec<bool>, bool)> {
        let n = slots.len();
        let fp = layout_fingerprint(slots).to_le_bytes();
        let mut buf = Vec::with_capacity(n + 18);
        buf.extend(slots.iter().map(|s| u8::from(s.grad.is_some())));
        buf.extend_from_slice(&fp);
        buf.extend(fp.iter().map(|b| !b));
        if let Some(yes) = device_vote {
            buf.push(u8::from(yes));
            buf.push(u8::from(!yes));
        }
        comm::lock(&self.group).all_reduce(&mut buf, ReduceOp::Max)?;
        // Equal on all ranks iff max(b) + max(!b) == 255 for every fingerprint byte.
        let (bits, tail) = buf.split_at(n);
        let agree = (0..8).all(|i| u16::from(tail[i]) + u16::from(tail[8 + i]) == 255);
        if !agree {
            return Err(DdpError::GradientLayoutMismatch(format!(
                "this rank has {n} trainable parameters with {} values in total, and at least one \
                 other rank has a different set (same model type and configuration on every rank?)",
                slots.iter().map(|s| s.numel).sum::<usize>()
            )));
        }
        let on_device = device_vote.is_some() && tail[16] == 1 && tail[17] == 0;
        log_path_once(device_vote, on_device);
        Ok((bits.iter().map(|&b| b != 0).collect(), on_device))
    }

    /// The device path: every bucket concatenated on the device, all of them all-reduced by
    /// one NCCL group call (one device synchronisation, one wait), then sliced back (see
    /// [`crate::nccl`]). Same buckets, in the same order, as the host path. The packed buckets
    /// are alive together, one extra copy of the gradients (PyTorch's DDP keeps its buckets
    /// the same way).
    #[cfg(feature = "cuda")]
    fn reduce_buckets_on_device(
        &self,
        slots: &mut [Slot],
        buckets: &[Bucket],
    ) -> Result<PipelineTimes> {
        let mut times = PipelineTimes::default();
        let Some((nccl, _)) = &self.nccl else {
            return Err(DdpError::InvalidSetting(
                "device path chosen without an NCCL communicator".into(),
            ));
        };
        let t = Instant::now();
        let packed: Vec<Tensor<1>> = buckets
            .iter()
            .map(|bucket| pack_on_device(slots, bucket))
            .collect();
        times.fill += t.elapsed();
        let t = Instant::now();
        let reduced =
            crate::nccl::all_reduce_many(&mut crate::nccl::lock(nccl), packed, ReduceOp::Mean)?;
        times.all_reduce += t.elapsed();
        let t = Instant::now();
        for (bucket, reduced) in buckets.iter().zip(reduced) {
            let mut off = 0;
            for &i in &bucket.slots {
                let slot = &mut slots[i];
                let n = slot.numel;
                let part = if bucket.slots.len() == 1 {
                    reduced.clone()
                } else {
                    reduced.clone().slice(off..off + n)
                };
                // Back to the gradient's dtype on the device (no-op for f32).
                slot.reduced = Some(part.cast(slot.dtype));
                off += n;
            }
        }
        times.write_back += t.elapsed();
        Ok(times)
    }

    #[cfg(not(feature = "cuda"))]
    fn reduce_buckets_on_device(
        &self,
        _slots: &mut [Slot],
        _buckets: &[Bucket],
    ) -> Result<PipelineTimes> {
        Err(DdpError::InvalidSetting(
            "the device gradient path needs the `cuda` feature".into(),
        ))
    }

    /// Pipelines host copies (this thread) and all-reduces (a comm thread).
    fn reduce_buckets(&self, slots: &mut [Slot], buckets: &[Bucket]) -> Result<PipelineTimes> {
        let mut times = PipelineTimes::default();
        if buckets.is_empty() {
            return Ok(times);
        }
        if !self.overlap {
            for bucket in buckets {
                let t = Instant::now();
                let mut parts = fill_bucket(slots, bucket)?;
                times.fill += t.elapsed();
                let t = Instant::now();
                reduce_parts(&mut comm::lock(&self.group), &mut parts)?;
                times.all_reduce += t.elapsed();
                let t = Instant::now();
                unpack_bucket(slots, parts);
                times.write_back += t.elapsed();
            }
            return Ok(times);
        }
        let group = self.group.clone();
        std::thread::scope(|scope| {
            // Bounded: at most two filled buckets wait for the comm thread.
            let (to_comm, comm_in) = mpsc::sync_channel::<Vec<Part>>(2);
            let (comm_out, from_comm) = mpsc::channel::<Vec<Part>>();
            let comm = scope.spawn(move || -> Result<Duration> {
                let mut g = comm::lock(&group);
                let mut busy = Duration::ZERO;
                for mut parts in comm_in {
                    let t = Instant::now();
                    reduce_parts(&mut g, &mut parts)?;
                    busy += t.elapsed();
                    if comm_out.send(parts).is_err() {
                        break;
                    }
                }
                Ok(busy)
            });

            let mut fill_err = None;
            for bucket in buckets {
                let t = Instant::now();
                let filled = fill_bucket(slots, bucket);
                times.fill += t.elapsed();
                match filled {
                    Ok(parts) => {
                        if to_comm.send(parts).is_err() {
                            break; // the comm thread failed; its error is reported below
                        }
                    }
                    Err(e) => {
                        fill_err = Some(e);
                        break;
                    }
                }
                while let Ok(parts) = from_comm.try_recv() {
                    let t = Instant::now();
                    unpack_bucket(slots, parts);
                    times.write_back += t.elapsed();
                }
            }
            drop(to_comm);
            for parts in from_comm.iter() {
                let t = Instant::now();
                unpack_bucket(slots, parts);
                times.write_back += t.elapsed();
            }
            times.all_reduce = comm
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))?;
            match fill_err {
                Some(e) => Err(e),
                None => Ok(times),
            }
        })
    }
}

/// Logs, once per process, which path gradient buckets take (builds with `cuda` only: other
/// builds have a single path).
fn log_path_once(device_vote: Option<bool>, on_device: bool) {
    #[cfg(feature = "cuda")]
    {
        static LOGGED: std::sync::Once = std::sync::Once::new();
        LOGGED.call_once(|| {
            if on_device {
                tracing::info!("gradient buckets: NCCL all-reduce on CUDA device memory");
            } else {
                let why = match device_vote {
                    None => "no NCCL communicator",
                    Some(false) => "this rank's gradients are not on the NCCL device",
                    Some(true) => "another rank's gradients are not on its NCCL device",
                };
                tracing::info!("gradient buckets: host-staged over the process group ({why})");
            }
        });
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (device_vote, on_device);
}

/// A bucket's gradients (zeros for slots without one here) flattened, in f32, and
/// concatenated on their device.
#[cfg(feature = "cuda")]
fn pack_on_device(slots: &mut [Slot], bucket: &Bucket) -> Tensor<1> {
    let mut parts: Vec<Tensor<1>> = bucket
        .slots
        .iter()
        .map(|&i| {
            let slot = &mut slots[i];
            let flat = match slot.grad.take() {
                Some(g) => g,
                None => Tensor::<1>::zeros([slot.numel], &slot.device),
            };
            flat.cast(DType::F32)
        })
        .collect();
    if parts.len() == 1 {
        parts.pop().expect("one part")
    } else {
        Tensor::cat(parts, 0)
    }
}

/// Where the calling thread and the comm thread spent a sync.
#[derive(Debug, Default)]
struct PipelineTimes {
    all_reduce: Duration,
    fill: Duration,
    write_back: Duration,
}

/// A run of consecutive present slots reduced in one all-reduce.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Bucket {
    /// Indices into the slot list, in order.
    slots: Vec<usize>,
    /// Total f32 values.
    len: usize,
}

/// Packs present slots in order into buckets of at most `cap` values (a bigger slot gets a
/// bucket of its own).
fn plan_buckets(slots: &[Slot], present: &[bool], cap: usize) -> Vec<Bucket> {
    plan_bucket_sizes(slots.iter().map(|s| s.numel), present, cap)
}

fn plan_bucket_sizes(
    sizes: impl Iterator<Item = usize>,
    present: &[bool],
    cap: usize,
) -> Vec<Bucket> {
    let mut buckets = Vec::new();
    let mut cur = Bucket {
        slots: Vec::new(),
        len: 0,
    };
    for (i, numel) in sizes.enumerate() {
        if !present[i] {
            continue;
        }
        if !cur.slots.is_empty() && cur.len + numel > cap {
            buckets.push(std::mem::replace(
                &mut cur,
                Bucket {
                    slots: Vec::new(),
                    len: 0,
                },
            ));
        }
        cur.slots.push(i);
        cur.len += numel;
    }
    if !cur.slots.is_empty() {
        buckets.push(cur);
    }
    buckets
}

/// Gradients of at least this many values are all-reduced in their own host buffer (the
/// one the backend hands over, without a copy on Flex) instead of being copied into a packed
/// buffer: one more collective call costs microseconds, a copy of a large gradient costs
/// milliseconds. The choice depends only on sizes, so every rank makes the same calls.
const IN_PLACE_MIN_ELEMS: usize = 1 << 16;

/// One all-reduce of a bucket: a packed run of small gradients, or one large gradient.
enum Part {
    /// Consecutive slots copied into one buffer (zeros for slots without a gradient here).
    Packed { slots: Vec<usize>, buf: Vec<f32> },
    /// One slot's gradient in its own host buffer (f32).
    Own { slot: usize, data: TensorData },
}

impl Part {
    /// The values to all-reduce.
    fn values(&mut self) -> Result<&mut [f32]> {
        match self {
            Part::Packed { buf, .. } => Ok(buf),
            Part::Own { data, .. } => {
                data.as_mut_slice::<f32>()
                    .map_err(|e| DdpError::TensorData {
                        what: "gradient buffer".into(),
                        msg: format!("{e:?}"),
                    })
            }
        }
    }
}

/// All-reduces a bucket's parts in order, averaging (Mean: the ring divides each chunk once,
/// as it finishes reducing it).
fn reduce_parts(group: &mut ddp_comm::ProcessGroup, parts: &mut [Part]) -> Result<()> {
    for part in parts {
        group.all_reduce(part.values()?, ReduceOp::Mean)?;
    }
    Ok(())
}

/// Reads a bucket's gradients to host buffers: large gradients each in their own buffer,
/// runs of small ones packed together (see [`IN_PLACE_MIN_ELEMS`]).
fn fill_bucket(slots: &mut [Slot], bucket: &Bucket) -> Result<Vec<Part>> {
    let mut parts = Vec::new();
    let mut run: Vec<usize> = Vec::new();
    let mut buf: Vec<f32> = Vec::new();
    for &i in &bucket.slots {
        let slot = &mut slots[i];
        if slot.numel >= IN_PLACE_MIN_ELEMS {
            if !run.is_empty() {
                parts.push(Part::Packed {
                    slots: std::mem::take(&mut run),
                    buf: std::mem::take(&mut buf),
                });
            }
            let data = match slot.grad.take() {
                None => TensorData::new(vec![0f32; slot.numel], [slot.numel]),
                Some(g) => {
                    let data = g.into_data();
                    if data.dtype() == DType::F32 {
                        data
                    } else {
                        data.convert::<f32>()
                    }
                }
            };
            parts.push(Part::Own { slot: i, data });
            continue;
        }
        run.push(i);
        match slot.grad.take() {
            None => buf.resize(buf.len() + slot.numel, 0.0),
            Some(g) => {
                let data = g.into_data();
                if data.dtype() == DType::F32 {
                    let s = data.as_slice::<f32>().map_err(|e| data_err(slot, e))?;
                    buf.extend_from_slice(s);
                } else {
                    let v = data
                        .convert::<f32>()
                        .try_into_vec::<f32>()
                        .map_err(|e| data_err(slot, e))?;
                    buf.extend_from_slice(&v);
                }
            }
        }
    }
    if !run.is_empty() {
        parts.push(Part::Packed { slots: run, buf });
    }
    Ok(parts)
}

fn data_err(slot: &Slot, e: impl std::fmt::Debug) -> DdpError {
    DdpError::TensorData {
        what: format!("gradient of parameter {}", slot.id),
        msg: format!("{e:?}"),
    }
}

/// Turns reduced parts back into tensors on their slots' device (no copy on Flex): a large
/// gradient from its own buffer, a packed run as one tensor whose ranges (views where the
/// backend has views) go to its slots.
fn unpack_bucket(slots: &mut [Slot], parts: Vec<Part>) {
    for part in parts {
        match part {
            Part::Own { slot, data } => {
                let device = slots[slot].device.clone();
                slots[slot].reduced = Some(Tensor::<1>::from_data(data, &device));
            }
            Part::Packed { slots: run, buf } => {
                let device = slots[run[0]].device.clone();
                let len = buf.len();
                let whole = Tensor::<1>::from_data(TensorData::new(buf, [len]), &device);
                if let [only] = run[..] {
                    slots[only].reduced = Some(whole);
                    continue;
                }
                let mut off = 0;
                for i in run {
                    let n = slots[i].numel;
                    slots[i].reduced = Some(whole.clone().slice(off..off + n));
                    off += n;
                }
            }
        }
    }
}

/// FNV-1a over the slot sizes and ranks: equal on ranks with the same trainable layout.
fn layout_fingerprint(slots: &[Slot]) -> u64 {
    let mut h = Fnv::default();
    h.write_u64(slots.len() as u64);
    for s in slots {
        h.write_u64(s.shape.num_dims() as u64);
        for &d in s.shape.iter() {
            h.write_u64(d as u64);
        }
    }
    h.0
}

/// 64-bit FNV-1a, stable across processes and builds.
pub(crate) struct Fnv(pub(crate) u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    pub(crate) fn write_u64(&mut self, v: u64) {
        self.write(&v.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::Distribution;
    use ddp_comm::ProcessGroup;
    use std::sync::{Arc, Mutex};

    #[derive(Module, Debug)]
    struct Net {
        a: Linear,
        b: Linear,
        unused: Linear,
        frozen: Linear,
    }

    impl Net {
        fn new(device: &Device) -> Self {
            Net {
                a: LinearConfig::new(3, 4).init(device),
                b: LinearConfig::new(4, 2).init(device),
                unused: LinearConfig::new(3, 3).init(device),
                frozen: LinearConfig::new(3, 1).init(device).no_grad(),
            }
        }
    }

    fn grads_of(net: &Net, device: &Device) -> GradientsParams {
        let x = Tensor::<2>::random([5, 3], Distribution::Default, device);
        let loss = net.b.forward(net.a.forward(x.clone())).sum() + net.frozen.forward(x).sum();
        GradientsParams::from_grads(loss.backward(), net)
    }

    /// Syncs `net`'s gradients in a world of one and checks they come back unchanged: same
    /// values and shapes, none for the unused and the frozen layer.
    fn round_trip(net: &Net, device: &Device, sync: &mut GradientSynchronizer) {
        let grads = grads_of(net, device);
        let before_a = values::<2>(&grads, net.a.weight.id).unwrap();
        let before_bb = values::<1>(&grads, net.b.bias.as_ref().unwrap().id).unwrap();
        let out = sync.sync(net, grads).unwrap();
        assert_eq!(values::<2>(&out, net.a.weight.id).unwrap(), before_a);
        assert_eq!(
            values::<1>(&out, net.b.bias.as_ref().unwrap().id).unwrap(),
            before_bb
        );
        assert_eq!(
            out.get::<2>(net.a.weight.id).unwrap().shape().as_slice(),
            &[3, 4]
        );
        assert!(
            out.get::<2>(net.unused.weight.id).is_none(),
            "unused stays absent"
        );
        assert!(
            out.get::<2>(net.frozen.weight.id).is_none(),
            "frozen has none"
        );
        assert_eq!(out.len(), 4, "a.w a.b b.w b.b");
    }

    fn values<const D: usize>(g: &GradientsParams, id: ParamId) -> Option<Vec<f32>> {
        g.get::<D>(id)
            .map(|t| t.into_data().try_to_vec::<f32>().unwrap())
    }

    /// The whole pipeline (collect, buckets, comm thread, write-back) in a world of one must
    /// give back exactly the gradients it got, for every bucket cap.
    #[test]
    fn full_pipeline_in_a_world_of_one_returns_the_same_gradients() {
        let device = Device::flex().autodiff();
        let net = Net::new(&device);
        let group = Arc::new(Mutex::new(ProcessGroup::single()));
        for (cap, overlap) in [4, 16, 40, 1 << 20]
            .into_iter()
            .flat_map(|c| [(c, true), (c, false)])
        {
            let mut sync = GradientSynchronizer::new(group.clone(), cap).with_overlap(overlap);
            sync.skip_when_alone = false;
            round_trip(&net, &device, &mut sync);
            let st = sync.last_stats();
            assert_eq!(st.elements, 3 * 4 + 4 + 4 * 2 + 2);
            // Sizes in visit order: a.weight 12, a.bias 4, b.weight 8, b.bias 2.
            let expected_buckets = match cap {
                4 | 16 => 4, // caps of 1 and 4 values: every parameter alone
                40 => 3,     // cap 10: [12] [4] [8, 2]
                _ => 1,
            };
            assert_eq!(st.buckets, expected_buckets, "cap {cap}");
        }
    }

    /// Gradients of 64 Ki values or more are reduced in their own buffers, between packed
    /// runs of small ones; the values and shapes must come back unchanged either way.
    #[test]
    fn large_gradients_reduced_in_place_between_packed_runs() {
        let device = Device::flex().autodiff();
        let a = LinearConfig::new(3, 300).init(&device); // 900 + 300: packed
        let b = LinearConfig::new(300, 300).init(&device); // 90 000: own buffer, then 300
        let net = (a, b);
        let group = Arc::new(Mutex::new(ProcessGroup::single()));
        for (cap, overlap) in [(1 << 10, true), (1 << 30, true), (1 << 30, false)] {
            let x = Tensor::<2>::random([4, 3], Distribution::Default, &device);
            let loss = net.1.forward(net.0.forward(x)).sum();
            let grads = GradientsParams::from_grads(loss.backward(), &net);
            let before = values::<2>(&grads, net.1.weight.id).unwrap();
            let before_bias = values::<1>(&grads, net.0.bias.as_ref().unwrap().id).unwrap();
            let mut sync = GradientSynchronizer::new(group.clone(), cap).with_overlap(overlap);
            sync.skip_when_alone = false;
            let out = sync.sync(&net, grads).unwrap();
            assert_eq!(values::<2>(&out, net.1.weight.id).unwrap(), before);
            assert_eq!(
                values::<1>(&out, net.0.bias.as_ref().unwrap().id).unwrap(),
                before_bias
            );
            assert_eq!(
                out.get::<2>(net.1.weight.id).unwrap().shape().as_slice(),
                &[300, 300]
            );
            assert_eq!(out.len(), 4);
        }
    }

    /// The presence exchange carries the device-path vote only when asked to, and decodes it
    /// as "every rank voted yes".
    #[test]
    fn presence_exchange_decodes_the_device_vote() {
        let device = Device::flex().autodiff();
        let net = Net::new(&device);
        let mut grads = grads_of(&net, &device);
        let mut collector = SlotCollector {
            grads: &mut grads,
            slots: Vec::new(),
        };
        net.visit(&mut collector);
        let slots = collector.slots;
        let sync = GradientSynchronizer::new(Arc::new(Mutex::new(ProcessGroup::single())), 64);
        for (vote, expected) in [(None, false), (Some(false), false), (Some(true), true)] {
            let (present, on_device) = sync.exchange_presence(&slots, vote).unwrap();
            assert_eq!(on_device, expected, "vote {vote:?}");
            assert_eq!(present, vec![true, true, true, true, false, false]);
        }
    }

    /// The NCCL device path in a world of one: real NCCL calls on the GPU, which must hand
    /// back exactly the gradients they got, for several bucket layouts.
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs an NVIDIA GPU with libcuda and libnccl, and Burn's CUDA backend built \
                (cubecl-llvm downloads LLVM at build time)"]
    fn nccl_device_path_in_a_world_of_one_returns_the_same_gradients() {
        use ddp_comm::nccl::{NcclGroup, NcclOptions};
        let device = Device::cuda(0).autodiff();
        let net = Net::new(&device);
        let nccl = NcclGroup::single(&NcclOptions {
            device: Some(0),
            ..NcclOptions::default()
        })
        .unwrap();
        let nccl = Arc::new(Mutex::new(nccl));
        let group = Arc::new(Mutex::new(ProcessGroup::single()));
        for cap in [4, 40, 1 << 20] {
            let mut sync = GradientSynchronizer::new(group.clone(), cap).with_nccl(nccl.clone());
            sync.skip_when_alone = false;
            round_trip(&net, &device, &mut sync);
            assert!(sync.last_sync_on_device(), "cap {cap}: took the host path");
        }
    }

    fn sizes(b: &[Bucket]) -> Vec<(Vec<usize>, usize)> {
        b.iter().map(|b| (b.slots.clone(), b.len)).collect()
    }

    #[test]
    fn buckets_pack_in_order_and_respect_the_cap() {
        let s = [3usize, 4, 2, 10, 1];
        let present = [true; 5];
        let b = plan_bucket_sizes(s.iter().copied(), &present, 7);
        assert_eq!(
            sizes(&b),
            vec![(vec![0, 1], 7), (vec![2], 2), (vec![3], 10), (vec![4], 1)]
        );
    }

    #[test]
    fn absent_slots_are_skipped() {
        let s = [3usize, 4, 2];
        let b = plan_bucket_sizes(s.iter().copied(), &[true, false, true], 100);
        assert_eq!(sizes(&b), vec![(vec![0, 2], 5)]);
        let none = plan_bucket_sizes(s.iter().copied(), &[false; 3], 100);
        assert!(none.is_empty());
    }
}
