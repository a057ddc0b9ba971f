//! Support code shared by the multi-process tests of the workspace and the rank programs
//! they launch.
//!
//! [`RankJob`] starts N rank processes of a program with the torchrun launch environment
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
//! `MASTER_ADDR=127.0.0.1`, a free `MASTER_PORT`, a fresh `DDP_JOB_TOKEN`), captures each
//! rank's output, enforces a deadline and never leaves a process behind: a [`RunningJob`] kills
//! (SIGKILL) and reaps every rank still running when it is dropped, including on panic.
//! [`Flood`] floods a port with connections for abuse tests. [`data_report`] and [`syncbn_case`] are the messages between rank programs and tests.
//!
//! ```no_run
//! use std::time::Duration;
//! use ddp_testkit::RankJob;
//!
//! // In an integration test: `env!("CARGO_BIN_EXE_comm_worker")`.
//! let worker = "target/debug/comm_worker";
//! let result = RankJob::new(worker, 4)
//!     .arg("matrix")
//!     .deadline(Duration::from_secs(60))
//!     .run()
//!     .expect("spawn");
//! result.assert_success();
//! ```

pub mod data_report;
mod flood;
mod job;
mod launchers;
mod output;
pub mod syncbn_case;

pub use flood::{Flood, connect_from};
pub use job::{
    BIN_DIR_VAR, JobResult, RankJob, RankResult, RunningJob, bundled, free_port, job_token,
};
pub use launchers::{Finished, Launched, Launchers};
pub use output::{collect, rank_lines};

/// The little-endian f32 values of the file at `path` (what the rank programs write their
/// parameters as).
///
/// # Panics
/// When the file can't be read (a test helper: the panic names the path).
pub fn read_f32(path: &std::path::Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
