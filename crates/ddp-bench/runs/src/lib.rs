//! The orchestration of the benchmarks behind `cargo xtask bench …`: each builds its rank
//! program of `ddp-bench` in release, launches it (alone, or through `ddprun` on N ranks,
//! transports and emulated nodes) and prints its tables. No Burn dependency: the rank programs
//! hold the Burn code.
//!
//! - [`allreduce`]: `bench allreduce`;
//! - [`ddp`]: `bench ddp`;
//! - [`zero`]: `bench zero`, the sharded optimizer against the unsharded one;
//! - [`program`]: the one-process benchmarks (`bench syncbn`, `bench data`, `bench handshake`).

pub mod allreduce;
pub mod ddp;
pub mod program;
pub mod zero;
