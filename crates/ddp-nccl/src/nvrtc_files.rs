//! What cubecl-cuda's second compiler — its `cpp` backend, CUDA C++ through NVIDIA's runtime
//! compiler NVRTC, burn-ddp's `cuda-nvrtc` feature — needs at run time, found without a CUDA
//! toolkit install: **`libnvrtc`** and the **CUDA headers** its kernels include (`cuda_fp16.h`,
//! `cuda_bf16.h`, `mma.h`).
//!
//! cudarc (0.19, built for CUDA 12.8) opens NVRTC as `libnvrtc.so`, `libnvrtc.so.12`, … `.1`
//! through plain `dlopen`; pip's `nvidia-cuda-nvrtc` 13.x (a PyTorch cu13 dependency) installs
//! `nvidia/cu13/lib/libnvrtc.so.13`, a name it never tries. And `libnvrtc.so.13` finds its
//! `libnvrtc-builtins.so.13.X` beside itself (`$ORIGIN`), so a link to it elsewhere needs a link
//! to the builtins beside it too. [`link_nvrtc`] makes both links in one folder, which must then
//! be on `LD_LIBRARY_PATH` **when the process starts** (the loader reads it once):
//!
//! ```sh
//! LIB=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))')
//! mkdir -p ~/.local/nvrtc-link && ln -sf "$LIB"/libnvrtc.so.13 ~/.local/nvrtc-link/libnvrtc.so
//! ln -sf "$LIB"/libnvrtc-builtins.so.13.* ~/.local/nvrtc-link/
//! export LD_LIBRARY_PATH=~/.local/nvrtc-link${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
//! ```
//!
//! cubecl-cuda passes `--include-path=$CUDA_PATH/include`; pip's `nvidia-cuda-runtime` wheel
//! carries the headers in `nvidia/cu13/include`. The PTX NVRTC emits has NVRTC's PTX version,
//! not the driver's: an NVRTC newer than the driver's CUDA version makes PTX the driver refuses
//! ([`ptx_too_new_for`]).

use std::path::{Path, PathBuf};

use crate::cuda_toolkit::{ToolkitError, site_packages, toolkit_roots};

/// A header every cubecl-cpp kernel with f16 values includes: a folder holding it is a header
/// folder.
pub const PROBE_HEADER: &str = "cuda_fp16.h";

/// The file names of NVRTC, newest first.
const NVRTC_NAMES: [&str; 2] = ["libnvrtc.so.13", "libnvrtc.so.12"];

/// Every NVRTC library looked for, in order: each toolkit root's `lib64`, then each
/// site-packages folder's `nvidia/cu13/lib` (nvidia-cuda-nvrtc 13.x) and
/// `nvidia/cuda_nvrtc/lib` (12.x).
pub fn nvrtc_candidates(sites: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = toolkit_roots().iter().map(|r| r.join("lib64")).collect();
    for site in sites {
        dirs.push(site.join("nvidia/cu13/lib"));
        dirs.push(site.join("nvidia/cuda_nvrtc/lib"));
    }
    dirs.iter()
        .flat_map(|d| NVRTC_NAMES.map(|n| d.join(n)))
        .collect()
}

/// The first NVRTC library of [`nvrtc_candidates`].
///
/// # Errors
/// [`ToolkitError::NvrtcNotFound`] naming every path tried.
pub fn find_nvrtc() -> Result<PathBuf, ToolkitError> {
    let tried = nvrtc_candidates(site_packages());
    match tried.iter().find(|f| f.is_file()) {
        Some(f) => Ok(f.clone()),
        None => Err(ToolkitError::NvrtcNotFound { tried }),
    }
}

/// The `libnvrtc-builtins.so.M.m` beside `nvrtc` (the one it loads), if any.
pub fn builtins_beside(nvrtc: &Path) -> Option<PathBuf> {
    let dir = nvrtc.parent()?;
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc-builtins.so.") && !n.contains(".alt."))
        })
        .collect();
    found.sort();
    found.pop()
}

/// NVRTC's version `(major, minor)` read from its builtins' file name
/// (`libnvrtc-builtins.so.13.0` → 13.0).
pub fn version_of_builtins(builtins: &Path) -> Option<(u32, u32)> {
    let name = builtins.file_name()?.to_str()?;
    let rest = name.strip_prefix("libnvrtc-builtins.so.")?;
    let mut parts = rest.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Whether an NVRTC of `nvrtc` version emits PTX newer than a driver of CUDA version `driver`
/// accepts: the PTX version follows the compiler's (NVRTC 13.0 writes PTX 9.0, 13.5 writes
/// 9.5), and a driver loads PTX up to its own CUDA version's.
pub fn ptx_too_new_for(nvrtc: (u32, u32), driver: (u32, u32)) -> bool {
    nvrtc > driver
}

/// Links `dir/libnvrtc.so` to `nvrtc` and, when there is one, `dir/libnvrtc-builtins.so.M.m` to
/// the builtins beside it, so that cudarc finds NVRTC with `dir` on `LD_LIBRARY_PATH`.
///
/// # Errors
/// [`ToolkitError::Link`] when the folder or a link cannot be made.
pub fn link_nvrtc(nvrtc: &Path, dir: &Path) -> Result<(), ToolkitError> {
    let err = |file: &Path, source| ToolkitError::Link {
        file: file.to_path_buf(),
        dir: dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(|e| err(nvrtc, e))?;
    let mut links = vec![(nvrtc.to_path_buf(), dir.join("libnvrtc.so"))];
    if let Some(b) = builtins_beside(nvrtc) {
        let name = b.file_name().map(PathBuf::from).unwrap_or_default();
        links.push((b, dir.join(name)));
    }
    for (target, link) in links {
        let real = std::fs::canonicalize(&target).map_err(|e| err(&target, e))?;
        match std::fs::remove_file(&link) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(&target, e)),
        }
        std::os::unix::fs::symlink(&real, &link).map_err(|e| err(&target, e))?;
    }
    Ok(())
}

