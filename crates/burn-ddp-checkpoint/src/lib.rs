//! The checkpoint file of data-parallel Burn training (re-exported by `burn-ddp` as
//! `burn_ddp::checkpoint`, whose `Checkpointer` saves and resumes it collectively): one file
//! holding the model record, the optimizer state, where the run stands ([`Progress`]), metadata
//! of the program's own and, when they differ, every rank's buffers.
//!
//! - **The format** ([`Checkpoint::to_bytes`], [`Checkpoint::from_bytes`]): a magic number, a
//!   version, the sections' lengths and a CRC-32 over them; a damaged or truncated file is an
//!   error ([`CheckpointError::Corrupt`]), never a fresh start.
//! - **Atomic writes** ([`Checkpoint::write`], [`write_atomic`]): a locked temporary file in
//!   the same directory, fsync, rename, fsync of the directory. A crash at any point leaves the
//!   previous file or the new one, never a mix; [`remove_stale_temporaries`] clears what a dead
//!   writer left.
//! - **Buffers** ([`pack_buffers`], [`restore_buffers`]): a model's float tensors without
//!   gradient (BatchNorm's running statistics), as bytes and back.
//! - **Running statistics** ([`commit_running_states`]): Burn's pending `RunningState`
//!   updates committed before a model is read or replaced.
//!
//! ```no_run
//! use burn_ddp_checkpoint::Checkpoint;
//! # fn main() -> Result<(), burn_ddp_checkpoint::CheckpointError> {
//! let ck = Checkpoint::<serde_json::Value>::read(std::path::Path::new("runs/job/checkpoint.bin"))?;
//! println!("step {} of a job of {} ranks", ck.progress.step, ck.world_size);
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod atomic;
mod buffers;
mod error;
mod file;
mod running_state;

use std::path::Path;

use burn::module::Module;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use burn_ddp_data::LoaderState;
use serde::{Deserialize, Serialize};

pub use atomic::remove_stale_temporaries;
pub use buffers::{pack_buffers, restore_buffers};
pub use error::CheckpointError;
pub use file::{WRITE_PAUSE_VAR, read_file, write_atomic};
pub use running_state::commit_running_states;

/// Where a training run stands: saved with every checkpoint, returned on resume.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// Optimizer steps taken so far (the global step).
    pub step: u64,
    /// Epochs completed.
    pub epochs_done: u64,
    /// The sharded loader's position (`ShardedDataLoader::state`), to continue the data order
    /// at the exact batch; `None` when the program doesn't use the loader.
    pub loader: Option<LoaderState>,
}

/// What a resume found besides the model (burn-ddp's `Checkpointer::load` returns it).
#[derive(Debug, Clone, PartialEq)]
pub struct Resumed<T> {
    /// Where the run stood.
    pub progress: Progress,
    /// The world size of the job that wrote the checkpoint.
    pub world_size: usize,
    /// The program's metadata.
    pub metadata: T,
}

/// One checkpoint in memory: progress, metadata of type `T`, and the two records.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint<T> {
    /// Where the run stood.
    pub progress: Progress,
    /// The world size of the job that wrote it.
    pub world_size: usize,
    /// The program's own metadata.
    pub metadata: T,
    /// The model record (burnpack bytes, [`Module::into_record`]).
    pub model: Vec<u8>,
    /// The optimizer state (burnpack bytes).
    pub optimizer: Vec<u8>,
    /// Every rank's buffers (float tensors without gradient, in visit order, as bytes) when
    /// they differ between ranks — per-rank BatchNorm's running statistics; empty when every
    /// rank's equal rank 0's, which [`Self::model`] holds (SyncBatchNorm, one rank).
    pub rank_buffers: Vec<Vec<u8>>,
    /// The rank and world size of the process that read it ([`Self::read_by`]): whose buffers
    /// [`Self::own_buffers`] gives.
    reader: Option<(usize, usize)>,
}

impl<T> Checkpoint<T> {
    /// Captures `model` now, with the optimizer state given as bytes (an optimizer's
    /// `into_bytes`, or a sharded optimizer's state gathered to rank 0).
    ///
    /// # Errors
    /// [`CheckpointError::Encode`] when the model record can't be serialised.
    pub fn capture_with_state<M: Module>(
        model: &M,
        optimizer: Vec<u8>,
        progress: Progress,
        world_size: usize,
        metadata: T,
    ) -> Result<Self, CheckpointError> {
        // The newest running statistics, not the ones before the last step's update.
        commit_running_states(model);
        let model = model
            .clone()
            .into_record()
            .into_bytes()
            .map_err(|e| CheckpointError::Encode(format!("the model record: {e}")))?
            .to_vec();
        Ok(Self {
            progress,
            world_size,
            metadata,
            model,
            optimizer,
            rank_buffers: Vec::new(),
            reader: None,
        })
    }

    /// Marks this checkpoint as read by `rank` of a job of `world_size` ranks, so that
    /// [`Self::own_buffers`] gives that rank its own buffers.
    #[must_use]
    pub fn read_by(mut self, rank: usize, world_size: usize) -> Self {
        self.reader = Some((rank, world_size));
        self
    }

    /// The buffers of the rank that read this checkpoint ([`Self::read_by`]): its own, when
    /// the checkpoint holds every rank's and the job has the world size that wrote it; `None`
    /// otherwise (every rank then has rank 0's, from the model record).
    pub fn own_buffers(&self) -> Option<&[u8]> {
        let (rank, world) = self.reader?;
        (self.rank_buffers.len() == world && world == self.world_size)
            .then(|| self.rank_buffers[rank].as_slice())
    }

    /// `model` with the checkpoint's parameters and buffers; `origin` names the checkpoint in
    /// errors.
    ///
    /// # Errors
    /// [`CheckpointError::DoesNotFit`] when the record is not one of this model.
    pub fn restore_model<M: Module>(&self, model: M, origin: &Path) -> Result<M, CheckpointError> {
        let misfit = |reason: String| CheckpointError::DoesNotFit {
            path: origin.to_path_buf(),
            reason,
        };
        let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(self.model.clone()))
            .map_err(|e| misfit(format!("the model record: {e}")))?;
        // A pending update of the model's own would overwrite the loaded running statistics
        // at the next forward.
        commit_running_states(&model);
        model
            .try_load_record(record)
            .map_err(|e| misfit(format!("the model record does not fit the model: {e}")))
    }
}

#[cfg(test)]
mod tests;
