//! What the ranks compare before their first gradient synchronisation: a fingerprint of the
//! values of their trainable parameters, equal on every rank that started from rank 0's
//! (`Ddp::replicate_model`), so that a forgotten replication fails at once instead of training
//! a model of its own on each rank (see `GradientSynchronizer::check_replicas_once`).

use std::hash::Hasher;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use fnv::FnvHasher;

/// A fingerprint of the values of `module`'s trainable parameters (their bytes, in visit
/// order).
pub(super) fn parameters_fingerprint<M: Module>(module: &M) -> i64 {
    struct Hashing(FnvHasher);
    impl ModuleVisitor for Hashing {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            if value.is_require_grad() {
                self.0.write(value.into_data().as_bytes());
            }
        }
    }
    let mut h = Hashing(FnvHasher::default());
    module.visit(&mut h);
    h.0.finish() as i64
}
