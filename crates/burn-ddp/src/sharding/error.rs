//! Errors of the sharded optimizer.

/// What can go wrong in [`crate::DdpOptimizer::sharded`]'s bookkeeping (the collectives'
/// own errors are [`crate::DdpError::Comm`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShardingError {
    /// An optimizer state (a shard, or a checkpoint's whole state) could not be read,
    /// merged or written.
    #[error("the sharded optimizer state: {0}")]
    State(String),
    /// A loaded optimizer state holds entries for parameters the model does not have.
    #[error(
        "the optimizer state to resume holds entries for {unmatched} parameter(s) that this \
         model does not have (of {total} in the state): it was written for another model"
    )]
    StateDoesNotFit {
        /// Parameters of the state that are not in the model.
        unmatched: usize,
        /// Parameters in the state.
        total: usize,
    },
    /// A parameter this rank owns does not have the size the plan expects (its dtype
    /// changed since the plan was made).
    #[error(
        "parameter all-gather: rank {rank} has {got} bytes of a parameter, the plan expects {expected}"
    )]
    GatherSize {
        /// The rank (this one) whose parameter is off.
        rank: usize,
        /// Bytes received.
        got: usize,
        /// Bytes expected.
        expected: usize,
    },
}
