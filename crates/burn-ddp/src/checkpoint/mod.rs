//! Training checkpoints for data-parallel jobs: rank 0 writes, every rank resumes.
//!
//! A [`Checkpointer`] saves the model, the optimizer state, where the run stands
//! ([`Progress`]: global step, epochs done, the sharded loader's position) and metadata of
//! the program's own (any `serde` type) into one file, **atomically** (temporary file, fsync,
//! rename) and with a CRC-32 over its contents. Only rank 0 writes; every rank learns whether
//! the write succeeded, so a full disk stops every rank with the same error. On start,
//! [`Checkpointer::load`] has rank 0 read the file and broadcast it; every rank decodes the
//! same bytes and continues at the exact step. A crash in the middle of a save leaves the
//! previous checkpoint in place (the next load removes the dead writer's temporary file).
//!
//! ```no_run
//! # use burn::module::Module;
//! # use burn::nn::{Linear, LinearConfig};
//! # use burn::optim::{GradientsParams, SgdConfig};
//! # use burn::tensor::Tensor;
//! use burn_ddp::checkpoint::{Checkpointer, Progress};
//! # fn main() -> Result<(), burn_ddp::DdpError> {
//! let ddp = burn_ddp::init()?;
//! let device = ddp.device().clone().autodiff();
//! let model: Linear = LinearConfig::new(8, 1).init(&device);
//! let mut optim = burn_ddp::DdpOptimizer::new(&ddp, SgdConfig::new().init());
//! let ckpt = Checkpointer::new("runs/my-job").every_steps(500);
//!
//! // On start (and after a restart): resume when rank 0 finds a checkpoint.
//! let model = ddp.replicate_model(model)?;
//! let (mut model, resumed) = ckpt.load::<_, String>(&ddp, model, &mut optim)?;
//! let mut step = resumed.map_or(0, |r| r.progress.step);
//! # let batches: Vec<(Tensor<2>, Tensor<2>)> = vec![];
//! for (x, y) in batches {
//!     let loss = (model.forward(x) - y).powi_scalar(2).mean();
//!     let grads = GradientsParams::from_grads(loss.backward(), &model);
//!     model = optim.step(1e-2, model, grads);
//!     step += 1;
//!     if ckpt.due_after_step(step) {
//!         let progress = Progress { step, ..Progress::default() };
//!         ckpt.save(&ddp, &model, &optim, progress, &"my notes".to_string())?;
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! Every rank must call [`Checkpointer::save`], [`Checkpointer::load`] and
//! [`Checkpointer::exists`] at the same points (they are collectives).
//!
//! Buffers that differ between ranks — per-rank BatchNorm's running statistics — are saved
//! for every rank, and a resume at the same world size gives each rank its own
//! ([`Checkpoint::own_buffers`]). `Ddp::replicate_model` copies rank 0's buffers to every rank:
//! call it before [`Checkpointer::load`], as above, not after.

use std::hash::Hasher;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

pub use burn_ddp_checkpoint::{
    Checkpoint, CheckpointError, Progress, Resumed, WRITE_PAUSE_VAR, commit_running_states,
    restore_buffers, write_atomic,
};

use crate::comm::{self, GroupHandle};
use crate::error::{DdpError, Result};
use crate::optimizer::DdpOptimizer;

/// The checkpoint's file name under the directory given to [`Checkpointer::new`].
pub const DEFAULT_FILE_NAME: &str = "checkpoint.bin";

/// An optimizer whose state a checkpoint can hold: Burn's [`ModuleOptimizer`] and the
/// [`DdpOptimizer`] wrapping one.
pub trait OptimizerState {
    /// The state (burnpack bytes).
    ///
    /// # Errors
    /// [`CheckpointError::Encode`] when it can't be serialised.
    fn state_bytes(&self) -> Result<Vec<u8>, CheckpointError>;

    /// Restores a state written by [`state_bytes`](Self::state_bytes).
    ///
    /// # Errors
    /// [`CheckpointError::DoesNotFit`] (with an empty path) when the bytes are not a state of
    /// this optimizer.
    fn load_state_bytes(&mut self, bytes: Vec<u8>) -> Result<(), CheckpointError>;