/// Every header folder looked for, in order: each toolkit root's `include`, then each
/// site-packages folder's `nvidia/cu13/include` (nvidia-cuda-runtime 13.x) and
/// `nvidia/cuda_runtime/include` (12.x).
pub fn header_candidates(sites: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = toolkit_roots().iter().map(|r| r.join("include")).collect();
    for site in sites {
        dirs.push(site.join("nvidia/cu13/include"));
        dirs.push(site.join("nvidia/cuda_runtime/include"));
    }
    dirs
}

/// The first folder of [`header_candidates`] holding [`PROBE_HEADER`].
///
/// # Errors
/// [`ToolkitError::HeadersNotFound`] naming every folder tried.
pub fn find_headers() -> Result<PathBuf, ToolkitError> {
    let tried = header_candidates(site_packages());
    match tried.iter().find(|d| d.join(PROBE_HEADER).is_file()) {
        Some(d) => Ok(d.clone()),
        None => Err(ToolkitError::HeadersNotFound { tried }),
    }
}

/// Makes `cuda_path/include` the header folder `headers` unless it already holds the headers
/// (a toolkit, or a wheel's `nvidia/cu13`); `cuda_path` is then what `CUDA_PATH` should be.
///
/// # Errors
/// [`ToolkitError::Link`] when the link cannot be made (e.g. `cuda_path/include` is a folder
/// without the headers).
pub fn link_headers(cuda_path: &Path, headers: &Path) -> Result<(), ToolkitError> {
    let include = cuda_path.join("include");
    if include.join(PROBE_HEADER).is_file() {
        return Ok(());
    }
    let err = |source| ToolkitError::Link {
        file: headers.to_path_buf(),
        dir: cuda_path.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(cuda_path).map_err(err)?;
    match std::fs::symlink_metadata(&include) {
        Ok(m) if m.file_type().is_symlink() => std::fs::remove_file(&include).map_err(err)?,
        Ok(_) => {
            return Err(err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists without {PROBE_HEADER}", include.display()),
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    std::os::unix::fs::symlink(headers, &include).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wheel_layouts_are_candidates() {
        let site = PathBuf::from("/x/site-packages");
        let c = nvrtc_candidates(std::slice::from_ref(&site));
        assert!(c.contains(&site.join("nvidia/cu13/lib/libnvrtc.so.13")));
        assert!(c.contains(&site.join("nvidia/cuda_nvrtc/lib/libnvrtc.so.12")));
        let h = header_candidates(std::slice::from_ref(&site));
        assert!(h.contains(&site.join("nvidia/cu13/include")));
    }

    #[test]
    fn nvrtc_and_its_builtins_are_linked_side_by_side() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("wheel/nvidia/cu13/lib");
        std::fs::create_dir_all(&lib).unwrap();
        for f in [
            "libnvrtc.so.13",
            "libnvrtc-builtins.so.13.0",
            "libnvrtc-builtins.alt.so.13.0",
        ] {
            std::fs::write(lib.join(f), b"").unwrap();
        }
        let nvrtc = lib.join("libnvrtc.so.13");
        let b = builtins_beside(&nvrtc).unwrap();
        assert_eq!(b.file_name().unwrap(), "libnvrtc-builtins.so.13.0");
        assert_eq!(version_of_builtins(&b), Some((13, 0)));
        let links = dir.path().join("links");
        link_nvrtc(&nvrtc, &links).unwrap();
        link_nvrtc(&nvrtc, &links).unwrap(); // again: the links are replaced
        let real = |p: &Path| std::fs::canonicalize(p).unwrap();
        assert_eq!(real(&links.join("libnvrtc.so")), real(&nvrtc));
        assert_eq!(real(&links.join("libnvrtc-builtins.so.13.0")), real(&b));
    }

    #[test]
    fn newer_nvrtc_than_driver_is_refused_ptx() {
        assert!(ptx_too_new_for((13, 5), (13, 0)));
        assert!(!ptx_too_new_for((13, 0), (13, 0)));
        assert!(!ptx_too_new_for((12, 8), (13, 0)));
        assert_eq!(
            version_of_builtins(Path::new("libnvrtc-builtins.so.12.8")),
            Some((12, 8))
        );
        assert_eq!(version_of_builtins(Path::new("libnvrtc.so.13")), None);
    }

    #[test]
    fn headers_are_linked_into_a_cuda_path_that_lacks_them() {
        let dir = tempfile::tempdir().unwrap();
        let headers = dir.path().join("wheel/include");
        std::fs::create_dir_all(&headers).unwrap();
        std::fs::write(headers.join(PROBE_HEADER), b"").unwrap();
        let root = dir.path().join("cuda");
        link_headers(&root, &headers).unwrap();
        assert!(root.join("include").join(PROBE_HEADER).is_file());
        link_headers(&root, &headers).unwrap(); // already there: nothing to do
        // A real folder without the headers is not replaced.
        let other = dir.path().join("other");
        std::fs::create_dir_all(other.join("include")).unwrap();
        let e = link_headers(&other, &headers).unwrap_err();
        assert!(e.to_string().contains("without cuda_fp16.h"), "{e}");
    }
}
