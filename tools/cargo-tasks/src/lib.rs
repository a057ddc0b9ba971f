//! What the workspace's tools (`cargo xtask`, the CUDA tools) share: where the workspace and its
//! build outputs are, a `cargo` to run from inside `cargo run`, and the command lines of CI's one
//! build.

#![warn(missing_docs)]

mod build_set;
mod command;
mod workspace;

pub use build_set::{
    BURN_DEFAULT_DEVICE, CUDA_BUILD_ARGS, CUDA_NVRTC_BUILD_ARGS, CUDA_TARGETS, FEATURES,
};
pub use command::{LINT_MARKER, cargo, lint_with_clippy, run};
pub use workspace::{target_dir, workspace_root};
