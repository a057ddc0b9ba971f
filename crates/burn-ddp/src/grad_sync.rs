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
//!    they are identical on every rank.
//! 4. **Pipeline.** The calling thread copies bucket k to the host while a comm thread
//!    all-reduces bucket k−1 (Sum, then ÷ world size) and hands it back; finished buckets are
//!    turned back into tensors while later ones are still on the wire.

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
    last: SyncStats,
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
    /// The averaged gradient, once its bucket came back.
    reduced: Option<Vec<f32>>,
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
        if let Some(values) = slot.reduced.take() {
            let mut data = TensorData::new(values, slot.shape.clone());
            if slot.dtype != DType::F32 {
                data = data.convert_dtype(slot.dtype);
            }
            self.grads
                .register::<D>(slot.id, Tensor::from_data(data, &slot.device));
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
            last: SyncStats::default(),
        }
    }

    /// A synchroniser over the process-wide group ([`crate::comm::group`]), or a world of one
    /// when none is installed.
    pub fn from_installed(bucket_cap_bytes: usize) -> Self {
        let group =
            comm::group().unwrap_or_else(|| comm::install(ddp_comm::ProcessGroup::single()).0);
        Self::new(group, bucket_cap_bytes)
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
            return Ok(grads);
        }
        let mut collector = SlotCollector {
            grads: &mut grads,
            slots: Vec::new(),
        };
        module.visit(&mut collector);
        let mut slots = collector.slots;

        let presence_start = Instant::now();
        let present = self.exchange_presence(&slots)?;
        let presence = presence_start.elapsed();

        let buckets = plan_buckets(&slots, &present, self.bucket_cap_elems);
        let elements = buckets.iter().map(|b| b.len).sum();
        let all_reduce = self.reduce_buckets(&mut slots, &buckets)?;

        let mut writer = SlotWriter {
            grads: &mut grads,
            slots: slots.iter_mut(),
        };
        module.visit(&mut writer);
        self.last = SyncStats {
            total: start.elapsed(),
            all_reduce,
            presence,
            buckets: buckets.len(),
            elements,
        };
        tracing::trace!(stats = ?self.last, "gradients synchronised");
        Ok(grads)
    }

    /// All-reduces (Max) the presence bitmap plus a layout fingerprint; returns which slots
    /// have a gradient on at least one rank.
    fn exchange_presence(&self, slots: &[Slot]) -> Result<Vec<bool>> {
        let n = slots.len();
        let fp = layout_fingerprint(slots).to_le_bytes();
        let mut buf = Vec::with_capacity(n + 16);
        buf.extend(slots.iter().map(|s| u8::from(s.grad.is_some())));
        buf.extend_from_slice(&fp);
        buf.extend(fp.iter().map(|b| !b));
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
        Ok(bits.iter().map(|&b| b != 0).collect())
    }

    /// Pipelines host copies (this thread) and all-reduces (a comm thread).
    fn reduce_buckets(&self, slots: &mut [Slot], buckets: &[Bucket]) -> Result<Duration> {
        if buckets.is_empty() {
            return Ok(Duration::ZERO);
        }
        let world = self.world_size as f32;
        let group = self.group.clone();
        std::thread::scope(|scope| {
            // Bounded: at most two filled buckets wait for the comm thread.
            let (to_comm, comm_in) = mpsc::sync_channel::<(usize, Vec<f32>)>(2);
            let (comm_out, from_comm) = mpsc::channel::<(usize, Vec<f32>)>();
            let comm = scope.spawn(move || -> Result<Duration> {
                let mut g = comm::lock(&group);
                let mut busy = Duration::ZERO;
                for (k, mut buf) in comm_in {
                    let t = Instant::now();
                    g.all_reduce(&mut buf, ReduceOp::Sum)?;
                    busy += t.elapsed();
                    buf.iter_mut().for_each(|x| *x /= world);
                    if comm_out.send((k, buf)).is_err() {
                        break;
                    }
                }
                Ok(busy)
            });

            let mut fill_err = None;
            for (k, bucket) in buckets.iter().enumerate() {
                match fill_bucket(slots, bucket) {
                    Ok(buf) => {
                        if to_comm.send((k, buf)).is_err() {
                            break; // the comm thread failed; its error is reported below
                        }
                    }
                    Err(e) => {
                        fill_err = Some(e);
                        break;
                    }
                }
                while let Ok((k, buf)) = from_comm.try_recv() {
                    unpack_bucket(slots, &buckets[k], buf);
                }
            }
            drop(to_comm);
            for (k, buf) in from_comm.iter() {
                unpack_bucket(slots, &buckets[k], buf);
            }
            let busy = comm
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))?;
            match fill_err {
                Some(e) => Err(e),
                None => Ok(busy),
            }
        })
    }
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

/// Copies a bucket's gradients to one f32 host buffer (zeros for slots without a gradient on
/// this rank).
fn fill_bucket(slots: &mut [Slot], bucket: &Bucket) -> Result<Vec<f32>> {
    let mut buf = Vec::with_capacity(bucket.len);
    for &i in &bucket.slots {
        let slot = &mut slots[i];
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
    debug_assert_eq!(buf.len(), bucket.len);
    Ok(buf)
}

fn data_err(slot: &Slot, e: impl std::fmt::Debug) -> DdpError {
    DdpError::TensorData {
        what: format!("gradient of parameter {}", slot.id),
        msg: format!("{e:?}"),
    }
}

/// Splits a reduced bucket back into its slots.
fn unpack_bucket(slots: &mut [Slot], bucket: &Bucket, buf: Vec<f32>) {
    if let [only] = bucket.slots[..] {
        slots[only].reduced = Some(buf);
        return;
    }
    let mut off = 0;
    for &i in &bucket.slots {
        let n = slots[i].numel;
        slots[i].reduced = Some(buf[off..off + n].to_vec());
        off += n;
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

    fn grads_of(net: &Net, device: &Device) -> GradientsParams {
        let x = Tensor::<2>::random([5, 3], Distribution::Default, device);
        let loss = net.b.forward(net.a.forward(x.clone())).sum() + net.frozen.forward(x).sum();
        GradientsParams::from_grads(loss.backward(), net)
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
        let net = Net {
            a: LinearConfig::new(3, 4).init(&device),
            b: LinearConfig::new(4, 2).init(&device),
            unused: LinearConfig::new(3, 3).init(&device),
            frozen: LinearConfig::new(3, 1).init(&device).no_grad(),
        };
        let group = Arc::new(Mutex::new(ProcessGroup::single()));
        for cap in [4, 16, 40, 1 << 20] {
            let grads = grads_of(&net, &device);
            let before_a = values::<2>(&grads, net.a.weight.id).unwrap();
            let before_bb = values::<1>(&grads, net.b.bias.as_ref().unwrap().id).unwrap();
            let mut sync = GradientSynchronizer::new(group.clone(), cap);
            sync.skip_when_alone = false;
            let out = sync.sync(&net, grads).unwrap();
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
