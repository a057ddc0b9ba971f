//! The parameters' gather on the device communicator (NCCL): the owners' updated parameters,
//! flat in f32 on their device (exact for f32, f16 and bf16 values), laid out owner by owner
//! as on the host ([`OwnerStreams`]), all-gathered in device memory bucket by bucket
//! ([`DeviceComm::all_gather_into`]) and turned back into each parameter in its own dtype: no
//! host copy. Every value is the owner's, bitwise. Only taken when every rank voted for the
//! device path, whose vote requires f32, f16 or bf16 gradients (an f64 model takes the host
//! path, which moves raw bytes).

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{DType, Tensor};

use super::gather::GatherStats;
use super::owner_streams::OwnerStreams;
use super::plan::ShardPlan;
use crate::cuda::DeviceComm;
use crate::error::Result;

/// Every rank's `module` with the values the owners of the `stepped` parameters (visit
/// order; the same on every rank) computed, gathered by `comm` in buckets of about
/// `cap_bytes` (see the [module docs](self)).
///
/// # Errors
/// A collective failed.
pub(crate) fn all_gather_params_on_device<M: Module>(
    module: M,
    plan: &ShardPlan,
    stepped: &[bool],
    comm: &DeviceComm,
    cap_bytes: usize,
) -> Result<(M, GatherStats)> {
    let mut stats = GatherStats::default();
    if plan.world_size == 1 || !stepped.iter().any(|&s| s) {
        return Ok((module, stats));
    }
    let mut read = ReadStepped {
        stepped,
        index: 0,
        flat: (0..plan.params.len()).map(|_| None).collect(),
    };
    module.visit(&mut read);
    let flat = read.flat;
    let sizes: Vec<usize> = plan
        .params
        .iter()
        .map(|p| p.shape.iter().product())
        .collect();
    let streams = OwnerStreams::new(&sizes, stepped, &plan.owners, plan.world_size);
    let buckets = streams.buckets((cap_bytes / 4).max(1));
    // The pieces of each parameter another rank owns, in order.
    let mut pieces: Vec<Vec<Tensor<1>>> = vec![Vec::new(); plan.params.len()];
    for k in 0..buckets {
        let counts = streams.counts(buckets, k);
        let mut parts = Vec::new();
        for p in 0..plan.world_size {
            let part = streams.part(p, buckets, k);
            for (i, range, _) in streams.overlaps(p, &part) {
                let values = flat[i].as_ref().expect("every stepped parameter is read");
                parts.push(values.clone().slice(range));
            }
        }
        if parts.is_empty() {
            continue;
        }
        let gathered = comm.all_gather_into(Tensor::cat(parts, 0), &counts)?;
        stats.buckets += 1;
        let mut at = 0;
        for (p, &count) in counts.iter().enumerate() {
            if p != plan.rank {
                let part = streams.part(p, buckets, k);
                for (i, range, off) in streams.overlaps(p, &part) {
                    pieces[i].push(gathered.clone().slice(at + off..at + off + range.len()));
                }
                stats.received += count * 4;
            } else {
                stats.sent += count * 4;
            }
            at += count;
        }
    }
    let mut replace = ReplaceFromPieces { pieces, index: 0 };
    Ok((module.map(&mut replace), stats))
}

/// Reads every stepped parameter flat in f32 (the owners' values are the inputs of the
/// gather; the others only fill their place in the buffer).
struct ReadStepped<'a> {
    stepped: &'a [bool],
    index: usize,
    flat: Vec<Option<Tensor<1>>>,
}

impl ModuleVisitor for ReadStepped<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.is_require_grad() {
            return;
        }
        let i = self.index;
        self.index += 1;
        if self.stepped.get(i).copied().unwrap_or(false) {
            let value = param.val();
            let n = value.shape().num_elements();
            self.flat[i] = Some(value.reshape([n]).cast(DType::F32));
        }
    }
}

/// Replaces the parameters other ranks own by their gathered pieces, in their own dtype.
struct ReplaceFromPieces {
    pieces: Vec<Vec<Tensor<1>>>,
    index: usize,
}

impl ModuleMapper for ReplaceFromPieces {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !param.is_require_grad() {
            return param;
        }
        let i = self.index;
        self.index += 1;
        let mut mine = std::mem::take(&mut self.pieces[i]);
        let flat = match mine.len() {
            0 => return param,
            1 => mine.pop().expect("one piece"),
            _ => Tensor::cat(mine, 0),
        };
        let (id, tensor, mapper) = param.consume();
        let value = flat
            .reshape(tensor.shape())
            .cast(tensor.dtype())
            .detach()
            .require_grad();
        Param::from_mapped_value(id, value, mapper)
    }
}