    /// The whole state on rank 0 (`None` on the other ranks), as [`Checkpointer::save`] writes
    /// it; every rank calls it. By default rank 0's [`state_bytes`](Self::state_bytes),
    /// without communication; a sharded [`DdpOptimizer`] gathers every rank's shard (a
    /// collective).
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] when the state can't be serialised; a sharded optimizer's
    /// [`DdpError::Comm`] and [`DdpError::Sharding`].
    fn gather_state_bytes(&self, rank: usize) -> Result<Option<Vec<u8>>> {
        if rank == 0 {
            Ok(Some(self.state_bytes()?))
        } else {
            Ok(None)
        }
    }
}

impl OptimizerState for ModuleOptimizer {
    fn state_bytes(&self) -> Result<Vec<u8>, CheckpointError> {
        let b = self
            .into_bytes()
            .map_err(|e| CheckpointError::Encode(format!("the optimizer state: {e}")))?;
        Ok(b.to_vec())
    }

    fn load_state_bytes(&mut self, bytes: Vec<u8>) -> Result<(), CheckpointError> {
        *self = self
            .clone()
            .from_bytes(Bytes::from_bytes_vec(bytes))
            .map_err(|e| CheckpointError::DoesNotFit {
                path: PathBuf::new(),
                reason: format!("the optimizer state: {e}"),
            })?;
        Ok(())
    }
}

/// Sharded ([`DdpOptimizer::sharded`]): [`OptimizerState::state_bytes`] is this rank's shard,
/// [`OptimizerState::gather_state_bytes`] the whole state (what checkpoints hold), and
/// [`OptimizerState::load_state_bytes`] takes a whole state and keeps, at the next step, the
/// part of the parameters this rank owns.
impl OptimizerState for DdpOptimizer {
    fn state_bytes(&self) -> Result<Vec<u8>, CheckpointError> {
        self.optimizer().state_bytes()
    }

    fn load_state_bytes(&mut self, bytes: Vec<u8>) -> Result<(), CheckpointError> {
        match self.sharding_mut() {
            Some(sharding) => {
                // Checked now that it is a state at all; cut down at the next step.
                crate::sharding::state::ids_in(&bytes).map_err(|e| {
                    CheckpointError::DoesNotFit {
                        path: PathBuf::new(),
                        reason: e.to_string(),
                    }
                })?;
                sharding.load_whole(bytes);
                Ok(())
            }
            None => self.optimizer_mut().load_state_bytes(bytes),
        }
    }

    fn gather_state_bytes(&self, rank: usize) -> Result<Option<Vec<u8>>> {
        match self.sharding() {
            Some(sharding) => sharding.gather_whole(self.optimizer()),
            None if rank == 0 => Ok(Some(self.state_bytes()?)),
            None => Ok(None),
        }
    }
}

/// Saves and resumes a job's checkpoint (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct Checkpointer {
    path: PathBuf,
    every_steps: Option<NonZeroU64>,
    every_epochs: Option<NonZeroU64>,
    io_timeout: Duration,
}

/// The variable that sets [`Checkpointer::io_timeout`] (seconds) for programs that don't.
pub const IO_TIMEOUT_VAR: &str = "DDP_CHECKPOINT_TIMEOUT_SECS";

/// How long the other ranks wait for rank 0 to write or read a checkpoint, by default.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// [`IO_TIMEOUT_VAR`]'s value, else [`DEFAULT_IO_TIMEOUT`] (a malformed value is reported
/// once and ignored).
fn io_timeout_from_env() -> Duration {
    match std::env::var(IO_TIMEOUT_VAR) {
        Ok(v) if !v.trim().is_empty() => match v.trim().parse::<f64>() {
            Ok(secs) if secs.is_finite() && secs > 0.0 => Duration::from_secs_f64(secs),
            _ => {
                tracing::warn!(
                    "{IO_TIMEOUT_VAR}={v:?} is not a positive number of seconds; using {} s",
                    DEFAULT_IO_TIMEOUT.as_secs()
                );
                DEFAULT_IO_TIMEOUT
            }
        },
        _ => DEFAULT_IO_TIMEOUT,
    }
}

/// The group's collective deadline replaced by a checkpoint's for as long as this lives (every
/// rank does the same at the same call, so the ranks agree).
struct CheckpointDeadline<'a> {
    group: &'a comm::SharedGroup,
    previous: Duration,
}

