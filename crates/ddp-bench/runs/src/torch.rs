//! PyTorch for the side-by-side benchmarks: the `python3` that imports `torch`, or a copy the
//! bench installs with pip into a cache folder of its own when this machine's Python has none.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The variable that names the cache folder (default `$XDG_CACHE_HOME/burn-ddp/torch`, else
/// `$HOME/.cache/burn-ddp/torch`).
pub const TORCH_DIR_VAR: &str = "DDP_TORCH_DIR";

/// What pip installs when no torch is found (a CPU run needs nothing else; on Linux x86-64
/// PyPI's wheel brings its CUDA libraries too: about 5 GB, two minutes here).
pub const TORCH_REQUIREMENT: &str = "torch>=2.4";

/// A Python that imports torch: `python3`, with `PYTHONPATH` set to the cache folder when the
/// torch it imports lives there.
#[derive(Debug, Clone)]
pub struct TorchPython {
    /// The folder pip installed torch into, if not Python's own site-packages.
    pub path: Option<PathBuf>,
}

impl TorchPython {
    /// A `python3` command that imports this torch.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new("python3");
        if let Some(dir) = &self.path {
            cmd.env("PYTHONPATH", dir);
        }
        cmd
    }

    /// Whether `import torch.distributed` works in [`Self::command`].
    fn imports_torch(&self) -> bool {
        self.command()
            .args(["-c", "import torch.distributed"])
            .output()
            .is_ok_and(|o| o.status.success())
    }
}

/// The cache folder: [`TORCH_DIR_VAR`], else under the user's cache directory.
///
/// # Errors
/// Neither the variable, `XDG_CACHE_HOME` nor `HOME` is set.
pub fn cache_dir() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os(TORCH_DIR_VAR) {
        return Ok(PathBuf::from(dir));
    }
    if let Some(cache) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(Path::new(&cache).join("burn-ddp").join("torch"));
    }
    match std::env::var_os("HOME") {
        Some(home) => Ok(Path::new(&home)
            .join(".cache")
            .join("burn-ddp")
            .join("torch")),
        None => Err(format!(
            "no folder for PyTorch: set {TORCH_DIR_VAR}, XDG_CACHE_HOME or HOME"
        )),
    }
}

/// This machine's torch, else the cache folder's, else torch installed there now by pip.
///
/// # Errors
/// No cache folder, or pip failed, or the installed torch does not import.
pub fn find_or_install() -> Result<TorchPython, String> {
    let system = TorchPython { path: None };
    if system.imports_torch() {
        return Ok(system);
    }
    let dir = cache_dir()?;
    let cached = TorchPython {
        path: Some(dir.clone()),
    };
    if cached.imports_torch() {
        return Ok(cached);
    }
    eprintln!(
        "bench: no PyTorch in python3; installing {TORCH_REQUIREMENT} with pip into {} \
         (about 5 GB; set {TORCH_DIR_VAR} to put it elsewhere)",
        dir.display()
    );
    let status = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--upgrade", "--target"])
        .arg(&dir)
        .arg(TORCH_REQUIREMENT)
        .status()
        .map_err(|e| format!("cannot run python3 -m pip: {e}"))?;
    if !status.success() {
        return Err(format!(
            "pip could not install {TORCH_REQUIREMENT} into {} ({status})",
            dir.display()
        ));
    }
    if cached.imports_torch() {
        Ok(cached)
    } else {
        Err(format!(
            "pip installed {TORCH_REQUIREMENT} into {} but python3 cannot import it from there",
            dir.display()
        ))
    }
}
