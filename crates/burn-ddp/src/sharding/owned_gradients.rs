//! The sharded optimizer's gradient path: every gradient averaged over all ranks and kept
//! only on the rank that owns its parameter ([`GradientSynchronizer::sync_to_owners`]).
//!
//! On the device communicator (NCCL, when every rank voted for it) the owner-major buckets
//! below are packed on the device and reduce-scattered there. Otherwise, where every pair of
//! ranks shares memory (one host), the gradients are all-reduced as by
//! [`GradientSynchronizer::sync`] and each rank keeps its own: there the all-reduce's second
//! half costs what the copies into owner-major buckets would. Otherwise (TCP), the present
//! gradients are laid out owner by owner (each owner's parameters in visit
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
use burn::tensor::{DType, Tensor, TensorData};
use ddp_comm::{Collectives, Compression, ReduceOp};

use super::owner_streams::OwnerStreams;
use crate::comm;
use crate::error::{DdpError, Result};
use crate::grad_sync::buckets::plan_buckets;
use crate::grad_sync::slots::{Slot, SlotCollector, SlotWriter};
use crate::grad_sync::{GradientSynchronizer, PipelineTimes, SyncStats, host_wire};

/// What [`GradientSynchronizer::sync_to_owners`] returns.
pub(crate) struct OwnedGradients {
    /// The averaged gradients of this rank's parameters (no others).
    pub(crate) grads: GradientsParams,
    /// Per trainable parameter (visit order): whether it has a gradient on some rank, i.e.
    /// whether its owner steps it (the same on every rank).
    pub(crate) present: Vec<bool>,
    /// Whether the gradients went through the device communicator (then every rank's
    /// parameters are on its device, and the parameters' gather can stay there too).
    pub(crate) on_device: bool,
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
        self.check_replicas_once(module)?;
        let mut collector = SlotCollector {
            grads: &mut grads,
            slots: Vec::new(),
        };
        module.visit(&mut collector);
        let mut slots = collector.slots;
        if slots.len() != owners.len() {
            return Err(DdpError::InvalidSetting {
                setting: "the sharded optimizer's owner table",
                reason: format!(
                    "{} entries for {} trainable parameters",
                    owners.len(),
                    slots.len()
                ),
            });
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
            return Ok(OwnedGradients {
                grads,
                present,
                on_device: false,
            });
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
            // NCCL: the owner-major buckets of the TCP path below, packed on the device and
            // reduce-scattered there (each rank receives and keeps 1/n of the bytes).
            self.last_on_device = true;
            let sizes: Vec<usize> = slots.iter().map(|s| s.numel).collect();
            let plan = OwnerStreams::new(&sizes, &present, owners, self.world_size);
            let owned: Vec<bool> = (0..slots.len())
                .map(|i| present[i] && owners[i] == rank)
                .collect();
            let (buckets, times) =
                self.reduce_scatter_on_device(&mut slots, &plan, &owned, rank)?;
            stats.all_reduce = times.all_reduce;
            stats.fill = times.fill;
            stats.write_back = times.write_back;
            stats.buckets = buckets;
            stats.elements = plan.total();
        } else if !presence.any_tcp {
            // Shared memory between every pair of ranks: the all-reduce of every bucket (the
            // unsharded path, which reduces a large gradient in the buffer its tensor hands
            // over), then this rank keeps its own. There the all-reduce's second half is a
            // copy the reduce-scatter's owner-major buckets would cost anyway
            // (docs/benchmarks.md measures both); over TCP the reduce-scatter below sends half
            // the bytes. Both sum in rank order: the same bits.
            self.last_on_device = false;
            let buckets = plan_buckets(&slots, &present, self.bucket_cap_elems);
            let times = self.reduce_buckets(&mut slots, &buckets, Compression::None)?;
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
            // Host copies of the gradients (the buffers the tensors hand over, no copy on
            // Flex). An owned gradient's buffer stays until the end: its reduced parts are
            // written into it, and it becomes the averaged gradient (no new allocation).
            let mut host: Vec<Option<TensorData>> = (0..slots.len()).map(|_| None).collect();
            let owned: Vec<bool> = (0..slots.len())
                .map(|i| present[i] && owners[i] == rank)
                .collect();
            // One bucket buffer for every bucket of the call.
            let mut buf: Vec<f32> = Vec::new();
            for k in 0..buckets {
                let t = Instant::now();
                let counts = plan.counts(buckets, k);
                fill(
                    &plan, &mut slots, &mut host, &owned, buckets, k, &counts, &mut buf,
                )?;
                stats.fill += t.elapsed();
                let t = Instant::now();
                // The host group through the interface the device path uses too.
                Collectives::reduce_scatter(
                    &mut *comm::lock(&self.group),
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
                    &mut host,
                    &slots,
                )?;
                stats.write_back += t.elapsed();
            }
            for (i, slot) in slots.iter_mut().enumerate() {
                if owned[i]
                    && let Some(data) = host[i].take()
                {
                    slot.reduced = Some(Tensor::<1>::from_data(data, &slot.device));
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
        Ok(OwnedGradients {
            grads,
            present,
            on_device: self.last_on_device,
        })
    }
}

impl GradientSynchronizer {
    /// The sharded gradient path on the device communicator: bucket `k` of the owner-major
    /// layout `plan` (every owner's `k`-th part, this rank's gradients, zeros where it has
    /// none) concatenated on the device, reduce-scattered by the device communicator
    /// (`DeviceComm::reduce_scatter`) with Mean, and this rank's reduced pieces
    /// joined into the gradients of the parameters it `owned`. Returns the number of buckets
    /// and the times.
    fn reduce_scatter_on_device(
        &self,
        slots: &mut [Slot],
        plan: &OwnerStreams,
        owned: &[bool],
        rank: usize,
    ) -> Result<(usize, PipelineTimes)> {
        let mut times = PipelineTimes::default();
        let Some(device_comm) = &self.device_comm else {
            return Err(DdpError::InvalidSetting {
                setting: "the sharded optimizer's device path",
                reason: "chosen without a device communicator".into(),
            });
        };
        let t = Instant::now();
        // Every gradient flat in f32 on its device (zeros where this rank has none).
        let flat: Vec<Tensor<1>> = slots
            .iter_mut()
            .map(|slot| match slot.grad.take() {
                Some(g) => g.cast(DType::F32),
                None => Tensor::<1>::zeros([slot.numel], (&slot.device, DType::F32)),
            })
            .collect();
        times.fill += t.elapsed();
        let buckets = plan.buckets(self.bucket_cap_elems);
        // This rank's reduced pieces of each owned gradient, in order.
        let mut pieces: Vec<Vec<Tensor<1>>> = vec![Vec::new(); slots.len()];
        for k in 0..buckets {
            let t = Instant::now();
            let counts = plan.counts(buckets, k);
            let mut parts = Vec::new();
            for p in 0..counts.len() {
                let part = plan.part(p, buckets, k);
                for (i, range, _) in plan.overlaps(p, &part) {
                    parts.push(flat[i].clone().slice(range));
                }
            }
            times.fill += t.elapsed();
            if parts.is_empty() {
                continue;
            }
            let t = Instant::now();
            let packed = Tensor::cat(parts, 0);
            ddp_comm::doctor::label_next(ddp_comm::doctor::Label::new(
                "ZeRO-1 gradient reduce-scatter",
            ));
            let reduced =
                device_comm.reduce_scatter(packed, &counts, ReduceOp::Mean, self.compression)?;
            times.all_reduce += t.elapsed();
            let t = Instant::now();
            let at: usize = counts[..rank].iter().sum();
            let part = plan.part(rank, buckets, k);
            for (i, range, off) in plan.overlaps(rank, &part) {
                if owned[i] {
                    pieces[i].push(reduced.clone().slice(at + off..at + off + range.len()));
                }
            }
            times.write_back += t.elapsed();
        }
        let t = Instant::now();
        for (slot, mut mine) in slots.iter_mut().zip(pieces) {
            slot.reduced = match mine.len() {
                0 => None,
                1 => mine.pop(),
                _ => Some(Tensor::cat(mine, 0)),
            }
            .map(|g| g.cast(slot.dtype));
        }
        times.write_back += t.elapsed();
        Ok((buckets, times))
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

/// Fills `buf` with bucket `k` of `buckets`, whose owners' parts have `counts` values: every
/// owner's part in rank order, this rank's gradients (zeros where it has none). A slot's host
/// copy is read at its first use and, unless this rank owns it (`owned`), dropped after its
/// last.
#[allow(clippy::too_many_arguments)]
fn fill(
    plan: &OwnerStreams,
    slots: &mut [Slot],
    host: &mut [Option<TensorData>],
    owned: &[bool],
    buckets: usize,
    k: usize,
    counts: &[usize],
    buf: &mut Vec<f32>,
) -> Result<()> {
    let _span = ddp_comm::trace::span("bucket_fill", "ddp").arg("bucket", k);
    buf.clear();
    buf.reserve(counts.iter().sum());
    for p in 0..counts.len() {
        let part = plan.part(p, buckets, k);
        for (i, range, _) in plan.overlaps(p, &part) {
            if host[i].is_none() {
                host[i] = Some(slots[i].take_host_f32());
            }
            let data = host[i].as_ref().expect("just read");
            let values = data.as_slice::<f32>().map_err(|e| data_err(&slots[i], e))?;
            buf.extend_from_slice(&values[range.clone()]);
            if range.end == slots[i].numel && !owned[i] {
                host[i] = None;
            }
        }
    }
    Ok(())
}

/// Writes this rank's reduced part of bucket `k` into its parameters' gradient buffers (the
/// host copies `fill` kept), each piece at its place in its gradient.
fn keep(
    plan: &OwnerStreams,
    rank: usize,
    buckets: usize,
    k: usize,
    reduced: &[f32],
    host: &mut [Option<TensorData>],
    slots: &[Slot],
) -> Result<()> {
    let part = plan.part(rank, buckets, k);
    for (i, range, off) in plan.overlaps(rank, &part) {
        if let Some(data) = host[i].as_mut() {
            let values = data
                .as_mut_slice::<f32>()
                .map_err(|e| data_err(&slots[i], e))?;
            values[range.clone()].copy_from_slice(&reduced[off..off + range.len()]);
        }
    }
    Ok(())
}

fn data_err(slot: &Slot, e: impl std::fmt::Debug) -> DdpError {
    DdpError::TensorData {
        what: format!("gradient of parameter {}", slot.id),
        msg: format!("{e:?}"),
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
        let device = burn::tensor::Device::flex();
        let slots: Vec<Slot> = sizes
            .iter()
            .map(|&n| Slot {
                id: burn::module::ParamId::new(),
                shape: [n].into(),
                numel: n,
                dtype: burn::tensor::DType::F32,
                device: device.clone(),
                grad: None,
                reduced: None,
            })
            .collect();
        let mut host: Vec<Option<TensorData>> = vec![
            Some(TensorData::new(vec![0f32; 4], [4])),
            None,
            Some(TensorData::new(vec![0f32; 3], [3])),
        ];
        // Owner 1's stream is slot 0 then slot 2: 7 values in 2 buckets (3 + 4).
        keep(&plan, 1, 2, 0, &[1.0, 2.0, 3.0], &mut host, &slots).unwrap();
        keep(&plan, 1, 2, 1, &[4.0, 5.0, 6.0, 7.0], &mut host, &slots).unwrap();
        let values = |d: &Option<TensorData>| d.as_ref().map(|d| d.try_to_vec::<f32>().unwrap());
        assert_eq!(values(&host[0]), Some(vec![1.0, 2.0, 3.0, 4.0]));
        assert_eq!(values(&host[2]), Some(vec![5.0, 6.0, 7.0]));
    }
}
