//! After the owners stepped their parameters: every rank's copy of each updated parameter,
//! all-gathered from its owner in buckets.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Tensor, TensorData};

use super::error::ShardingError;
use super::plan::ShardPlan;
use crate::comm::{self, SharedGroup};
use crate::error::Result;
use crate::owner_streams::OwnerStreams;

/// Bytes moved by one [`all_gather_params`] call and how it went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct GatherStats {
    /// All-gather calls (buckets).
    pub(crate) buckets: usize,
    /// Bytes this rank sent (its updated parameters).
    pub(crate) sent: usize,
    /// Bytes this rank received (the others' updated parameters).
    pub(crate) received: usize,
}

/// Every rank's `module` with the values that the owners of the `stepped` parameters (visit
/// order; the same on every rank) computed. The parameters travel as raw bytes in their own
/// dtype, so the copies are bitwise the owner's, laid out owner by owner
/// ([`OwnerStreams`]): each all-gather call of at most about `cap_bytes` carries a part of
/// every owner's parameters, so every rank sends and receives at once, and the host copies
/// stay bounded by the bucket.
///
/// # Errors
/// A collective failed, or a rank's contribution has another size than the plan says.
pub(crate) fn all_gather_params<M: Module>(
    module: M,
    plan: &ShardPlan,
    stepped: &[bool],
    group: &SharedGroup,
    cap_bytes: usize,
) -> Result<(M, GatherStats)> {
    let mut stats = GatherStats::default();
    if plan.world_size == 1 {
        return Ok((module, stats));
    }
    // This rank's updated parameters, as bytes.
    let mut mine = ReadOwned {
        plan,
        stepped,
        index: 0,
        bytes: (0..plan.params.len()).map(|_| None).collect(),
    };
    module.visit(&mut mine);
    let mine = mine.bytes;
    for (i, data) in mine.iter().enumerate() {
        if let Some(d) = data
            && d.as_bytes().len() != plan.params[i].bytes
        {
            return Err(ShardingError::GatherSize {
                rank: plan.rank,
                got: d.as_bytes().len(),
                expected: plan.params[i].bytes,
            }
            .into());
        }
    }

    let sizes: Vec<usize> = plan.params.iter().map(|p| p.bytes).collect();
    let streams = OwnerStreams::new(&sizes, stepped, &plan.owners, plan.world_size);
    let buckets = streams.buckets(cap_bytes);
    // The others' parameters, filled piece by piece (in order) as the buckets come in.
    let mut incoming: Vec<Option<Vec<u8>>> = (0..plan.params.len())
        .map(|i| (stepped[i] && !plan.owns(i)).then(|| Vec::with_capacity(sizes[i])))
        .collect();
    let mut buf = Vec::new();
    for k in 0..buckets {
        let counts = streams.counts(buckets, k);
        let starts: Vec<usize> = counts
            .iter()
            .scan(0, |acc, &c| {
                let at = *acc;
                *acc += c;
                Some(at)
            })
            .collect();
        // Reused from bucket to bucket: the others' parts are overwritten by the all-gather,
        // so only the first bucket's buffer is zeroed.
        let total: usize = counts.iter().sum();
        if buf.len() < total {
            buf.resize(total, 0u8);
        } else {
            buf.truncate(total);
        }
        let own = streams.part(plan.rank, buckets, k);
        for (i, range, off) in streams.overlaps(plan.rank, &own) {
            let bytes = mine[i].as_ref().map_or(&[][..], |d| d.as_bytes());
            let at = starts[plan.rank] + off;
            buf[at..at + range.len()].copy_from_slice(&bytes[range]);
        }
        comm::lock(group).all_gather_into::<u8>(&mut buf, &counts)?;
        stats.buckets += 1;
        stats.sent += counts[plan.rank];
        for p in (0..plan.world_size).filter(|&p| p != plan.rank) {
            let part = streams.part(p, buckets, k);
            for (i, range, off) in streams.overlaps(p, &part) {
                if let Some(v) = incoming[i].as_mut() {
                    let at = starts[p] + off;
                    v.extend_from_slice(&buf[at..at + range.len()]);
                }
            }
            stats.received += counts[p];
        }
    }
    let mut replace = ReplaceOthers { incoming, index: 0 };
    Ok((module.map(&mut replace), stats))
}

/// Reads the values of the parameters this rank owns and stepped.
struct ReadOwned<'a> {
    plan: &'a ShardPlan,
    stepped: &'a [bool],
    index: usize,
    bytes: Vec<Option<TensorData>>,
}

impl ModuleVisitor for ReadOwned<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.is_require_grad() {
            return;
        }
        let i = self.index;
        self.index += 1;
        if i < self.stepped.len() && self.stepped[i] && self.plan.owns(i) {
            self.bytes[i] = Some(param.val().into_data());
        }
    }
}

/// Replaces the parameters other ranks own by the values they sent.
struct ReplaceOthers {
    incoming: Vec<Option<Vec<u8>>>,
    index: usize,
}

impl ModuleMapper for ReplaceOthers {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !param.is_require_grad() {
            return param;
        }
        let i = self.index;
        self.index += 1;
        let Some(bytes) = self.incoming.get_mut(i).and_then(Option::take) else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let data = TensorData::from_bytes_vec(bytes, tensor.shape(), tensor.dtype());
        let value = Tensor::<D>::from_data(data, &tensor.device()).require_grad();
        Param::from_mapped_value(id, value, mapper)
    }
}
