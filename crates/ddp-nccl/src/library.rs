//! Finding `libcuda` and `libnccl` before cudarc touches them.
//!
//! cudarc (feature `dynamic-loading`) opens its libraries on first use and **panics** when they
//! are missing. Every entry point of [this crate](crate) calls [`check_libraries`] first, so a
//! machine without CUDA or NCCL gets one clear [`CommError`] instead.
//!
//! # How cudarc 0.19 finds the libraries
//!
//! `cudarc::get_lib_name_candidates(name)` builds a fixed list of file names and `dlopen`s each
//! in turn, so the normal loader search applies (`LD_LIBRARY_PATH`, then the `ldconfig` cache,
//! then `/lib` and `/usr/lib`). For `cuda` the list contains `libcuda.so` and `libcuda.so.1`
//! (the driver's name). For `nccl` it contains `libnccl.so`, `libnccl.so.12`, `libnccl.so.11`,
//! … and `libnccl.so.1` — but **not `libnccl.so.2`**, the only name that runtime-only NCCL
//! installs provide (Debian's `libnccl2`, pip's `nvidia-nccl-cu12`/`-cu13` wheels, which put it in
//! `site-packages/nvidia/nccl/lib/`). Such a machine needs a link named `libnccl.so` in a
//! folder on `LD_LIBRARY_PATH`:
//!
//! ```text
//! NCCL_LIB=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))')
//! mkdir -p ~/.local/nccl-link && ln -sf "$NCCL_LIB/libnccl.so.2" ~/.local/nccl-link/libnccl.so
//! export LD_LIBRARY_PATH=~/.local/nccl-link:$NCCL_LIB:$LD_LIBRARY_PATH
//! ```
//!
//! [`check_libraries`] recognises that case and says so in its error.

use std::ffi::CString;
use std::io;
use std::path::PathBuf;
use std::sync::OnceLock;

use ddp_comm::error::{CommError, Result};

/// The oldest NCCL this transport drives: non-blocking communicators with `ncclConfig_t`
/// (`ncclCommInitRankConfig`, `ncclCommGetAsyncError` with `ncclInProgress`) arrived in 2.14.
pub const MIN_NCCL_VERSION: NcclVersion = NcclVersion {
    major: 2,
    minor: 14,
    patch: 0,
};

/// An NCCL library version, as `ncclGetVersion` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NcclVersion {
    /// Major version (2).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch level.
    pub patch: u32,
}

impl NcclVersion {
    /// Decodes `ncclGetVersion`'s integer: `major*10000 + minor*100 + patch` since 2.9,
    /// `major*1000 + minor*100 + patch` before.
    pub fn from_code(code: i32) -> Self {
        let code = code.max(0) as u32;
        if code >= 10000 {
            NcclVersion {
                major: code / 10000,
                minor: (code % 10000) / 100,
                patch: code % 100,
            }
        } else {
            NcclVersion {
                major: code / 1000,
                minor: (code % 1000) / 100,
                patch: code % 100,
            }
        }
    }

    /// The `NCCL_VERSION(major, minor, patch)` code of this version (new encoding).
    pub fn code(&self) -> u32 {
        self.major * 10000 + self.minor * 100 + self.patch
    }
}

impl std::fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// What [`check_libraries`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Libraries {
    /// The loaded NCCL's version.
    pub nccl_version: NcclVersion,
}

/// Checks that cudarc can load `libcuda` and `libnccl` and that NCCL is recent enough.
///
/// Safe to call on any machine: it never panics. The first result is cached for the life of the
/// process (the loader's search path cannot change after start-up anyway).
///
/// # Errors
/// [`CommError::Io`] with kind [`io::ErrorKind::NotFound`] when a library is missing — the
/// message starts with `libcuda not found` or `libnccl not found` and says how to fix it —
/// and [`CommError::InvalidArgument`] when NCCL is older than [`MIN_NCCL_VERSION`].
///
/// ```
/// match ddp_nccl::check_libraries() {
///     Ok(libs) => println!("NCCL {}", libs.nccl_version),
///     Err(e) => println!("no NCCL here: {e}"),
/// }
/// ```
pub fn check_libraries() -> Result<Libraries> {
    static CHECKED: OnceLock<std::result::Result<Libraries, (io::ErrorKind, String)>> =
        OnceLock::new();
    match CHECKED.get_or_init(probe) {
        Ok(libs) => Ok(libs.clone()),
        Err((io::ErrorKind::InvalidInput, msg)) => Err(CommError::InvalidArgument(msg.clone())),
        Err((kind, msg)) => Err(CommError::io(
            "loading the CUDA and NCCL libraries",
            None,
            io::Error::new(*kind, msg.clone()),
        )),
    }
}

