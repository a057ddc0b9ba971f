//! Training checkpoints: model + optimizer + epoch + sampler state in one file, written atomically.
//!
//! Layout (little-endian): magic `TRAINCNN`, format version `u32`, the lengths of the three
//! sections as `u64`, an FNV-1a 64 checksum of the sections, then the sections: metadata (JSON),
//! model record (burnpack), optimizer record (burnpack). The file is written to a temporary name,
//! flushed, and renamed over the previous checkpoint, so a crash mid-write leaves the previous
//! checkpoint intact; a truncated or altered file is refused with a clear error.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::metrics::{EpochMetrics, write_atomic};
use crate::model::CnnConfig;

const MAGIC: &[u8; 8] = b"TRAINCNN";
const VERSION: u32 = 1;
const HEADER_LEN: usize = 8 + 4 + 3 * 8 + 8;

/// The file name of the checkpoint under the output directory.
pub const FILE_NAME: &str = "checkpoint.bin";

/// The data order state: the next epoch's sampler uses `seed + epoch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// Shuffle seed.
    pub seed: u64,
    /// The epoch to run next (0-based).
    pub epoch: u64,
}

/// Everything in a checkpoint besides the tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Number of epochs completed.
    pub epochs_done: usize,
    /// Where the data order resumes.
    pub sampler: SamplerState,
    /// The network's shape (a resumed run must build the same one).
    pub model: CnnConfig,
    /// The norm layer the model was trained with (informational: the records are compatible).
    pub norm: String,
    /// Per-rank batch size and world size of the run that wrote it.
    pub batch_size: usize,
    /// World size of the run that wrote it.
    pub world_size: usize,
    /// Learning rate (the peak of the schedule).
    pub lr: f64,
    /// The learning-rate schedule and the total number of epochs it spans (`--lr-schedule`,
    /// `--epochs`); `None` in checkpoints written before schedules existed (constant lr).
    #[serde(default)]
    pub schedule: Option<(String, usize)>,
    /// The data source (`--data`).
    pub data: String,
    /// Metrics of the completed epochs.
    pub history: Vec<EpochMetrics>,
}

/// A checkpoint in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// Metadata.
    pub meta: CheckpointMeta,
    /// The model record (burnpack bytes).
    pub model: Vec<u8>,
    /// The optimizer record (burnpack bytes).
    pub optimizer: Vec<u8>,
}

