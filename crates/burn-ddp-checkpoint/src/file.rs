//! The checkpoint file: its byte layout, its checksum and the atomic write.
//!
//! Layout (little-endian): magic `BURNDDPC`, format version `u32`, the lengths of the three
//! sections as `u64`, the CRC-32 of the sections, then the sections: the header (JSON:
//! progress, world size, the user's metadata, and every rank's buffers when they differ), the
//! model record (burnpack), the optimizer state (burnpack).

use std::path::Path;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{Checkpoint, CheckpointError, atomic};

const MAGIC: &[u8; 8] = b"BURNDDPC";
const VERSION: u32 = 1;
const HEADER_LEN: usize = 8 + 4 + 3 * 8 + 4;

/// Fault injection for tests: when set to a number of milliseconds, every checkpoint write
/// pauses that long with half of its bytes in the temporary file, so a test can kill the
/// writer in the middle of a save. Leave it unset in real runs.
pub const WRITE_PAUSE_VAR: &str = "DDP_CHECKPOINT_WRITE_PAUSE_MS";

/// The header section: everything but the two records.
#[derive(Serialize, serde::Deserialize)]
struct Header<T> {
    progress: crate::Progress,
    world_size: usize,
    metadata: T,
    /// Every rank's buffers when they differ (absent in files of earlier versions).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    rank_buffers: Vec<Vec<u8>>,
}

impl<T: Serialize> Checkpoint<T> {
    /// Encodes the checkpoint in the file format.
    ///
    /// # Errors
    /// [`CheckpointError::Encode`] when the metadata does not serialise to JSON.
    pub fn to_bytes(&self) -> Result<Vec<u8>, CheckpointError> {
        let header = serde_json::to_vec(&Header {
            progress: self.progress,
            world_size: self.world_size,
            metadata: &self.metadata,
            rank_buffers: self.rank_buffers.clone(),
        })
        .map_err(|e| CheckpointError::Encode(format!("metadata: {e}")))?;
        let sections = [&header[..], &self.model, &self.optimizer];
        let mut out =
            Vec::with_capacity(HEADER_LEN + sections.iter().map(|s| s.len()).sum::<usize>());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        for s in sections {
            out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        }
        out.extend_from_slice(&checksum(&sections).to_le_bytes());
        for s in sections {
            out.extend_from_slice(s);
        }
        Ok(out)
    }

    /// Writes the checkpoint to `path` atomically: a temporary file in the same directory,
    /// fsync, rename over `path`, fsync of the directory. A crash at any point leaves either
    /// the previous file or the new one at `path`, never a mix.
    ///
    /// # Errors
    /// [`CheckpointError::Io`] naming the file; [`CheckpointError::Encode`].
    pub fn write(&self, path: &Path) -> Result<(), CheckpointError> {
        let bytes = self.to_bytes()?;
        let pause = std::env::var(WRITE_PAUSE_VAR)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_millis);
        atomic::write_with(path, atomic::halves(&bytes, pause)).map_err(|source| {
            CheckpointError::Io {
                path: path.to_path_buf(),
                source,
            }
        })
    }
}

