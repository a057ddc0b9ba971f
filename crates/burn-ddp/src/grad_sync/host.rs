//! The host path: buckets read into host buffers by the calling thread and all-reduced over
//! the process group by a comm thread, pipelined, then turned back into tensors.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use burn::tensor::{DType, Tensor, TensorData};
use ddp_comm::{Collectives, Compression, ReduceOp};

use super::buckets::Bucket;
use super::slots::Slot;
use super::{GradientSynchronizer, PipelineTimes};
use crate::comm;
use crate::error::{DdpError, Result};

impl GradientSynchronizer {
    /// Pipelines host copies (this thread) and all-reduces (a comm thread).
    pub(crate) fn reduce_buckets(
        &self,
        slots: &mut [Slot],
        buckets: &[Bucket],
        wire: Compression,
    ) -> Result<PipelineTimes> {
        let mut times = PipelineTimes::default();
        if buckets.is_empty() {
            return Ok(times);
        }
        if !self.overlap {
            for (index, bucket) in buckets.iter().enumerate() {
                let t = Instant::now();
                let mut parts = fill_bucket(slots, bucket)?;
                times.fill += t.elapsed();
                let t = Instant::now();
                reduce_parts(&mut *comm::lock(&self.group), &mut parts, wire, index)?;
                times.all_reduce += t.elapsed();
                let t = Instant::now();
                unpack_bucket(slots, parts);
                times.write_back += t.elapsed();
            }
            return Ok(times);
        }
        let group = self.group.clone();
        let compression = wire;
        std::thread::scope(|scope| {
            // Bounded: at most two filled buckets wait for the comm thread.
            let (to_comm, comm_in) = mpsc::sync_channel::<Vec<Part>>(2);
            let (comm_out, from_comm) = mpsc::channel::<Vec<Part>>();
            let comm = scope.spawn(move || -> Result<Duration> {
                let mut g = comm::lock(&group);
                let mut busy = Duration::ZERO;
                for (index, mut parts) in comm_in.into_iter().enumerate() {
                    let t = Instant::now();
                    reduce_parts(&mut *g, &mut parts, compression, index)?;
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

/// Gradients of at least this many values are all-reduced in their own host buffer (the
/// one the backend hands over, without a copy on Flex) instead of being copied into a packed
/// buffer: one more collective call costs microseconds, a copy of a large gradient costs
/// milliseconds. The choice depends only on sizes, so every rank makes the same calls.
pub(crate) const IN_PLACE_MIN_ELEMS: usize = 1 << 16;

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
/// as it finishes reducing it), on the wire as `compression` says. Written against
/// [`Collectives`] on host memory: the host group in every job. Each all-reduce is labelled
/// `gradient bucket <bucket>` in the flight recorder.
fn reduce_parts<C: Collectives<Buffer = [f32]>>(
    group: &mut C,
    parts: &mut [Part],
    compression: Compression,
    bucket: usize,
) -> Result<()> {
    for part in parts {
        ddp_comm::doctor::label_next(ddp_comm::doctor::Label::indexed(
            "gradient bucket",
            bucket as u64,
        ));
        group.all_reduce(part.values()?, ReduceOp::Mean, compression)?;
    }
    Ok(())
}

/// Reads a bucket's gradients to host buffers: large gradients each in their own buffer,
/// runs of small ones packed together (see [`IN_PLACE_MIN_ELEMS`]).
fn fill_bucket(slots: &mut [Slot], bucket: &Bucket) -> Result<Vec<Part>> {
    let _span = ddp_comm::trace::span("bucket_fill", "ddp")
        .arg("values", bucket.len)
        .arg("slots", bucket.slots.len());
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
            let data = slot.take_host_f32();
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
    let _span = ddp_comm::trace::span("write_back", "ddp").arg("parts", parts.len());
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
