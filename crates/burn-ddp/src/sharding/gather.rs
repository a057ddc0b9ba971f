//! After the owners stepped their parameters: every rank's copy of each updated parameter,
//! all-gathered from its owner in buckets.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Tensor, TensorData};

use super::error::ShardingError;
use super::plan::ShardPlan;
use crate::comm::{self, SharedGroup};
use crate::error::Result;

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
/// order; the same on every rank) computed. Buckets of at most `cap_bytes` (a larger parameter
/// travels alone) keep the host copies bounded; the parameters go as they are, in their own
/// dtype, so the copies are bitwise the owner's.
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
    let mut mine = mine.bytes;

    let mut incoming: Vec<Option<Vec<u8>>> = vec![None; plan.params.len()];
    let chosen: Vec<usize> = (0..plan.params.len()).filter(|&i| stepped[i]).collect();
    let world = plan.world_size;
    for bucket in buckets(&chosen, plan, cap_bytes) {
        // Every owner's parameters of the bucket side by side, owners in rank order.
        let mut counts = vec![0usize; world];
        for &i in bucket {
            counts[plan.owners[i]] += plan.params[i].bytes;
        }
        let starts: Vec<usize> = counts
            .iter()
            .scan(0, |acc, &c| {
                let at = *acc;
                *acc += c;
                Some(at)
            })
            .collect();
        let mut buf = vec![0u8; counts.iter().sum()];
        let mut at = starts[plan.rank];
        for &i in bucket.iter().filter(|&&i| plan.owns(i)) {
            let data = mine[i].take();
            let bytes = data.as_ref().map_or(&[][..], |d| d.as_bytes());
            if bytes.len() != plan.params[i].bytes {
                return Err(ShardingError::GatherSize {
                    rank: plan.rank,
                    got: bytes.len(),
                    expected: plan.params[i].bytes,
                }
                .into());
            }
            buf[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        }
        comm::lock(group).all_gather_into::<u8>(&mut buf, &counts)?;
        stats.buckets += 1;
        stats.sent += counts[plan.rank];
        let mut cursor = starts;
        for &i in bucket {
            let owner = plan.owners[i];
            let n = plan.params[i].bytes;
            if owner != plan.rank {
                let at = cursor[owner];
                incoming[i] = Some(buf[at..at + n].to_vec());
                stats.received += n;
            }
            cursor[owner] += n;
        }
    }
    let mut replace = ReplaceOthers { incoming, index: 0 };
    Ok((module.map(&mut replace), stats))
}

/// Consecutive runs of `chosen` of at most `cap_bytes` (at least one parameter each).
fn buckets<'a>(
    chosen: &'a [usize],
    plan: &ShardPlan,
    cap_bytes: usize,
) -> impl Iterator<Item = &'a [usize]> {
    let mut start = 0;
    let sizes: Vec<usize> = chosen.iter().map(|&i| plan.params[i].bytes).collect();
    std::iter::from_fn(move || {
        if start >= chosen.len() {
            return None;
        }
        let mut end = start;
        let mut total = 0;
        while end < chosen.len() && (end == start || total + sizes[end] <= cap_bytes) {
            total += sizes[end];
            end += 1;
        }
        let run = &chosen[start..end];
        start = end;
        Some(run)
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sharding::plan::ParamInfo;

    fn plan(sizes: &[usize]) -> ShardPlan {
        ShardPlan {
            rank: 0,
            world_size: 2,
            params: sizes
                .iter()
                .map(|&b| ParamInfo {
                    id: burn::module::ParamId::new(),
                    shape: vec![b / 4],
                    bytes: b,
                })
                .collect(),
            root_ids: vec![],
            owners: vec![0; sizes.len()],
            fingerprint: 0,
        }
    }

    #[test]
    fn buckets_hold_at_most_the_cap_and_a_large_parameter_alone() {
        let p = plan(&[40, 40, 40, 200, 8]);
        let chosen = [0, 1, 2, 3, 4];
        let runs: Vec<&[usize]> = buckets(&chosen, &p, 100).collect();
        assert_eq!(runs, [&[0, 1][..], &[2][..], &[3][..], &[4][..]]);
        let runs: Vec<&[usize]> = buckets(&[1, 4], &p, 100).collect();
        assert_eq!(runs, [&[1, 4][..]]);
        assert_eq!(buckets(&[], &p, 100).count(), 0);
    }
}
