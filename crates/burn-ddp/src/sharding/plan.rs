//! Which rank owns which parameter: the assignment rule and the table a rank keeps.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;

use std::hash::Hasher;

use fnv::FnvHasher;

/// The owner rank of each parameter, for parameters of `sizes` bytes (in module visit order)
/// shared among `world_size` ranks.
///
/// The rule, greedy longest-processing-time: parameters are taken largest first (equal sizes
/// in visit order) and each goes to the rank that owns the fewest bytes so far (the lowest
/// rank among equals). It depends only on the sizes, so every rank computes the same table,
/// and a model's table is the same in every run. No rank owns more than the average plus the
/// largest parameter.
///
/// ```
/// // Two big tensors and four small ones over two ranks.
/// let owners = burn_ddp::sharding::assign_owners(&[400, 16, 400, 16, 8, 8], 2);
/// assert_eq!(owners, [0, 0, 1, 1, 0, 1]);
/// ```
pub fn assign_owners(sizes: &[usize], world_size: usize) -> Vec<usize> {
    let world_size = world_size.max(1);
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    // Stable: equal sizes stay in visit order.
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]));
    let mut load = vec![0usize; world_size];
    let mut owners = vec![0usize; sizes.len()];
    for i in order {
        let rank = (0..world_size)
            .min_by_key(|&r| (load[r], r))
            .unwrap_or_default();
        owners[i] = rank;
        load[rank] += sizes[i];
    }
    owners
}

/// One trainable float parameter of the model, in visit order.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ParamInfo {
    pub(crate) id: ParamId,
    pub(crate) shape: Vec<usize>,
    /// Bytes of its values (elements × dtype size).
    pub(crate) bytes: usize,
}

/// The trainable float parameters of `module` in visit order (those the gradient sync has
/// slots for).
pub(crate) fn trainable_params<M: Module>(module: &M) -> Vec<ParamInfo> {
    struct Collect(Vec<ParamInfo>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.is_require_grad() {
                return;
            }
            let v = param.val();
            let shape = v.shape();
            self.0.push(ParamInfo {
                id: param.id,
                shape: shape.iter().copied().collect(),
                bytes: shape.num_elements() * v.dtype().size(),
            });
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

/// Fingerprint of a parameter layout: the shapes and byte sizes, not the ids (which differ
/// from rank to rank).
pub(crate) fn layout_fingerprint(params: &[ParamInfo]) -> u64 {
    let mut h = FnvHasher::default();
    h.write(&(params.len() as u64).to_le_bytes());
    for p in params {
        h.write(&(p.bytes as u64).to_le_bytes());
        h.write(&(p.shape.len() as u64).to_le_bytes());
        for &d in &p.shape {
            h.write(&(d as u64).to_le_bytes());
        }
    }
    h.finish()
}

/// A rank's view of the sharding of one model layout.
#[derive(Debug, Clone)]
pub(crate) struct ShardPlan {
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    /// This rank's parameters, visit order.
    pub(crate) params: Vec<ParamInfo>,
    /// Rank 0's id of each parameter: the ids a gathered state is written with.
    pub(crate) root_ids: Vec<u64>,
    /// Owner rank of each parameter.
    pub(crate) owners: Vec<usize>,
    /// [`layout_fingerprint`] of `params`.
    pub(crate) fingerprint: u64,
}

impl ShardPlan {
    /// Whether this rank owns parameter `i`.
    pub(crate) fn owns(&self, i: usize) -> bool {
        self.owners[i] == self.rank
    }

    /// Bytes of the parameters each rank owns.
    pub(crate) fn owned_bytes(&self) -> Vec<usize> {
        let mut load = vec![0; self.world_size];
        for (p, &o) in self.params.iter().zip(&self.owners) {
            load[o] += p.bytes;
        }
        load
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn one_rank_owns_everything_and_ties_go_in_visit_order() {
        assert_eq!(assign_owners(&[3, 1, 2], 1), [0, 0, 0]);
        assert_eq!(assign_owners(&[4, 4, 4, 4], 2), [0, 1, 0, 1]);
        assert_eq!(assign_owners(&[], 3), Vec::<usize>::new());
        // More ranks than parameters: the last ranks own nothing.
        assert_eq!(assign_owners(&[5, 7], 4), [1, 0]);
    }

    proptest! {
        /// Every parameter has one owner below the world size, and no rank owns more than the
        /// average plus the largest parameter (the greedy rule's bound).
        #[test]
        fn owners_are_balanced(sizes in prop::collection::vec(1usize..10_000, 0..60), world in 1usize..9) {
            let owners = assign_owners(&sizes, world);
            prop_assert_eq!(owners.len(), sizes.len());
            let mut load = vec![0usize; world];
            for (s, &o) in sizes.iter().zip(&owners) {
                prop_assert!(o < world);
                load[o] += s;
            }
            let total: usize = sizes.iter().sum();
            let largest = sizes.iter().copied().max().unwrap_or(0);
            for l in load {
                prop_assert!(l <= total / world + largest, "{l} > {total}/{world} + {largest}");
            }
            prop_assert_eq!(assign_owners(&sizes, world), owners);
        }
    }
}