/// Errors reading or writing checkpoints.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// I/O failure.
    #[error("checkpoint {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The bytes are not a valid checkpoint.
    #[error("checkpoint {path} is not usable: {reason}")]
    Corrupt {
        /// The file (or `<bytes>` for an in-memory buffer).
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

impl Checkpoint {
    /// Encodes the checkpoint.
    pub fn to_bytes(&self) -> Vec<u8> {
        let meta = serde_json::to_vec(&self.meta).expect("checkpoint metadata serialises");
        let mut out =
            Vec::with_capacity(HEADER_LEN + meta.len() + self.model.len() + self.optimizer.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        for s in [&meta, &self.model, &self.optimizer] {
            out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        }
        let sum = fnv1a(&[&meta, &self.model, &self.optimizer]);
        out.extend_from_slice(&sum.to_le_bytes());
        out.extend_from_slice(&meta);
        out.extend_from_slice(&self.model);
        out.extend_from_slice(&self.optimizer);
        out
    }

    /// Decodes a checkpoint; `origin` names it in errors.
    pub fn from_bytes(bytes: &[u8], origin: &Path) -> Result<Self, CheckpointError> {
        let bad = |reason: String| CheckpointError::Corrupt {
            path: origin.to_path_buf(),
            reason,
        };
        if bytes.len() < HEADER_LEN || &bytes[..8] != MAGIC {
            return Err(bad(
                "not a train-cnn checkpoint (bad magic or too short)".into()
            ));
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
        let version = u32_at(8);
        if version != VERSION {
            return Err(bad(format!(
                "format version {version}, this program reads {VERSION}"
            )));
        }
        let lens = [u64_at(12), u64_at(20), u64_at(28)];
        let sum = u64_at(36);
        let total = lens
            .iter()
            .try_fold(HEADER_LEN as u64, |a, &l| a.checked_add(l))
            .ok_or_else(|| bad("section lengths overflow".into()))?;
        if total != bytes.len() as u64 {
            return Err(bad(format!(
                "{} bytes, header says {total} (truncated or altered)",
                bytes.len()
            )));
        }
        let (m, rest) = bytes[HEADER_LEN..].split_at(lens[0] as usize);
        let (model, optim) = rest.split_at(lens[1] as usize);
        if fnv1a(&[m, model, optim]) != sum {
            return Err(bad("checksum mismatch (the file is damaged)".into()));
        }
        let meta = serde_json::from_slice(m).map_err(|e| bad(format!("metadata: {e}")))?;
        Ok(Self {
            meta,
            model: model.to_vec(),
            optimizer: optim.to_vec(),
        })
    }

    /// Writes the checkpoint to `path` atomically (temporary file, flush, rename).
    pub fn save(&self, path: &Path) -> Result<(), CheckpointError> {
        write_atomic(path, &self.to_bytes()).map_err(|source| CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The parameter values of the model record, in visit order: the record decoded into a
    /// BatchNorm CNN on the CPU (BatchNorm and SyncBatchNorm models have the same records).
    /// Records name parameters by per-process ids, so compare these, not the bytes.
    pub fn parameter_values(&self) -> Result<Vec<f32>, CheckpointError> {
        use burn::module::Module;
        let bad = |reason: String| CheckpointError::Corrupt {
            path: PathBuf::from("<model record>"),
            reason,
        };
        let device = burn::tensor::Device::flex();
        let record = burn::store::ModuleRecord::from_bytes(burn::tensor::Bytes::from_bytes_vec(
            self.model.clone(),
        ))
        .map_err(|e| bad(format!("{e}")))?;
        let model = self
            .meta
            .model
            .init::<burn::nn::BatchNorm>(&device)
            .try_load_record(record)
            .map_err(|e| bad(format!("the record does not fit the model: {e}")))?;
        Ok(crate::model::parameter_values(&model))
    }

    /// Reads the raw bytes of the checkpoint at `path` (to broadcast them before decoding).
    pub fn read_bytes(path: &Path) -> Result<Vec<u8>, CheckpointError> {
        std::fs::read(path).map_err(|source| CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Reads and decodes the checkpoint at `path`.
    pub fn load(path: &Path) -> Result<Self, CheckpointError> {
        Self::from_bytes(&Self::read_bytes(path)?, path)
    }
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Checkpoint {
        Checkpoint {
            meta: CheckpointMeta {
                epochs_done: 2,
                sampler: SamplerState { seed: 9, epoch: 2 },
                model: CnnConfig::small(28, 28, 10),
                norm: "BatchNorm".into(),
                batch_size: 32,
                world_size: 2,
                lr: 0.05,
                schedule: Some(("cosine".into(), 4)),
                data: "synthetic".into(),
                history: vec![],
            },
            model: (0..=255).collect(),
            optimizer: vec![7; 100],
        }
    }

    #[test]
    fn round_trips_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(FILE_NAME);
        let c = sample();
        c.save(&p).unwrap();
        assert_eq!(Checkpoint::load(&p).unwrap(), c);
        // Overwriting keeps a single, complete file and no temporary.
        let mut c2 = sample();
        c2.meta.epochs_done = 3;
        c2.save(&p).unwrap();
        assert_eq!(Checkpoint::load(&p).unwrap().meta.epochs_done, 3);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    /// A process killed in the middle of a save leaves at most its temporary file (the rename
    /// is the only step that touches the checkpoint): the previous checkpoint still loads, and
    /// the next save replaces it as usual.
    #[test]
    fn a_save_cut_short_leaves_the_previous_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(FILE_NAME);
        let first = sample();
        first.save(&p).unwrap();
        // What a writer killed after half of its bytes leaves behind (its pid in the name).
        let mut newer = sample();
        newer.meta.epochs_done = 3;
        let bytes = newer.to_bytes();
        std::fs::write(
            dir.path().join(format!(".{FILE_NAME}.tmp-999999")),
            &bytes[..bytes.len() / 2],
        )
        .unwrap();
        assert_eq!(Checkpoint::load(&p).unwrap(), first);
        newer.save(&p).unwrap();
        assert_eq!(Checkpoint::load(&p).unwrap().meta.epochs_done, 3);
    }

    #[test]
    fn damage_is_detected() {
        let bytes = sample().to_bytes();
        let p = Path::new("<test>");
        let e = Checkpoint::from_bytes(&bytes[..bytes.len() - 1], p).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 1;
        let e = Checkpoint::from_bytes(&flipped, p).unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");
        let e = Checkpoint::from_bytes(b"hello world, not a checkpoint at all....", p).unwrap_err();
        assert!(e.to_string().contains("magic"), "{e}");
        let e = Checkpoint::load(Path::new("/nonexistent/checkpoint.bin")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/checkpoint.bin"), "{e}");
    }
}
