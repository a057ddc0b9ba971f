//! Where the workspace and its build outputs are.

use std::path::{Path, PathBuf};

/// The workspace's root folder (where it was built: the tools run from a checkout).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("cargo-tasks lives in tools/ of the workspace")
        .to_path_buf()
}

/// The target folder cargo builds into: `CARGO_TARGET_DIR` (relative to `root`), else
/// `root/target`.
pub fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|p| if p.is_absolute() { p } else { root.join(p) })
        .unwrap_or_else(|| root.join("target"))
}
