//! [`LearnerCheckpoints`]: burn-train's checkpoints for every rank of a `Learner` job, and the
//! resume at the last epoch they all hold after the launcher restarted the job.
//!
//! burn-train 0.22.1 cannot recover a lost rank live (its `TrainStep::optimize` returns no
//! error, and a resume starts at an epoch: see docs/failures.md). What it can do is resume:
//! after a lost rank the launcher (`ddprun --max-restarts K`) starts the group again, and every
//! rank loads the model, the optimizer and the learning-rate scheduler of the last epoch that
//! rank 0 checkpointed completely, then goes on from the next epoch. With the train loader set
//! to that epoch (its order is a function of the epoch), the job ends bitwise as the job never
//! killed; it loses the part of the epoch that was running.
//!
//! ```ignore
//! let checkpoints = LearnerCheckpoints::open(&ddp, out.join("checkpoint"), recovery::restarted())?;
//! if let Some(epoch) = checkpoints.resume_epoch() {
//!     train.set_epoch(epoch as u64); // the pass after `epoch` finished epochs
//! }
//! let training = checkpoints.apply(SupervisedTraining::new(dir, Arc::new(train), valid));
//! ```
//!
//! Rank 0 writes the three files per epoch (burn-train's `FileCheckpointer`: each file written
//! whole, then renamed into place); the other ranks read rank 0's files and write nothing, so
//! the directory must be one every rank can read (one host, or a shared file system).

use std::path::{Path, PathBuf};

use burn::train::checkpoint::{Checkpoint, Checkpointer, CheckpointerError, FileCheckpointer};
use burn::train::{LearnerModel, SupervisedTraining};
use burn_ddp_checkpoint::CheckpointError;

use crate::comm;
use crate::context::Ddp;
use crate::error::Result;

/// The names burn-train's checkpointers give the three files of an epoch (`{name}-{epoch}.bpk`).
const PARTS: [&str; 3] = ["model", "optim", "scheduler"];

/// burn-train checkpointers shared by every rank of a `Learner` job: rank 0 writes burn-train's
/// three files per epoch (model, optimizer, scheduler), the other ranks only read them. After
/// the launcher restarted the job (`ddprun --max-restarts K`), every rank resumes after the last
/// epoch whose three files are all there; with the train loader set to that epoch the job ends
/// bitwise as the job never killed, having lost the epoch that was running. The directory
/// must be one every rank can read (one host, or a shared file system). burn-train cannot
/// recover a lost rank live (see the [module docs](crate::learner) and docs/failures.md).
#[derive(Debug, Clone)]
pub struct LearnerCheckpoints {
    dir: PathBuf,
    writes: bool,
    resume: Option<usize>,
}

impl LearnerCheckpoints {
    /// The checkpoints under `dir` (rank 0's; it need not exist yet). With `resume` (for
    /// instance [`crate::recovery::restarted`]), rank 0 finds the last epoch whose three files
    /// are all there and every rank learns it ([`Self::resume_epoch`]). Collective.
    ///
    /// # Errors
    /// `dir` unreadable on rank 0 (any error but "not found"), on every rank; the collective's.
    pub fn open(ddp: &Ddp, dir: impl Into<PathBuf>, resume: bool) -> Result<Self> {
        let dir = dir.into();
        let writes = ddp.is_main();
        let found = if writes && resume {
            last_complete_epoch(&dir)
        } else {
            Ok(None)
        };
        // Rank 0's answer, or its error, on every rank: "", an epoch, or "!" and the error.
        let mut message = match &found {
            Ok(None) => String::new(),
            Ok(Some(epoch)) => epoch.to_string(),
            Err(e) => format!("!{e}"),
        }
        .into_bytes();
        if ddp.world_size() > 1 {
            comm::lock(ddp.group()).broadcast_bytes(&mut message, 0)?;
        }
        let message = String::from_utf8_lossy(&message).into_owned();
        let resume = match (found, message.strip_prefix('!')) {
            (Err(e), _) => return Err(e.into()),
            (Ok(_), Some(error)) => return Err(CheckpointError::OnRankZero(error.into()).into()),
            (Ok(_), None) if message.is_empty() => None,
            (Ok(_), None) => Some(message.parse().map_err(|_| {
                CheckpointError::OnRankZero(format!("an epoch that is no number: {message:?}"))
            })?),
        };
        if let Some(epoch) = resume {
            tracing::info!(
                "resuming from the checkpoint of epoch {epoch} in {}",
                dir.display()
            );
        }
        Ok(LearnerCheckpoints {
            dir,
            writes,
            resume,
        })
    }

