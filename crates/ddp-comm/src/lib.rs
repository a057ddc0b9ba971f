//! Process groups for multi-process data-parallel training, with no Burn dependency.
//!
//! - [`group`]: the process group and its collectives (all-reduce, broadcast, all-gather,
//!   barrier) over TCP between hosts and shared memory between ranks of one host.
//! - [`collectives`]: [`Collectives`], the one interface of every process group (c10d's
//!   shape): this crate's host group implements it, and so does `ddp-nccl`'s NCCL group.
//! - [`log`]: whether log lines may be coloured (a terminal at the end, no `NO_COLOR`).
//!
//! Re-exported so that one dependency reaches the whole transport:
//! - from `ddp-store`: [`env`](mod@env) (the launch contract: torchrun's variables, Slurm's as
//!   a fallback), [`store`] (the rendezvous key-value store rank 0 serves at
//!   `MASTER_ADDR:MASTER_PORT`), [`auth`] and [`job_auth`] (the job's token and the ranks'
//!   identities), [`wire`] (the byte encoding of the store's and the rendezvous' messages) and
//!   [`error`];
//! - `ddp-trace` as [`trace`]: per-rank timelines of the collectives and of spans the program
//!   marks (`DDP_TRACE=DIR`), merged by the launcher into one Chrome trace-event file;
//! - `ddp-doctor` as [`doctor`]: the flight recorder every collective of a group is noted in
//!   (label the next one with [`doctor::label_next`]), the step and phase marks, and the
//!   progress a rank publishes to its launcher for its hang and straggler verdicts.
//!
//! ```no_run
//! use ddp_comm::{ProcessGroup, ReduceOp};
//! # fn main() -> Result<(), ddp_comm::CommError> {
//! let mut pg = ProcessGroup::from_env()?; // world size 1 when no launch variables are set
//! let mut grads = vec![1.0f32; 1024];
//! pg.all_reduce(&mut grads, ReduceOp::Mean)?;
//! pg.barrier()?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub mod collectives;
pub mod group;
pub mod log;

pub use ddp_doctor as doctor;
pub use ddp_store::{
    auth, env, error, failure_note, gpu_hosts, job_auth, port_range, refusals, store, wire,
};
pub use ddp_trace as trace;

pub use collectives::Collectives;
pub use env::{EnvError, LaunchEnv};
pub use error::{CommError, Result};
pub use group::{Compression, Element, GroupOptions, ProcessGroup, ReduceOp};
pub use store::{PrefixStore, Store, StoreClient, StoreServer};
