//! The sharded optimizer's gradient path: every gradient averaged over all ranks and kept
//! only on the rank that owns its parameter ([`GradientSynchronizer::sync_to_owners`]).
//!
//! The present gradients are laid out owner by owner (each owner's parameters in visit
//! order: its *stream*) and reduce-scattered over the process group, so each rank receives,
//! averages and keeps `1/n` of the gradient bytes instead of all of them: half the traffic of
//! an all-reduce. Bucket `k` of `B` holds the `k`-th of `B` near-equal parts of every owner's
//! stream, so every call moves a part of every rank's shard (a parameter may span buckets),
//! and a bucket holds about the bucket cap. The group sums every element in rank order, as
//! its all-reduce does, so each kept gradient is bitwise what [`GradientSynchronizer::sync`]
//! gives it.

use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use ddp_comm::ReduceOp;

use super::buckets::plan_buckets;
use super::slots::{Slot, SlotCollector, SlotWriter};
use super::{GradientSynchronizer, SyncStats, host_wire};
use crate::comm;
use crate::error::{DdpError, Result};

/// What [`GradientSynchronizer::sync_to_owners`] returns.
pub(crate) struct OwnedGradients {
    /// The averaged gradients of this rank's parameters (no others).
    pub(crate) grads: GradientsParams,
    /// Per trainable parameter (visit order): whether it has a gradient on some rank, i.e.
    /// whether its owner steps it (the same on every rank).
    pub(crate) present: Vec<bool>,
}

impl GradientSynchronizer {
    /// Averages every gradient over all ranks like [`Self::sync`] and keeps only those of the
    /// parameters this rank owns; `owners` gives the owner of each trainable parameter in
    /// visit order (the same table on every rank). See the [module docs](self).
    ///
    /// # Errors
    /// As [`Self::sync`].
    pub(crate) fn sync_to_owners<M: Module>(
        &mut self,
        module: &M,
        mut grads: GradientsParams,
        owners: &[usize],
    ) -> Result<OwnedGradients> {
        let start = Instant::now();
        let _span = ddp_comm::trace::span("grad_sync", "ddp")
            .arg("compression", self.compression.name())
            .arg("to_owners", true);
        let mut collector = SlotCollector {
            grads: &mut grads,
            slots: Vec::new(),
        };
        module.visit(&mut collector);
        let mut slots = collector.slots;
        if slots.len() != owners.len() {
            return Err(DdpError::InvalidSetting(format!(
                "the owner table has {} entries for {} trainable parameters",
                owners.len(),
                slots.len()
            )));
        }
        if self.world_size == 1 && self.skip_when_alone {
            let present: Vec<bool> = slots.iter().map(|s| s.grad.is_some()).collect();
            for s in &mut slots {
                s.reduced = s.grad.take();
            }
            write_back(module, &mut grads, &mut slots);
            self.last = SyncStats {
                total: start.elapsed(),
                ..SyncStats::default()
            };
            return Ok(OwnedGradients { grads, present });
        }
        let rank = comm::lock(&self.group).rank();
        let presence_start = Instant::now();
        let presence = self.exchange_presence(&slots, self.device_vote(&slots))?;
        let presence_time = presence_start.elapsed();
        let present = presence.present;
        let mut stats = SyncStats {
            presence: presence_time,
            ..SyncStats::default()
        };
        if presence.on_device {
            // NCCL: the device all-reduce of every bucket, then this rank keeps its own.
            #[cfg(feature = "cuda")]
            {
                self.last_on_device = true;
            }
            let buckets = plan_buckets(&slots, &present, self.bucket_cap_elems);
            let times = self.reduce_buckets_on_device(&mut slots, &buckets)?;
            for (i, s) in slots.iter_mut().enumerate() {
                if owners[i] != rank {
                    s.reduced = None;
                }
            }
            stats.all_reduce = times.all_reduce;
            stats.fill = times.fill;
            stats.write_back = times.write_back;
            stats.buckets = buckets.len();
            stats.elements = buckets.iter().map(|b| b.len).sum();
        } else {
            #[cfg(feature = "cuda")]
            {
                self.last_on_device = false;
            }
            let wire = host_wire(self.compression, presence.any_tcp);
            let plan = OwnerPlan::new(&slots, &present, owners, self.world_size);
            let buckets = plan.buckets(self.bucket_cap_elems);
            let mut host: Vec<Option<TensorData>> = (0..slots.len()).map(|_| None).collect();
            let mut kept: Vec<Option<Vec<f32>>> = slots
                .iter()
                .enumerate()
                .map(|(i, s)| (present[i] && owners[i] == rank).then(|| vec![0f32; s.numel]))
                .collect();
            for k in 0..buckets {
                let t = Instant::now();
                let (mut buf, counts) = plan.fill(&mut slots, &mut host, buckets, k)?;
                stats.fill += t.elapsed();
                let t = Instant::now();
                comm::lock(&self.group).reduce_scatter_compressed(
                    &mut buf,
                    &counts,
                    ReduceOp::Mean,
                    wire,
                )?;
                stats.all_reduce += t.elapsed();
                let t = Instant::now();
                let at: usize = counts[..rank].iter().sum();
                plan.keep(rank, buckets, k, &buf[at..at + counts[rank]], &mut kept);
                stats.write_back += t.elapsed();
            }
            for (slot, values) in slots.iter_mut().zip(kept) {
                if let Some(v) = values {
                    let n = v.len();
                    slot.reduced = Some(Tensor::<1>::from_data(
                        TensorData::new(v, [n]),
                        &slot.device,
                    ));
                }
            }
            stats.buckets = buckets;
            stats.elements = plan.totals.iter().sum();
        }
        let t = Instant::now();
        write_back(module, &mut grads, &mut slots);
        stats.write_back += t.elapsed();
        stats.total = start.elapsed();
        self.last = stats;
        Ok(OwnedGradients { grads, present })
    }
}

