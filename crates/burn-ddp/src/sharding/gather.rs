//! After the owners stepped their parameters: every rank's copy of each updated parameter,
//! from its owner.
//!
//! - A large f32 parameter (at least [`IN_PLACE_MIN_BYTES`]) is broadcast by its owner
//!   straight from and into the parameter's own buffer on every rank: the tensor hands its
//!   buffer over (no copy on Flex), the collective writes the owner's values into it, and the
//!   buffer becomes the new tensor (no copy either). No host copy besides the collective's
//!   own, and no fresh allocation (a new 100 MiB buffer costs its page faults at every step).
//! - The rest (small parameters, other dtypes) are all-gathered in buckets as raw bytes, laid
//!   out owner by owner, so that every call carries a part of every owner's parameters.
//!
//! Both move raw bytes, so every rank ends with bitwise the owner's values. Which path a
//! parameter takes depends only on its size and dtype, the same on every rank.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{DType, Tensor, TensorData};

use super::error::ShardingError;
use super::owner_streams::OwnerStreams;
use super::plan::ShardPlan;
use crate::comm::{self, SharedGroup};
use crate::error::{DdpError, Result};
use crate::grad_sync::IN_PLACE_MIN_ELEMS;

/// Parameters of at least this many bytes (f32) are broadcast in place; smaller ones travel in
/// the buckets, where one call carries many of them. The gradient path's threshold.
const IN_PLACE_MIN_BYTES: usize = IN_PLACE_MIN_ELEMS * 4;

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
    // The large f32 parameters, in place.
    let mut in_place = BroadcastInPlace {
        plan,
        stepped,
        group,
        index: 0,
        done: vec![false; plan.params.len()],
        stats: GatherStats::default(),
        error: None,
    };
    let module = module.map(&mut in_place);
    if let Some(e) = in_place.error {
        return Err(e);
    }
    stats = in_place.stats;
    let stepped: Vec<bool> = stepped
        .iter()
        .zip(&in_place.done)
        .map(|(&s, &done)| s && !done)
        .collect();
    let stepped = &stepped[..];
    if !stepped.iter().any(|&s| s) {
        return Ok((module, stats));
    }
    // This rank's other updated parameters, as bytes.
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

/// Broadcasts each large f32 parameter from its owner, in the parameter's own buffer (see the
/// [module docs](self)). After an error it makes no further call and leaves the parameters
/// as they are (the step fails, and the group is broken).
struct BroadcastInPlace<'a> {
    plan: &'a ShardPlan,
    stepped: &'a [bool],
    group: &'a SharedGroup,
    index: usize,
    /// The parameters broadcast here.
    done: Vec<bool>,
    stats: GatherStats,
    error: Option<DdpError>,
}

impl BroadcastInPlace<'_> {
    /// `tensor` with its owner's values (itself on the owner); on failure, with what the
    /// buffer holds and the error recorded.
    fn broadcast<const D: usize>(&mut self, i: usize, tensor: Tensor<D>) -> Tensor<D> {
        let owner = self.plan.owners[i];
        let device = tensor.device();
        let mut data = tensor.into_data();
        let result = match data.as_mut_slice::<f32>() {
            Ok(values) => comm::lock(self.group)
                .broadcast(values, owner)
                .map_err(DdpError::from),
            Err(e) => Err(DdpError::TensorData {
                what: format!("parameter {i} (sharded optimizer's broadcast)"),
                msg: format!("{e:?}"),
            }),
        };
        if let Err(e) = result {
            self.error = Some(e);
        }
        Tensor::<D>::from_data(data, &device).require_grad()
    }
}

impl ModuleMapper for BroadcastInPlace<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !param.is_require_grad() {
            return param;
        }
        let i = self.index;
        self.index += 1;
        let large = i < self.stepped.len()
            && self.stepped[i]
            && self.plan.params[i].bytes >= IN_PLACE_MIN_BYTES;
        if self.error.is_some() || !large {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        if tensor.dtype() != DType::F32 {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let bytes = self.plan.params[i].bytes;
        let value = self.broadcast(i, tensor);
        if self.error.is_some() {
            return Param::from_mapped_value(id, value, mapper);
        }
        self.done[i] = true;
        self.stats.buckets += 1;
        if self.plan.owns(i) {
            self.stats.sent += bytes;
        } else {
            self.stats.received += bytes;
        }
        Param::from_mapped_value(id, value, mapper)
    }
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
