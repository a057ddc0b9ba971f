//! The launch contract and the rendezvous of burn-ddp's process groups, with no Burn
//! dependency:
//!
//! - [`env`](mod@env): the launch contract (torchrun's variables, Slurm's as a fallback).
//! - [`store`]: the rendezvous key-value store rank 0 serves at `MASTER_ADDR:MASTER_PORT`,
//!   authenticated by the job's token ([`job_auth`], [`auth`]).
//! - [`wire`]: the byte encoding of the store's and the rendezvous' messages (shared with the
//!   process groups' handshake in `ddp-comm` and the NCCL transport of `ddp-nccl`, which
//!   publishes its id through the store).
//! - [`error`]: [`CommError`], the one error type of the store and of every collective
//!   (`ddp-comm` returns it too).
//! - [`failure_note`]: how a rank tells `ddprun` that its failure only relayed a peer's.
//! - [`port_range`]: keeping the ports a job listens on in a range (`DDP_PORT_RANGE`).
//!
//! A few items are public only for ddp-comm's process groups, which share the store's
//! handshake and refusal log, and are hidden from these docs (`refusals`, the frame I/O of
//! [`wire`], the rank identities of [`auth`]).
//!
//! Most programs reach these through `ddp-comm`, which re-exports every module.
//!
//! ```no_run
//! use std::time::Duration;
//! use ddp_store::StoreClient;
//! # fn main() -> Result<(), ddp_store::CommError> {
//! let mut store = StoreClient::connect("127.0.0.1:29500", Some("the job's token"), Duration::from_secs(30))?;
//! store.set("greeting", b"hello")?;
//! assert_eq!(store.get("greeting", Duration::from_secs(5))?, b"hello");
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub mod auth;
pub mod env;
pub mod error;
pub mod failure_note;
pub mod gpu_hosts;
pub mod job_auth;
pub mod port_range;
#[doc(hidden)]
pub mod refusals;
pub mod store;
pub mod wire;

pub use env::{EnvError, LaunchEnv};
pub use error::{CommError, Result};
pub use store::{Credential, PrefixStore, Store, StoreClient, StoreServer};