/// Registers the slots' reduced gradients (only those that have one) back into `grads`.
fn write_back<M: Module>(module: &M, grads: &mut GradientsParams, slots: &mut [Slot]) {
    let mut writer = SlotWriter {
        grads,
        slots: slots.iter_mut(),
    };
    module.visit(&mut writer);
}

/// The present slots of each owner in visit order (its stream), and where each starts.
struct OwnerPlan {
    /// Per owner: `(slot, first element of the slot in the owner's stream)`.
    streams: Vec<Vec<(usize, usize)>>,
    /// Elements of each owner's stream.
    totals: Vec<usize>,
}

impl OwnerPlan {
    fn new(slots: &[Slot], present: &[bool], owners: &[usize], world: usize) -> Self {
        let mut streams = vec![Vec::new(); world];
        let mut totals = vec![0usize; world];
        for (i, slot) in slots.iter().enumerate() {
            if present[i] {
                let o = owners[i];
                streams[o].push((i, totals[o]));
                totals[o] += slot.numel;
            }
        }
        OwnerPlan { streams, totals }
    }

    /// Buckets for a cap of `cap` values: each holds about `cap / world` values of every
    /// owner's stream (0 when nothing is present).
    fn buckets(&self, cap: usize) -> usize {
        let per_owner = (cap / self.totals.len()).max(1);
        self.totals
            .iter()
            .map(|t| t.div_ceil(per_owner))
            .max()
            .unwrap_or(0)
    }

    /// Owner `p`'s stream elements in bucket `k` of `buckets`.
    fn part(&self, p: usize, buckets: usize, k: usize) -> std::ops::Range<usize> {
        let at = |k: usize| ((self.totals[p] as u128 * k as u128) / buckets as u128) as usize;
        at(k)..at(k + 1)
    }