impl<T: DeserializeOwned> Checkpoint<T> {
    /// Decodes a checkpoint; `origin` names it in errors.
    ///
    /// # Errors
    /// [`CheckpointError::Corrupt`] for anything but a complete, undamaged checkpoint whose
    /// metadata has type `T`.
    pub fn from_bytes(bytes: &[u8], origin: &Path) -> Result<Self, CheckpointError> {
        let bad = |reason: String| CheckpointError::Corrupt {
            path: origin.to_path_buf(),
            reason,
        };
        if bytes.len() < HEADER_LEN || &bytes[..8] != MAGIC {
            return Err(bad(
                "not a burn-ddp checkpoint (bad magic or too short)".into()
            ));
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
        let version = u32_at(8);
        if version != VERSION {
            return Err(bad(format!(
                "format version {version}, this burn-ddp reads version {VERSION}"
            )));
        }
        let lens = [u64_at(12), u64_at(20), u64_at(28)];
        let sum = u32_at(36);
        let total = lens
            .iter()
            .try_fold(HEADER_LEN as u64, |a, &l| a.checked_add(l))
            .ok_or_else(|| bad("section lengths overflow".into()))?;
        if total != bytes.len() as u64 {
            return Err(bad(format!(
                "{} bytes, its header says {total} (truncated or altered)",
                bytes.len()
            )));
        }
        let (header, rest) = bytes[HEADER_LEN..].split_at(lens[0] as usize);
        let (model, optimizer) = rest.split_at(lens[1] as usize);
        if checksum(&[header, model, optimizer]) != sum {
            return Err(bad("checksum mismatch (the file is damaged)".into()));
        }
        let header: Header<T> =
            serde_json::from_slice(header).map_err(|e| bad(format!("header: {e}")))?;
        Ok(Self {
            progress: header.progress,
            world_size: header.world_size,
            metadata: header.metadata,
            model: model.to_vec(),
            optimizer: optimizer.to_vec(),
            rank_buffers: header.rank_buffers,
            reader: None,
        })
    }

    /// Reads and decodes the checkpoint at `path`.
    ///
    /// # Errors
    /// [`CheckpointError::Io`] when the file can't be read; [`CheckpointError::Corrupt`].
    pub fn read(path: &Path) -> Result<Self, CheckpointError> {
        Self::from_bytes(&read_file(path)?, path)
    }
}

/// The raw bytes of the file at `path` (what [`Checkpoint::from_bytes`] decodes).
///
/// # Errors
/// [`CheckpointError::Io`] naming the file.
pub fn read_file(path: &Path) -> Result<Vec<u8>, CheckpointError> {
    std::fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn checksum(sections: &[&[u8]]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for s in sections {
        h.update(s);
    }
    h.finalize()
}

/// Writes `bytes` to a temporary file next to `path`, locked while it is written, fsyncs it and
/// renames it over `path`, then fsyncs the directory: a reader sees the old file or the new
/// one, never a part, and a reader's clean-up never removes a save in progress. What
/// checkpoints are written with; use it for other outputs that must not be torn.
///
/// # Errors
/// The I/O error of any step, the directory's fsync included (the temporary is removed and the
/// previous file at `path` is untouched).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    atomic::write_with(path, atomic::halves(bytes, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Progress;
    use burn_ddp_data::LoaderState;

    fn sample() -> Checkpoint<Vec<String>> {
        Checkpoint {
            progress: Progress {
                step: 250,
                epochs_done: 2,
                loader: Some(LoaderState {
                    batches_done: 17,
                    ..LoaderState::at_epoch(2)
                }),
            },
            world_size: 4,
            metadata: vec!["lr 0.1".into()],
            model: (0..=255).collect(),
            optimizer: vec![7; 100],
            rank_buffers: vec![vec![1, 2], vec![3, 4], vec![5, 6], vec![7, 8]],
            reader: None,
        }
    }

    #[test]
    fn round_trips_through_a_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("checkpoint.bin");
        let c = sample();
        c.write(&p).unwrap();
        assert_eq!(Checkpoint::read(&p).unwrap(), c);
        // A checkpoint of equal buffers on every rank writes none (and reads as none).
        let same = Checkpoint {
            rank_buffers: Vec::new(),
            ..sample()
        };
        same.write(&p).unwrap();
        assert_eq!(Checkpoint::read(&p).unwrap(), same);
        let mut c2 = sample();
        c2.progress.step = 300;
        c2.write(&p).unwrap();
        assert_eq!(
            Checkpoint::<Vec<String>>::read(&p).unwrap().progress.step,
            300
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    /// What a writer killed half-way leaves is its temporary file; the checkpoint at the path
    /// is still the previous one, and the stale temporary is removed by the next reader.
    #[test]
    fn a_save_cut_short_leaves_the_previous_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("checkpoint.bin");
        let first = sample();
        first.write(&p).unwrap();
        let mut newer = sample();
        newer.progress.step = 999;
        let bytes = newer.to_bytes().unwrap();
        let stale = atomic::temporary_name(&p).unwrap();
        std::fs::write(&stale, &bytes[..bytes.len() / 2]).unwrap();
        assert_eq!(Checkpoint::read(&p).unwrap(), first);
        assert_eq!(atomic::remove_stale_temporaries(&p), 1);
        assert!(!stale.exists());
        assert!(p.exists());
    }

    #[test]
    fn damage_is_detected_and_named() {
        let bytes = sample().to_bytes().unwrap();
        let p = Path::new("<test>");
        let e = Checkpoint::<Vec<String>>::from_bytes(&bytes[..bytes.len() - 1], p).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        for at in [HEADER_LEN + 3, bytes.len() - 1] {
            let mut flipped = bytes.clone();
            flipped[at] ^= 1;
            let e = Checkpoint::<Vec<String>>::from_bytes(&flipped, p).unwrap_err();
            assert!(e.to_string().contains("checksum"), "{e}");
        }
        let e = Checkpoint::<Vec<String>>::from_bytes(b"not a checkpoint, just some words..", p)
            .unwrap_err();
        assert!(e.to_string().contains("magic"), "{e}");
        // Metadata of another type is refused, not misread.
        let e = Checkpoint::<u64>::from_bytes(&bytes, p).unwrap_err();
        assert!(e.to_string().contains("header"), "{e}");
        let e = Checkpoint::<Vec<String>>::read(Path::new("/nonexistent/ck.bin")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/ck.bin"), "{e}");
    }
}
