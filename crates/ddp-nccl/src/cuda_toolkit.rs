//! The CUDA toolkit files Burn's CUDA backend needs at run time, found without a toolkit
//! install: **`libdevice.10.bc`** (NVIDIA's math library in LLVM bitcode, linked into every
//! kernel that calls exp, log, tanh, erf, … — cross-entropy does) and **`ptxas`** (the PTX
//! assembler, which only the CUDA driver stand-in of CI needs).
//!
//! cubecl-llvm (0.11.3) reads libdevice from `$CUDA_PATH/nvvm/libdevice/libdevice.10.bc`, or,
//! without `CUDA_PATH`, from the first of `/usr/local/cuda`, `/opt/cuda`, `/usr/lib/cuda`,
//! `/usr` holding `nvvm/libdevice`; a GPU machine with PyTorch but no toolkit has the file only
//! inside its pip wheels. [`prepare_libdevice`] looks in the toolkit folders and in those wheels
//! ([`libdevice_candidates`]), and sets `CUDA_PATH` so that cubecl-llvm finds what it found —
//! through a link in a folder of the right layout when the file sits elsewhere (triton's
//! wheel). Nothing found is one [`ToolkitError::LibdeviceNotFound`] naming every path tried.
//!
//! ```
//! match ddp_nccl::cuda_toolkit::find_libdevice() {
//!     Ok(file) => println!("libdevice: {}", file.display()),
//!     Err(e) => println!("{e}"),
//! }
//! ```

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use thiserror::Error;

/// The file cubecl-llvm links math intrinsics from.
pub const LIBDEVICE: &str = "libdevice.10.bc";

/// How long the Python interpreter may take to name its site-packages folders.
const PYTHON_DEADLINE: Duration = Duration::from_secs(10);

/// Why a toolkit file cannot be used.
#[derive(Debug, Error)]
pub enum ToolkitError {
    /// No `libdevice.10.bc` in any folder tried.
    #[error(
        "libdevice.10.bc not found: Burn's CUDA kernels that call exp/log/tanh/erf link it (the \
         CUDA toolkit's nvvm/libdevice). Tried {}. Install a toolkit, `pip install \
         nvidia-cuda-nvcc` (its nvidia-nvvm dependency has it; so has PyTorch's triton wheel), or set CUDA_PATH to a \
         folder holding nvvm/libdevice/libdevice.10.bc",
        list(tried)
    )]
    LibdeviceNotFound {
        /// Every file looked for, in order.
        tried: Vec<PathBuf>,
    },
    /// No `ptxas` in any folder tried.
    #[error(
        "ptxas not found: tried {}. `pip install nvidia-cuda-nvcc` provides one \
         (site-packages/nvidia/cu13/bin/ptxas)",
        list(tried)
    )]
    PtxasNotFound {
        /// Every file looked for, in order.
        tried: Vec<PathBuf>,
    },
    /// No NVRTC library in any folder tried (cubecl-cuda's `cpp` backend, see
    /// [`crate::nvrtc_files`]).
    #[error(
        "NVRTC (libnvrtc.so.13 or .12) not found: the CUDA C++ backend (`cuda-nvrtc`) compiles \
         every kernel with it. Tried {}. `pip install nvidia-cuda-nvrtc` (PyTorch's CUDA wheels \
         depend on it) or install a CUDA toolkit",
        list(tried)
    )]
    NvrtcNotFound {
        /// Every file looked for, in order.
        tried: Vec<PathBuf>,
    },
    /// NVRTC is on disk but does not load under the names cudarc tries.
    #[error(
        "this build compiles CUDA kernels with NVRTC (feature cuda-nvrtc), but no libnvrtc.so / \
         libnvrtc.so.12 loads; {} is there: link it as libnvrtc.so, with the \
         libnvrtc-builtins.so.* beside it, into a folder on LD_LIBRARY_PATH before the program \
         starts (see ddp_nccl::nvrtc_files)",
        file.display()
    )]
    NvrtcNotLinked {
        /// The NVRTC library found.
        file: PathBuf,
    },
    /// No folder with the CUDA headers (`cuda_fp16.h`).
    #[error(
        "the CUDA headers (cuda_fp16.h) were not found: the CUDA C++ backend's kernels include \
         them. Tried {}. `pip install nvidia-cuda-runtime` (PyTorch's CUDA wheels depend on it) \
         or install a CUDA toolkit",
        list(tried)
    )]
    HeadersNotFound {
        /// Every folder looked for, in order.
        tried: Vec<PathBuf>,
    },
    /// The folder that makes libdevice visible to cubecl-llvm could not be made.
    #[error("cannot link {} into {}: {source}", file.display(), dir.display())]
    Link {
        /// The file being linked (libdevice, NVRTC, the headers).
        file: PathBuf,
        /// The folder being made.
        dir: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

fn list(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Python's site-packages folders (where pip's `nvidia-*` and `triton` wheels live): what
/// `python3` reports (within 10 s), then the usual folders of `VIRTUAL_ENV`, `CONDA_PREFIX`,
/// `/usr/local/lib` and `/usr/lib`. Cached for the process.
pub fn site_packages() -> &'static [PathBuf] {
    static SITES: OnceLock<Vec<PathBuf>> = OnceLock::new();
    SITES.get_or_init(|| {
        let mut sites = python_site_packages();
        let mut prefixes: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
            .iter()
            .filter_map(|k| std::env::var_os(k).filter(|v| !v.is_empty()))
            .map(PathBuf::from)
            .collect();
        prefixes.extend(["/usr/local", "/usr"].map(PathBuf::from));
        for prefix in prefixes {
            let lib = prefix.join("lib");
            let Ok(rd) = std::fs::read_dir(&lib) else {
                continue;
            };
            let mut pythons: Vec<PathBuf> = rd
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
                .map(|e| e.path())
                .collect();
            pythons.sort();
            pythons.reverse();
            for py in pythons {
                for sub in ["site-packages", "dist-packages"] {
                    sites.push(py.join(sub));
                }
            }
        }
        let mut seen = Vec::new();
        sites.retain(|s| {
            let fresh = s.is_dir() && !seen.contains(s);
            seen.push(s.clone());
            fresh
        });
        sites
    })
}

