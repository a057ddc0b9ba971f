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
use crate::owner_streams::OwnerStreams;

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
            self.last_on_device = true;
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
            self.last_on_device = false;
            let wire = host_wire(self.compression, presence.any_tcp);
            let sizes: Vec<usize> = slots.iter().map(|s| s.numel).collect();
            let plan = OwnerStreams::new(&sizes, &present, owners, self.world_size);
            let buckets = plan.buckets(self.bucket_cap_elems);
            let mut host: Vec<Option<TensorData>> = (0..slots.len()).map(|_| None).collect();
            let mut kept: Vec<Option<Vec<f32>>> = slots
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    (present[i] && owners[i] == rank).then(|| Vec::with_capacity(s.numel))
                })
                .collect();
            for k in 0..buckets {
                let t = Instant::now();
                let counts = plan.counts(buckets, k);
                let mut buf = fill(&plan, &mut slots, &mut host, buckets, k, &counts)?;
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
                keep(
                    &plan,
                    rank,
                    buckets,
                    k,
                    &buf[at..at + counts[rank]],
                    &mut kept,
                );
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
            stats.elements = plan.total();
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

/// Bucket `k`'s buffer of `buckets`, whose owners' parts have `counts` values: every owner's
/// part in rank order, this rank's gradients (zeros where it has none). A slot's host copy is
/// read at its first use and dropped after its last.
fn fill(
    plan: &OwnerStreams,
    slots: &mut [Slot],
    host: &mut [Option<TensorData>],
    buckets: usize,
    k: usize,
    counts: &[usize],
) -> Result<Vec<f32>> {
    let _span = ddp_comm::trace::span("bucket_fill", "ddp").arg("bucket", k);
    let mut buf = Vec::with_capacity(counts.iter().sum());
    for p in 0..counts.len() {
        let part = plan.part(p, buckets, k);
        for (i, range, _) in plan.overlaps(p, &part) {
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
    Ok(buf)
}

/// Appends this rank's reduced part of bucket `k` to its parameters' gradients (each
/// gradient's pieces come in order over the buckets).
fn keep(
    plan: &OwnerStreams,
    rank: usize,
    buckets: usize,
    k: usize,
    reduced: &[f32],
    kept: &mut [Option<Vec<f32>>],
) {
    let part = plan.part(rank, buckets, k);
    for (i, range, off) in plan.overlaps(rank, &part) {
        if let Some(v) = kept[i].as_mut() {
            v.extend_from_slice(&reduced[off..off + range.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_keeps_its_reduced_parts() {
        let sizes = [4, 2, 3];
        let present = [true, true, true];
        let owners = [1, 0, 1];
        let plan = OwnerStreams::new(&sizes, &present, &owners, 2);
        let mut kept: Vec<Option<Vec<f32>>> = vec![Some(Vec::new()), None, Some(Vec::new())];
        // Owner 1's stream is slot 0 then slot 2: 7 values in 2 buckets (3 + 4).
        keep(&plan, 1, 2, 0, &[1.0, 2.0, 3.0], &mut kept);
        keep(&plan, 1, 2, 1, &[4.0, 5.0, 6.0, 7.0], &mut kept);
        assert_eq!(kept[0].as_deref(), Some(&[1.0, 2.0, 3.0, 4.0][..]));
        assert_eq!(kept[2].as_deref(), Some(&[5.0, 6.0, 7.0][..]));
    }
}
