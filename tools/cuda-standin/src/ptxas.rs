//! Assembling a PTX module with NVIDIA's `ptxas`, as the driver's JIT does at
//! `cuModuleLoadData`, and reading the resources of its kernels from `ptxas -v`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What ptxas reported for one entry function.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resources {
    /// Registers per thread.
    pub registers: u32,
    /// Static shared memory in bytes.
    pub shared_bytes: u32,
}

/// The outcome of assembling one module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Assembled {
    /// ptxas accepted it: every entry function with its resources.
    Ok(BTreeMap<String, Resources>),
    /// ptxas refused it (or could not run): why, with ptxas's own words.
    Failed(String),
}

/// The `ptxas` the stand-in runs: `CUDA_STANDIN_PTXAS`, else `ptxas` on `PATH`.
pub fn ptxas_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CUDA_STANDIN_PTXAS").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join("ptxas"))
            .find(|p| p.is_file())
    })
}

/// Assembles `ptx` for `arch` with `ptxas` in the scratch folder `scratch` (created; the files
/// are removed afterwards).
pub fn assemble(ptxas: &Path, ptx: &str, arch: &str, scratch: &Path, tag: &str) -> Assembled {
    if let Err(e) = std::fs::create_dir_all(scratch) {
        return Assembled::Failed(format!("cannot create {}: {e}", scratch.display()));
    }
    let input = scratch.join(format!("{tag}.ptx"));
    let output = scratch.join(format!("{tag}.cubin"));
    if let Err(e) = std::fs::write(&input, ptx) {
        return Assembled::Failed(format!("cannot write {}: {e}", input.display()));
    }
    let run = Command::new(ptxas)
        .arg(format!("-arch={arch}"))
        .arg("-v")
        .arg("-o")
        .arg(&output)
        .arg(&input)
        .output();
    let _ = std::fs::remove_file(&input);
    let _ = std::fs::remove_file(&output);
    match run {
        Err(e) => Assembled::Failed(format!("cannot run {}: {e}", ptxas.display())),
        Ok(out) => {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            if out.status.success() {
                Assembled::Ok(parse_verbose(&text))
            } else {
                Assembled::Failed(format!("ptxas {}: {}", out.status, text.trim()))
            }
        }
    }
}

/// Reads the entry functions and their registers and static shared memory from `ptxas -v`:
///
/// ```text
/// ptxas info    : Compiling entry function 'kernel' for 'sm_90a'
/// ptxas info    : Function properties for kernel
///     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 8 registers, used 1 barriers, 3072 bytes smem, 380 bytes cmem[0]
/// ```
pub fn parse_verbose(text: &str) -> BTreeMap<String, Resources> {
    let mut found = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            found.insert(name.clone(), Resources::default());
            current = Some(name);
        } else if let Some(rest) = line.split("Used ").nth(1)
            && let Some(name) = &current
        {
            let r = found.entry(name.clone()).or_default();
            for part in rest.split(',') {
                let mut words = part.split_whitespace();
                let (Some(n), Some(unit)) = (words.next(), words.next()) else {
                    continue;
                };
                let Ok(n) = n.parse::<u32>() else { continue };
                match (unit, words.next()) {
                    ("registers", _) => r.registers = n,
                    ("bytes", Some("smem")) => r.shared_bytes = n,
                    _ => {}
                }
            }
        }
    }
    found
}

/// The `.version` and `.target` lines of a PTX module (`"?"` when absent).
pub fn version_and_target(ptx: &str) -> (String, String) {
    let field = |key: &str| {
        ptx.lines()
            .find_map(|l| l.trim().strip_prefix(key))
            .map_or_else(|| "?".to_string(), |v| v.trim().to_string())
    };
    (field(".version"), field(".target"))
}

/// Why a driver that loads PTX up to `max` refuses a module of PTX version `version` (`"9.5"`),
/// or `None` when it takes it (an unreadable version is left to ptxas).
pub fn too_new(version: &str, max: (u32, u32)) -> Option<String> {
    let mut parts = version.split('.');
    let v: (u32, u32) = (parts.next()?.parse().ok()?, parts.next()?.parse().ok()?);
    (v > max).then(|| {
        format!(
            "PTX version {version} is newer than the driver loads ({}.{}): \
             CUDA_ERROR_UNSUPPORTED_PTX_VERSION on the device (a compiler newer than the driver)",
            max.0, max.1
        )
    })
}

/// Whether the module carries functions linked from libdevice (`__nv_expf`, `__nv_logf`, …).
pub fn links_libdevice(ptx: &str) -> bool {
    ptx.lines()
        .any(|l| l.contains(".func") && l.contains("__nv_"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ptx_version_newer_than_the_driver_is_refused() {
        assert!(too_new("9.0", (9, 0)).is_none());
        assert!(too_new("8.7", (9, 0)).is_none());
        assert!(
            too_new("9.5", (9, 0))
                .unwrap()
                .contains("newer than the driver")
        );
        assert!(too_new("?", (9, 0)).is_none());
    }

    #[test]
    fn verbose_output_is_read_per_entry() {
        let text = "ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'a' for 'sm_90a'\n\
            ptxas info    : Function properties for a\n\
            \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
            ptxas info    : Used 8 registers, used 1 barriers, 3072 bytes smem, 380 bytes cmem[0]\n\
            ptxas info    : Compiling entry function 'b' for 'sm_90a'\n\
            ptxas info    : Function properties for b\n\
            ptxas info    : Used 40 registers, 360 bytes cmem[0]\n";
        let r = parse_verbose(text);
        assert_eq!(
            r["a"],
            Resources {
                registers: 8,
                shared_bytes: 3072
            }
        );
        assert_eq!(
            r["b"],
            Resources {
                registers: 40,
                shared_bytes: 0
            }
        );
        assert_eq!(r.len(), 2);
    }

    #[test]
    fn header_lines_are_read() {
        let ptx = "//\n// Generated by LLVM NVPTX Back-End\n.version 9.0\n.target sm_90a\n";
        assert_eq!(
            version_and_target(ptx),
            ("9.0".to_string(), "sm_90a".to_string())
        );
        assert!(!links_libdevice(ptx));
        assert!(links_libdevice(".func  (.param .b32 r) __nv_expf(\n"));
    }
}
