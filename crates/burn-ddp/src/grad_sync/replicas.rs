//! What the ranks compare before their first gradient synchronisation: a fingerprint of the
//! values of their trainable parameters, equal on every rank that started from rank 0's
//! (`Ddp::replicate_model`), so that a forgotten replication fails at once instead of training
//! a model of its own on each rank (see `GradientSynchronizer::check_replicas_once`).

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use xxhash_rust::xxh3::Xxh3;

/// A fingerprint of the values of `module`'s trainable parameters (their bytes, in visit
/// order), with XXH3 (`xxhash-rust`): the check reads every byte of the model once, so the
/// hash must keep up with memory (`cargo xtask bench ddp`'s last column measures it).
pub(super) fn parameters_fingerprint<M: Module>(module: &M) -> i64 {
    struct Hashing(Xxh3);
    impl ModuleVisitor for Hashing {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            if value.is_require_grad() {
                self.0.update(value.into_data().as_bytes());
            }
        }
    }
    let mut h = Hashing(Xxh3::new());
    module.visit(&mut h);
    h.0.digest() as i64
}
