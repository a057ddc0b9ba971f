//! Distributed data-parallel training for Burn 0.22.

pub mod comm;
pub mod sync_batch_norm;