/// Whether cudarc can load the CUDA driver library (`libcuda.so.1`).
pub fn cuda_present() -> bool {
    // SAFETY: only dlopen()s candidate names and closes them again.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether cudarc can load the NCCL library under one of the names it tries.
pub fn nccl_present() -> bool {
    // SAFETY: only dlopen()s candidate names and closes them again.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

fn probe() -> std::result::Result<Libraries, (io::ErrorKind, String)> {
    if !cuda_present() {
        return Err((io::ErrorKind::NotFound, missing_cuda_message()));
    }
    if !nccl_present() {
        return Err((io::ErrorKind::NotFound, missing_nccl_message()));
    }
    // SAFETY: the library is present (checked above), so cudarc's loader does not panic;
    // ncclGetVersion exists in every NCCL release.
    let code = unsafe { super::result::get_version() }.map_err(|e| {
        (
            io::ErrorKind::Other,
            format!(
                "libnccl was loaded but ncclGetVersion failed with {:?}",
                e.code
            ),
        )
    })?;
    let version = NcclVersion::from_code(code);
    if version < MIN_NCCL_VERSION {
        return Err((
            io::ErrorKind::InvalidInput,
            format!(
                "libnccl {version} is too old: the NCCL transport needs {MIN_NCCL_VERSION} or newer \
                 (non-blocking communicators); install a newer nvidia-nccl-cu12 or libnccl2"
            ),
        ));
    }
    tracing::debug!(%version, "NCCL library loaded");
    Ok(Libraries {
        nccl_version: version,
    })
}

fn candidates(name: &str) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for n in cudarc::get_lib_name_candidates(name) {
        if !names.contains(&n) {
            names.push(n);
        }
    }
    names
}

fn ld_library_path() -> String {
    std::env::var("LD_LIBRARY_PATH").unwrap_or_else(|_| "<unset>".into())
}

pub(crate) fn missing_cuda_message() -> String {
    format!(
        "libcuda not found: cudarc could not load the NVIDIA driver library under any of {:?}. \
         This machine has no NVIDIA driver, or its folder (often /usr/lib/x86_64-linux-gnu or \
         /usr/local/nvidia/lib64) is not on the loader path; add it to LD_LIBRARY_PATH \
         (currently {}).",
        candidates("cuda"),
        ld_library_path()
    )
}

fn missing_nccl_message() -> String {
    let names = candidates("nccl");
    match find_versioned_nccl() {
        Some(found) => format!(
            "libnccl not found under the names cudarc 0.19 loads ({names:?}), but {found} is \
             there: runtime-only NCCL installs (pip's nvidia-nccl-cu12, Debian's libnccl2) ship \
             only libnccl.so.2. Create a link named libnccl.so to it in a folder on \
             LD_LIBRARY_PATH, e.g. `mkdir -p /tmp/nccl-link && ln -sf <that file> \
             /tmp/nccl-link/libnccl.so && export LD_LIBRARY_PATH=/tmp/nccl-link:$LD_LIBRARY_PATH` \
             (`cargo xtask gpu-check run` does this). LD_LIBRARY_PATH is currently {}.",
            ld_library_path()
        ),
        None => format!(
            "libnccl not found (install nvidia-nccl-cu12 or set LD_LIBRARY_PATH): cudarc looked \
             for {names:?} on the loader path. With pip's nvidia-nccl-cu12 the library is \
             site-packages/nvidia/nccl/lib/libnccl.so.2 — add that folder to LD_LIBRARY_PATH and \
             link libnccl.so to libnccl.so.2 there (see docs/gpu.md). LD_LIBRARY_PATH is \
             currently {}.",
            ld_library_path()
        ),
    }
}

/// Looks for `libnccl.so.2`, the runtime name cudarc does not try: first in the folders of
/// `LD_LIBRARY_PATH` (to name the file), then through the loader (ldconfig cache).
fn find_versioned_nccl() -> Option<String> {
    find_versioned_nccl_in(std::env::var("LD_LIBRARY_PATH").ok().as_deref())
}

fn find_versioned_nccl_in(ld_library_path: Option<&str>) -> Option<String> {
    const SONAME: &str = "libnccl.so.2";
    if let Some(path) = ld_library_path {
        for dir in path.split(':').filter(|d| !d.is_empty()) {
            let file = PathBuf::from(dir).join(SONAME);
            if file.exists() {
                return Some(file.display().to_string());
            }
        }
    }
    if dlopen_ok(SONAME) {
        return Some(format!("{SONAME} (found by the system loader)"));
    }
    None
}

fn dlopen_ok(name: &str) -> bool {
    let Ok(c) = CString::new(name) else {
        return false;
    };
    // SAFETY: dlopen with a valid C string; RTLD_LAZY|RTLD_LOCAL does not export symbols; the
    // handle is closed right away. Loading libnccl runs no user-visible initialisers.
    unsafe {
        let handle = libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            // Clear the error state dlerror() would report later.
            let _ = libc::dlerror();
            false
        } else {
            libc::dlclose(handle);
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_decode_both_encodings() {
        assert_eq!(
            NcclVersion::from_code(22703),
            NcclVersion {
                major: 2,
                minor: 27,
                patch: 3
            }
        );
        assert_eq!(
            NcclVersion::from_code(2804),
            NcclVersion {
                major: 2,
                minor: 8,
                patch: 4
            }
        );
        assert_eq!(NcclVersion::from_code(21400), MIN_NCCL_VERSION);
        assert_eq!(MIN_NCCL_VERSION.code(), 21400);
        assert!(NcclVersion::from_code(21307) < MIN_NCCL_VERSION);
        assert_eq!(NcclVersion::from_code(23000).to_string(), "2.30.0");
    }

    #[test]
    fn check_agrees_with_what_cudarc_can_load() {
        match check_libraries() {
            Ok(libs) => {
                assert!(cuda_present() && nccl_present());
                assert!(libs.nccl_version >= MIN_NCCL_VERSION);
            }
            Err(e) => {
                let msg = e.to_string();
                if !cuda_present() {
                    assert!(msg.contains("libcuda not found"), "{msg}");
                } else if !nccl_present() {
                    assert!(msg.contains("libnccl not found"), "{msg}");
                } else {
                    assert!(msg.contains("too old"), "{msg}");
                }
            }
        }
    }

    #[test]
    fn nccl_candidates_are_what_the_docs_say() {
        let names = candidates("nccl");
        assert!(names.iter().any(|n| n == "libnccl.so"), "{names:?}");
        // The documented gap: the runtime soname is not among them. If a cudarc update adds
        // it, the link step in docs/gpu.md and in `cargo xtask gpu-check` can go.
        assert!(!names.iter().any(|n| n == "libnccl.so.2"), "{names:?}");
        assert!(candidates("cuda").iter().any(|n| n == "libcuda.so.1"));
    }

    #[test]
    fn a_libnccl_so_2_on_the_library_path_is_named() {
        let dir = std::env::temp_dir().join(format!("ddp-nccl-lib-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("libnccl.so.2");
        std::fs::write(&file, b"").unwrap();
        let path = format!("/nonexistent-ddp-dir::{}", dir.display());
        assert_eq!(
            find_versioned_nccl_in(Some(&path)),
            Some(file.display().to_string())
        );
        std::fs::remove_dir_all(&dir).unwrap();
        // Not on the path and not known to the loader here (no NCCL on CI machines).
        if !dlopen_ok("libnccl.so.2") {
            assert_eq!(find_versioned_nccl_in(Some(&path)), None);
            assert_eq!(find_versioned_nccl_in(None), None);
            assert!(
                missing_nccl_message().starts_with("libnccl not found (install nvidia-nccl-cu12")
            );
        }
    }

    #[test]
    fn candidate_lists_have_no_duplicates() {
        let names = candidates("cuda");
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len(), "{names:?}");
    }

    #[test]
    fn dlopen_of_a_missing_library_is_false() {
        assert!(!dlopen_ok("libddp-comm-no-such-library.so.7"));
        assert!(!dlopen_ok("nul\0inside"));
    }
}