    /// The slots of owner `p` that overlap stream range `part`, with the overlap as
    /// `(slot, range inside the slot, offset inside part)`.
    fn overlaps(
        &self,
        p: usize,
        part: &std::ops::Range<usize>,
        slots: &[Slot],
    ) -> impl Iterator<Item = (usize, std::ops::Range<usize>, usize)> + '_ {
        let part = part.clone();
        // The first slot that ends after the part starts.
        let stream = &self.streams[p];
        let first = stream.partition_point(|&(i, at)| at + slots[i].numel <= part.start);
        let numel: Vec<usize> = stream[first..]
            .iter()
            .map(|&(i, _)| slots[i].numel)
            .collect();
        stream[first..]
            .iter()
            .zip(numel)
            .take_while(move |&(&(_, at), _)| at < part.end)
            .map(move |(&(i, at), n)| {
                let from = part.start.max(at);
                let to = part.end.min(at + n);
                (i, from - at..to - at, from - part.start)
            })
    }

    /// Bucket `k`'s buffer (every owner's part in rank order: this rank's gradients, zeros
    /// where it has none) and the parts' sizes. A slot's host copy is read at its first use
    /// and dropped after its last.
    fn fill(
        &self,
        slots: &mut [Slot],
        host: &mut [Option<TensorData>],
        buckets: usize,
        k: usize,
    ) -> Result<(Vec<f32>, Vec<usize>)> {
        let _span = ddp_comm::trace::span("bucket_fill", "ddp").arg("bucket", k);
        let world = self.totals.len();
        let counts: Vec<usize> = (0..world).map(|p| self.part(p, buckets, k).len()).collect();
        let mut buf = Vec::with_capacity(counts.iter().sum());
        for p in 0..world {
            let part = self.part(p, buckets, k);
            let pieces: Vec<_> = self.overlaps(p, &part, slots).collect();
            for (i, range, _) in pieces {
                if host[i].is_none() {
                    host[i] = Some(slots[i].take_host_f32());
                }
                let data = host[i].as_ref().expect("just read");
                let values = data.as_slice::<f32>().map_err(|e| DdpError::TensorData {
                    what: format!("gradient of parameter {}", slots[i].id),
                    msg: format!("{e:?}"),
                })?;
                buf.extend_from_slice(&values[range.clone()]);
                if range.end == slots[i].numel {
                    host[i] = None;
                }
            }
        }
        Ok((buf, counts))
    }

    /// Copies this rank's reduced part of bucket `k` into its parameters' gradients.
    fn keep(
        &self,
        rank: usize,
        buckets: usize,
        k: usize,
        reduced: &[f32],
        kept: &mut [Option<Vec<f32>>],
    ) {
        let part = self.part(rank, buckets, k);
        let slots_numel: Vec<usize> = (0..kept.len())
            .map(|i| kept[i].as_ref().map_or(0, Vec::len))
            .collect();
        let stream = &self.streams[rank];
        let first = stream.partition_point(|&(i, at)| at + slots_numel[i] <= part.start);
        for &(i, at) in &stream[first..] {
            if at >= part.end {
                break;
            }
            let from = part.start.max(at);
            let to = part.end.min(at + slots_numel[i]);
            if let Some(v) = kept[i].as_mut() {
                v[from - at..to - at].copy_from_slice(&reduced[from - part.start..to - part.start]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::DType;

    fn slots(sizes: &[usize]) -> Vec<Slot> {
        let device = burn::tensor::Device::flex();
        sizes
            .iter()
            .map(|&n| Slot {
                id: burn::module::ParamId::new(),
                shape: burn::tensor::Shape::new([n]),
                numel: n,
                dtype: DType::F32,
                device: device.clone(),
                grad: None,
                reduced: None,
            })
            .collect()
    }

    #[test]
    fn every_owner_stream_is_cut_into_the_buckets_in_order() {
        let s = slots(&[10, 3, 7, 5, 1]);
        let present = [true, true, false, true, true];
        let owners = [0, 1, 0, 1, 0];
        let plan = OwnerPlan::new(&s, &present, &owners, 2);
        assert_eq!(plan.totals, [11, 8]);
        assert_eq!(plan.buckets(8), 3, "4 values per owner per bucket");
        assert_eq!(plan.buckets(1000), 1);
        // Every element of owner 0's stream lands in exactly one bucket, in order.
        let mut seen = Vec::new();
        for k in 0..3 {
            let part = plan.part(0, 3, k);
            for (i, range, off) in plan.overlaps(0, &part, &s) {
                assert!(off + range.len() <= part.len());
                seen.extend(range.map(|e| (i, e)));
            }
        }
        let want: Vec<(usize, usize)> = (0..10).map(|e| (0, e)).chain([(4, 0)]).collect();
        assert_eq!(seen, want);
    }

    #[test]
    fn a_rank_keeps_its_reduced_parts() {
        let s = slots(&[4, 2, 3]);
        let present = [true, true, true];
        let owners = [1, 0, 1];
        let plan = OwnerPlan::new(&s, &present, &owners, 2);
        let mut kept: Vec<Option<Vec<f32>>> = vec![Some(vec![0.0; 4]), None, Some(vec![0.0; 3])];
        // Owner 1's stream is slot 0 then slot 2: 7 values in 2 buckets (3 + 4).
        plan.keep(1, 2, 0, &[1.0, 2.0, 3.0], &mut kept);
        plan.keep(1, 2, 1, &[4.0, 5.0, 6.0, 7.0], &mut kept);
        assert_eq!(kept[0].as_deref(), Some(&[1.0, 2.0, 3.0, 4.0][..]));
        assert_eq!(kept[2].as_deref(), Some(&[5.0, 6.0, 7.0][..]));
    }
}