impl<'a> CheckpointDeadline<'a> {
    fn set(group: &'a comm::SharedGroup, timeout: Duration) -> Self {
        let mut g = comm::lock(group);
        let previous = g.timeout();
        g.set_timeout(timeout.max(previous));
        CheckpointDeadline { group, previous }
    }
}

impl Drop for CheckpointDeadline<'_> {
    fn drop(&mut self) {
        comm::lock(self.group).set_timeout(self.previous);
    }
}

/// A rank-0 outcome as broadcast to every rank: a tag byte, then the payload.
const NONE: u8 = 0;
const FOUND: u8 = 1;
const FAILED: u8 = 2;

impl Checkpointer {
    /// Checkpoints in `dir/checkpoint.bin`, saved after every epoch until told otherwise.
    pub fn new(dir: impl AsRef<Path>) -> Self {
        Self::at(dir.as_ref().join(DEFAULT_FILE_NAME))
    }

    /// Checkpoints in the file `path`, saved after every epoch until told otherwise.
    pub fn at(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            every_steps: None,
            every_epochs: NonZeroU64::new(1),
            io_timeout: io_timeout_from_env(),
        }
    }

    /// How long the other ranks wait for rank 0 to write or read the checkpoint (default
    /// [`DEFAULT_IO_TIMEOUT`], 30 min, or [`IO_TIMEOUT_VAR`]). While they wait this replaces
    /// the group's collective deadline (`DDP_TIMEOUT_SECS`), which a large model's save on a
    /// slow network file system can outlast; it is never shorter than that deadline.
    #[must_use]
    pub fn io_timeout(mut self, timeout: Duration) -> Self {
        self.io_timeout = timeout;
        self
    }

    /// A wait for rank 0's `what` that ran out of time, said as such.
    fn waited(&self, e: DdpError, what: &'static str) -> DdpError {
        match e {
            DdpError::Comm(ddp_comm::CommError::Timeout { after, .. }) => {
                CheckpointError::Timeout {
                    path: self.path.clone(),
                    what,
                    after,
                }
                .into()
            }
            e => e,
        }
    }

    /// Save every `steps` optimizer steps (0: never by step count).
    #[must_use]
    pub fn every_steps(mut self, steps: u64) -> Self {
        self.every_steps = NonZeroU64::new(steps);
        self
    }

    /// Save every `epochs` epochs (0: never by epoch count; the default is 1).
    #[must_use]
    pub fn every_epochs(mut self, epochs: u64) -> Self {
        self.every_epochs = NonZeroU64::new(epochs);
        self
    }

    /// The checkpoint file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether a save is due after global step `step` (counting from 1).
    pub fn due_after_step(&self, step: u64) -> bool {
        self.every_steps.is_some_and(|n| step > 0 && step % n == 0)
    }

    /// Whether a save is due after `epochs_done` epochs.
    pub fn due_after_epoch(&self, epochs_done: u64) -> bool {
        self.every_epochs
            .is_some_and(|n| epochs_done > 0 && epochs_done % n == 0)
    }

    /// Whether rank 0 finds a checkpoint file (every rank gets rank 0's answer). Collective.
    ///
    /// # Errors
    /// [`DdpError::Comm`] when the broadcast fails.
    pub fn exists(&self, group: &impl GroupHandle) -> Result<bool> {
        let g = group.process_group();
        let is_main = comm::lock(g).rank() == 0;
        let local = if is_main {
            presence(&self.path)
        } else {
            Ok(false)
        };
        let mut answer = match &local {
            Ok(found) => vec![if *found { FOUND } else { NONE }],
            Err(e) => [&[FAILED][..], e.to_string().as_bytes()].concat(),
        };
        comm::lock(g).broadcast_bytes(&mut answer, 0)?;
        local?;
        match answer.split_first() {
            Some((&FOUND, _)) => Ok(true),
            Some((&NONE, _)) => Ok(false),
            Some((_, msg)) => Err(rank_zero_failed(String::from_utf8_lossy(msg).into())),
            None => Err(rank_zero_failed("sent nothing".into())),
        }
    }

    /// Rank 0 writes a checkpoint of `model`, `optim`, `progress` and `metadata`; the other
    /// ranks only wait for its outcome, so they all return the same result. Collective.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] on every rank when rank 0 could not write it
    /// ([`CheckpointError::OnRankZero`] on the others); [`DdpError::Comm`].
    pub fn save<M: Module, T: Serialize>(
        &self,
        group: &impl GroupHandle,
        model: &M,
        optim: &impl OptimizerState,
        progress: Progress,
        metadata: &T,
    ) -> Result<()> {
        let _span = ddp_comm::trace::span("checkpoint_save", "ddp").arg("step", progress.step);
        let _phase = ddp_comm::doctor::enter(ddp_comm::doctor::Phase::Checkpoint);
        let g = group.process_group();
        let (rank, world_size) = {
            let pg = comm::lock(g);
            (pg.rank(), pg.world_size())
        };
        // Every rank: a sharded optimizer gathers its state to rank 0 here.
        let state = optim.gather_state_bytes(rank);
        // Every rank: its buffers to all (per-rank BatchNorm's running statistics differ).
        // Every rank: its buffers' fingerprint to all, and the buffers themselves only when
        // they differ (per-rank BatchNorm): equal buffers — SyncBatchNorm, frozen parameters —
        // cost one number per rank.
        let rank_buffers = if world_size > 1 {
            let mine = burn_ddp_checkpoint::pack_buffers(model);
            let mut h = fnv::FnvHasher::default();
            h.write(&mine);
            let mut all_h = vec![0i64; world_size];
            let mut pg = comm::lock(g);
            pg.all_gather(&[h.finish() as i64], &mut all_h)?;
            if all_h.iter().all(|x| *x == all_h[0]) {
                Vec::new()
            } else {
                pg.all_gather_varlen(&mine)?
            }
        } else {
            Vec::new()
        };
        let outcome: Result<()> = match state {
            Ok(state) if rank == 0 => state
                .ok_or_else(|| {
                    CheckpointError::Encode("the optimizer gave rank 0 no state to write".into())
                })
                .and_then(|state| {
                    Checkpoint::capture_with_state(model, state, progress, world_size, metadata)
                })
                .and_then(|mut ck| {
                    ck.rank_buffers = rank_buffers;
                    ck.write(&self.path)
                })
                .map_err(DdpError::from),
            Ok(_) => Ok(()),
            // A failed collective broke the group: nothing more to wait for.
            Err(e) if rank != 0 => return Err(e),
            Err(e) => Err(e),
        };
        let mut status = match &outcome {
            Ok(()) => Vec::new(),
            Err(e) => e.to_string().into_bytes(),
        };
        {
            let _deadline = CheckpointDeadline::set(g, self.io_timeout);
            comm::lock(g)
                .broadcast_bytes(&mut status, 0)
                .map_err(|e| self.waited(e.into(), "save"))?;
        }
        outcome?;
        if !status.is_empty() {
            return Err(rank_zero_failed(String::from_utf8_lossy(&status).into()));
        }
        if rank == 0 {
            tracing::info!(
                step = progress.step,
                epochs_done = progress.epochs_done,
                "checkpoint written to {}",
                self.path.display()
            );
        }
        Ok(())
    }

    /// Resumes from the checkpoint when rank 0 finds one: rank 0 reads the file and
    /// broadcasts its bytes, every rank decodes them, loads the model record into `model` and
    /// the optimizer state into `optim`, and returns the model with what else it resumed.
    /// `(model, None)`, `model` and `optim` untouched, when there is no checkpoint. Collective. ([`Self::read`] and [`Self::restore`] are its two halves, to
    /// look at the metadata before restoring.)
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] on every rank when the file can't be read, is damaged or does
    /// not fit `model`/`optim`; [`DdpError::Comm`].
    pub fn load<M: Module, T: DeserializeOwned>(
        &self,
        group: &impl GroupHandle,
        model: M,
        optim: &mut impl OptimizerState,
    ) -> Result<(M, Option<Resumed<T>>)> {
        match self.read(group)? {
            Some(ck) => {
                let (model, resumed) = self.restore(ck, model, optim)?;
                Ok((model, Some(resumed)))
            }
            None => Ok((model, None)),
        }
    }

    /// The first half of [`Self::load`]: rank 0 reads the checkpoint and broadcasts it, every
    /// rank decodes the same bytes. `Ok(None)` when rank 0 finds no checkpoint. Collective.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] on every rank when the file can't be read or is damaged;
    /// [`DdpError::Comm`].
    pub fn read<T: DeserializeOwned>(
        &self,
        group: &impl GroupHandle,
    ) -> Result<Option<Checkpoint<T>>> {
        let g = group.process_group();
        let (rank, world) = {
            let pg = comm::lock(g);
            (pg.rank(), pg.world_size())
        };
        let is_main = rank == 0;
        let mut local_err = None;
        let mut bytes = if !is_main {
            Vec::new()
        } else {
            // Also when no checkpoint exists yet: a first save killed half-way left one.
            burn_ddp_checkpoint::remove_stale_temporaries(&self.path);
            let found = presence(&self.path).and_then(|found| {
                found
                    .then(|| burn_ddp_checkpoint::read_file(&self.path))
                    .transpose()
            });
            match found {
                Ok(None) => vec![NONE],
                Ok(Some(b)) => [&[FOUND][..], &b].concat(),
                Err(e) => {
                    let msg = [&[FAILED][..], e.to_string().as_bytes()].concat();
                    local_err = Some(e);
                    msg
                }
            }
        };
        {
            let _deadline = CheckpointDeadline::set(g, self.io_timeout);
            comm::lock(g)
                .broadcast_bytes(&mut bytes, 0)
                .map_err(|e| self.waited(e.into(), "read"))?;
        }
        if let Some(e) = local_err {
            return Err(e.into());
        }
        let Some((&tag, body)) = bytes.split_first() else {
            return Err(rank_zero_failed("sent nothing".into()));
        };
        match tag {
            NONE => Ok(None),
            FOUND => {
                let ck = Checkpoint::<T>::from_bytes(body, &self.path)?;
                Ok(Some(ck.read_by(rank, world)))
            }
            _ => Err(rank_zero_failed(String::from_utf8_lossy(body).into())),
        }
    }

    /// The second half of [`Self::load`]: `model` with the checkpoint's record and `optim`
    /// with its state. Every rank restores the same bytes, so no communication.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] ([`CheckpointError::DoesNotFit`]) when the records are not
    /// those of `model` / `optim`.
    pub fn restore<M: Module, T>(
        &self,
        ck: Checkpoint<T>,
        model: M,
        optim: &mut impl OptimizerState,
    ) -> Result<(M, Resumed<T>)> {
        let mut model = ck.restore_model(model, &self.path)?;
        match ck.own_buffers() {
            Some(own) => {
                model = restore_buffers(model, own).map_err(|e| self.located(e))?;
            }
            None if !ck.rank_buffers.is_empty() => tracing::warn!(
                "{} holds every rank's buffers (per-rank BatchNorm statistics) of a {}-rank run; with another world size every rank resumes with rank 0's",
                self.path.display(),
                ck.world_size
            ),
            None => {}
        }
        optim
            .load_state_bytes(ck.optimizer)
            .map_err(|e| self.located(e))?;
        tracing::info!(
            step = ck.progress.step,
            epochs_done = ck.progress.epochs_done,
            "resumed from {}",
            self.path.display()
        );
        let resumed = Resumed {
            progress: ck.progress,
            world_size: ck.world_size,
            metadata: ck.metadata,
        };
        Ok((model, resumed))
    }

    /// Names this checkpoint's file in an error raised without a path.
    fn located(&self, e: CheckpointError) -> DdpError {
        match e {
            CheckpointError::DoesNotFit { path, reason } if path.as_os_str().is_empty() => {
                CheckpointError::DoesNotFit {
                    path: self.path.clone(),
                    reason,
                }
                .into()
            }
            e => e.into(),
        }
    }
}

/// Whether the checkpoint file is there. Only `NotFound` means "no checkpoint": any other
/// error (EACCES, EIO, ESTALE, an NFS timeout, a path through a file) stops the caller, since
/// reading it as "none" would start the run over and let its first save replace a good
/// checkpoint.
fn presence(path: &Path) -> std::result::Result<bool, CheckpointError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(true),
        Ok(_) => Err(CheckpointError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "exists but is not a regular file",
            ),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Rank 0's checkpoint error as every other rank returns it: this rank fails on rank 0's
/// failure, and says so to its launcher (which then names rank 0's own error as the cause).
fn rank_zero_failed(msg: String) -> DdpError {
    ddp_comm::failure_note::note_peer_failure(0, &msg);
    CheckpointError::OnRankZero(msg).into()
}

#[cfg(test)]
mod tests;
