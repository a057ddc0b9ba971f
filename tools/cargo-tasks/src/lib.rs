//! What the workspace's tools (`cargo xtask`, the CUDA tools, the bench runner) share: where the
//! workspace and its build outputs are, a `cargo` to run from inside `cargo run`, the command
//! lines of CI's one build, and the ResNet-18 benchmark's launch description and table
//! ([`resnet`]: `cargo xtask bench resnet` and the GPU check's ResNet row run the same programs
//! with the same arguments and print the same table).

#![warn(missing_docs)]

mod build_set;
mod command;
pub mod resnet;
mod workspace;

pub use build_set::{
    BURN_DEFAULT_DEVICE, CUDA_BUILD_ARGS, CUDA_NVRTC_BUILD_ARGS, CUDA_TARGETS, FEATURES,
};
pub use command::{LINT_MARKER, cargo, lint_with_clippy, run};
pub use workspace::{target_dir, workspace_root};