/// What `python3 -c 'import site; …'` prints, or nothing when it is absent or slow.
fn python_site_packages() -> Vec<PathBuf> {
    let script = "import site, sysconfig\n\
                  p = []\n\
                  try: p += site.getsitepackages() + [site.getusersitepackages()]\n\
                  except Exception: pass\n\
                  p.append(sysconfig.get_paths()['purelib'])\n\
                  print('\\n'.join(p))";
    let Ok(mut child) = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
    else {
        return Vec::new();
    };
    let deadline = Instant::now() + PYTHON_DEADLINE;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Vec::new();
            }
        }
    }
    let mut out = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        let _ = io::Read::read_to_string(&mut stdout, &mut out);
    }
    out.lines()
        .filter(|l| !l.trim().is_empty())
        .map(PathBuf::from)
        .collect()
}

/// Toolkit roots, in the order tried: `CUDA_PATH`, `CUDA_HOME`, `/usr/local/cuda`, every
/// `/usr/local/cuda-*` (newest name first), `/opt/cuda`, `/usr/lib/cuda`.
pub(crate) fn toolkit_roots() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["CUDA_PATH", "CUDA_HOME"]
        .iter()
        .filter_map(|k| std::env::var_os(k).filter(|v| !v.is_empty()))
        .map(PathBuf::from)
        .collect();
    roots.push(PathBuf::from("/usr/local/cuda"));
    if let Ok(rd) = std::fs::read_dir("/usr/local") {
        let mut versioned: Vec<PathBuf> = rd
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("cuda-"))
            .map(|e| e.path())
            .collect();
        versioned.sort();
        versioned.reverse();
        roots.extend(versioned);
    }
    roots.extend(["/opt/cuda", "/usr/lib/cuda"].map(PathBuf::from));
    roots
}

/// Every place `libdevice.10.bc` is looked for, in order: under each toolkit root
/// (`nvvm/libdevice/`), Debian's `nvidia-cuda-toolkit` folder, then in each site-packages
/// folder the wheels' layouts — `nvidia/cu13/nvvm/libdevice/` (nvidia-nvvm 13.x, a dependency of
/// nvidia-cuda-nvcc) and `nvidia/cuda_nvcc/nvvm/libdevice/` (nvidia-cuda-nvcc-cu12), `triton/backends/nvidia/lib/` (PyTorch's triton).
pub fn libdevice_candidates(sites: &[PathBuf]) -> Vec<PathBuf> {
    let nvvm = |root: &Path| root.join("nvvm").join("libdevice").join(LIBDEVICE);
    let mut files: Vec<PathBuf> = toolkit_roots().iter().map(|r| nvvm(r)).collect();
    files.push(PathBuf::from("/usr/lib/nvidia-cuda-toolkit/libdevice").join(LIBDEVICE));
    for site in sites {
        for wheel in ["nvidia/cu13", "nvidia/cuda_nvcc", "nvidia/cu12"] {
            files.push(nvvm(&site.join(wheel)));
        }
        files.push(site.join("triton/backends/nvidia/lib").join(LIBDEVICE));
    }
    files
}