    /// The epoch every rank resumes after (`None`: a fresh start). The train loader's next
    /// pass must be this epoch's (`ShardedDataLoader::set_epoch(epoch)`: its passes count
    /// from 0, burn-train's epochs from 1).
    pub fn resume_epoch(&self) -> Option<usize> {
        self.resume
    }

    /// The checkpoints' directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `training` with these checkpointers (rank 0 writes, the others only read) and, when
    /// resuming, burn-train's resume at [`Self::resume_epoch`].
    pub fn apply<M: LearnerModel>(&self, training: SupervisedTraining<M>) -> SupervisedTraining<M> {
        let [model, optim, scheduler] =
            PARTS.map(|name| Shared::new(FileCheckpointer::new(&self.dir, name), self.writes));
        let training = training.with_custom_checkpointers(model, optim, scheduler);
        match self.resume {
            Some(epoch) => training.checkpoint(epoch),
            None => training,
        }
    }
}

/// The last epoch of which all three files are in `dir`; `None` when there is none or `dir`
/// does not exist.
fn last_complete_epoch(dir: &Path) -> std::result::Result<Option<usize>, CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(e)),
    };
    let mut epochs: std::collections::BTreeMap<usize, usize> = Default::default();
    for entry in entries {
        let name = entry.map_err(io)?.file_name();
        let Some((part, epoch)) = name
            .to_str()
            .and_then(|n| n.strip_suffix(".bpk"))
            .and_then(|n| n.rsplit_once('-'))
        else {
            continue;
        };
        if let (true, Ok(epoch)) = (PARTS.contains(&part), epoch.parse::<usize>()) {
            *epochs.entry(epoch).or_default() += 1;
        }
    }
    Ok(epochs
        .into_iter()
        .rev()
        .find(|&(_, parts)| parts == PARTS.len())
        .map(|(epoch, _)| epoch))
}

/// One of burn-train's file checkpointers, writing only on the rank that writes.
struct Shared {
    file: FileCheckpointer,
    writes: bool,
}

impl Shared {
    fn new(file: FileCheckpointer, writes: bool) -> Self {
        Shared { file, writes }
    }
}

impl<R: Checkpoint> Checkpointer<R> for Shared {
    fn save(&self, epoch: usize, record: R) -> std::result::Result<(), CheckpointerError> {
        if self.writes {
            self.file.save(epoch, record)
        } else {
            Ok(())
        }
    }

    fn delete(&self, epoch: usize) -> std::result::Result<(), CheckpointerError> {
        if self.writes {
            <FileCheckpointer as Checkpointer<R>>::delete(&self.file, epoch)
        } else {
            Ok(())
        }
    }

    fn restore(&self, epoch: usize) -> std::result::Result<R, CheckpointerError> {
        self.file.restore(epoch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_epoch_with_all_three_files_is_the_one_resumed() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(last_complete_epoch(&dir.path().join("none")).unwrap(), None);
        for name in [
            "model-1.bpk",
            "optim-1.bpk",
            "scheduler-1.bpk",
            "model-2.bpk",
            "optim-2.bpk",
            "scheduler-2.bpk",
            // Epoch 3 cut short: its scheduler file was never written.
            "model-3.bpk",
            "optim-3.bpk",
            "notes-3.bpk",
            "model-x.bpk",
        ] {
            std::fs::write(dir.path().join(name), b"").unwrap();
        }
        assert_eq!(last_complete_epoch(dir.path()).unwrap(), Some(2));
        // A file where the directory should be: an error naming the path, not "none".
        let file = dir.path().join("model-1.bpk");
        let e = last_complete_epoch(&file).unwrap_err();
        assert!(e.to_string().contains("model-1.bpk"), "{e}");
    }
}