/// The first `libdevice.10.bc` of [`libdevice_candidates`].
///
/// # Errors
/// [`ToolkitError::LibdeviceNotFound`] naming every path tried.
pub fn find_libdevice() -> Result<PathBuf, ToolkitError> {
    let tried = libdevice_candidates(site_packages());
    match tried.iter().find(|f| f.is_file()) {
        Some(f) => Ok(f.clone()),
        None => Err(ToolkitError::LibdeviceNotFound { tried }),
    }
}

/// The `CUDA_PATH` under which cubecl-llvm finds `file` as `nvvm/libdevice/libdevice.10.bc`:
/// the toolkit root when `file` already sits in that layout, else `link_root` after linking
/// `link_root/nvvm/libdevice/libdevice.10.bc` to `file`.
///
/// # Errors
/// [`ToolkitError::Link`] when the folder or the link cannot be made.
pub fn cuda_path_for(file: &Path, link_root: &Path) -> Result<PathBuf, ToolkitError> {
    let in_layout = file
        .parent()
        .filter(|d| d.ends_with("nvvm/libdevice"))
        .and_then(Path::parent)
        .and_then(Path::parent);
    if let Some(root) = in_layout {
        return Ok(root.to_path_buf());
    }
    let dir = link_root.join("nvvm").join("libdevice");
    let link = dir.join(LIBDEVICE);
    let err = |source| ToolkitError::Link {
        file: file.to_path_buf(),
        dir: dir.clone(),
        source,
    };
    std::fs::create_dir_all(&dir).map_err(err)?;
    match std::fs::read_link(&link) {
        Ok(target) if target == file => return Ok(link_root.to_path_buf()),
        Ok(_) => std::fs::remove_file(&link).map_err(err)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    std::os::unix::fs::symlink(file, &link).map_err(err)?;
    Ok(link_root.to_path_buf())
}

/// What [`prepare_libdevice`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Libdevice {
    /// The `libdevice.10.bc` found.
    pub file: PathBuf,
    /// The `CUDA_PATH` cubecl-llvm now reads it under.
    pub cuda_path: PathBuf,
}

/// Finds libdevice and makes cubecl-llvm find it: sets `CUDA_PATH` unless it already holds
/// `nvvm/libdevice/libdevice.10.bc` (a `CUDA_PATH` without it is replaced, with a warning).
/// The first result is kept for the process. Call it before the first CUDA kernel is
/// compiled — burn-ddp's `Ddp::init` does for a CUDA device — and preferably at the start of
/// `main`, before other threads read the environment.
///
/// # Errors
/// [`ToolkitError::LibdeviceNotFound`] (every path tried) or [`ToolkitError::Link`].
pub fn prepare_libdevice() -> Result<Libdevice, ToolkitError> {
    static DONE: OnceLock<Result<Libdevice, String>> = OnceLock::new();
    let first = DONE.get_or_init(|| {
        let result = prepare_libdevice_now();
        result.map_err(|e| e.to_string())
    });
    match first {
        Ok(l) => Ok(l.clone()),
        // A later call repeats the search, so the caller gets the typed error.
        Err(_) => prepare_libdevice_now(),
    }
}

fn prepare_libdevice_now() -> Result<Libdevice, ToolkitError> {
    let file = find_libdevice()?;
    let current = std::env::var_os("CUDA_PATH").map(PathBuf::from);
    if let Some(cp) = &current
        && cp.join("nvvm/libdevice").join(LIBDEVICE).is_file()
    {
        return Ok(Libdevice {
            file,
            cuda_path: cp.clone(),
        });
    }
    let link_root = std::env::temp_dir().join(format!(
        "burn-ddp-libdevice-{}",
        // One folder per user; the link is rewritten when it points elsewhere.
        unsafe { libc::getuid() }
    ));
    let cuda_path = cuda_path_for(&file, &link_root)?;
    if let Some(cp) = &current {
        tracing::warn!(
            was = %cp.display(),
            now = %cuda_path.display(),
            "CUDA_PATH holds no nvvm/libdevice/libdevice.10.bc; replaced so that CUDA kernels find libdevice"
        );
    }
    // SAFETY: documented above — called before kernels compile, normally at start-up; the
    // only reader of CUDA_PATH is cubecl-llvm's kernel compiler.
    unsafe { std::env::set_var("CUDA_PATH", &cuda_path) };
    tracing::debug!(file = %file.display(), cuda_path = %cuda_path.display(), "libdevice found");
    Ok(Libdevice { file, cuda_path })
}

/// Every place `ptxas` is looked for, in order: `PATH`, each toolkit root's `bin`, then each
/// site-packages folder's `nvidia/cu13/bin` (nvidia-cuda-nvcc 13.x), `nvidia/cuda_nvcc/bin`
/// (12.x), `triton/backends/nvidia/bin`.
pub fn ptxas_candidates(sites: &[PathBuf]) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join("ptxas")).collect())
        .unwrap_or_default();
    files.extend(toolkit_roots().iter().map(|r| r.join("bin").join("ptxas")));
    for site in sites {
        for dir in [
            "nvidia/cu13/bin",
            "nvidia/cuda_nvcc/bin",
            "triton/backends/nvidia/bin",
        ] {
            files.push(site.join(dir).join("ptxas"));
        }
    }
    files
}

/// The first `ptxas` of [`ptxas_candidates`].
///
/// # Errors
/// [`ToolkitError::PtxasNotFound`] naming every path tried.
pub fn find_ptxas() -> Result<PathBuf, ToolkitError> {
    let tried = ptxas_candidates(site_packages());
    match tried.iter().find(|f| f.is_file()) {
        Some(f) => Ok(f.clone()),
        None => Err(ToolkitError::PtxasNotFound { tried }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wheel_layouts_are_candidates() {
        let site = PathBuf::from("/x/site-packages");
        let c = libdevice_candidates(std::slice::from_ref(&site));
        assert!(c.contains(&site.join("nvidia/cuda_nvcc/nvvm/libdevice/libdevice.10.bc")));
        assert!(c.contains(&site.join("triton/backends/nvidia/lib/libdevice.10.bc")));
        assert!(c.contains(&PathBuf::from(
            "/usr/local/cuda/nvvm/libdevice/libdevice.10.bc"
        )));
        let p = ptxas_candidates(std::slice::from_ref(&site));
        assert!(p.contains(&site.join("nvidia/cu13/bin/ptxas")));
    }

    #[test]
    fn a_file_in_the_toolkit_layout_needs_no_link() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("cuda_nvcc");
        let file = root.join("nvvm/libdevice").join(LIBDEVICE);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(&file, b"bc").unwrap();
        assert_eq!(
            cuda_path_for(&file, &dir.path().join("links")).unwrap(),
            root
        );
        assert!(!dir.path().join("links").exists());
    }

    #[test]
    fn a_file_elsewhere_is_linked_into_the_layout() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir
            .path()
            .join("triton/backends/nvidia/lib")
            .join(LIBDEVICE);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(&file, b"bc").unwrap();
        let links = dir.path().join("links");
        let cuda_path = cuda_path_for(&file, &links).unwrap();
        assert_eq!(cuda_path, links);
        let linked = links.join("nvvm/libdevice").join(LIBDEVICE);
        assert_eq!(std::fs::read(&linked).unwrap(), b"bc");
        // Idempotent, and a link to another file is replaced.
        assert_eq!(cuda_path_for(&file, &links).unwrap(), links);
        let other = dir.path().join(LIBDEVICE);
        std::fs::write(&other, b"other").unwrap();
        cuda_path_for(&other, &links).unwrap();
        assert_eq!(std::fs::read(&linked).unwrap(), b"other");
    }

    #[test]
    fn not_found_names_every_path_tried() {
        let e = ToolkitError::LibdeviceNotFound {
            tried: vec![
                PathBuf::from("/a/libdevice.10.bc"),
                PathBuf::from("/b/libdevice.10.bc"),
            ],
        };
        let msg = e.to_string();
        assert!(
            msg.contains("/a/libdevice.10.bc, /b/libdevice.10.bc"),
            "{msg}"
        );
        assert!(msg.contains("CUDA_PATH"), "{msg}");
    }
}
