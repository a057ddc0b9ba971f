//! The stand-in's record: one line per module loaded and per refused launch, appended to the
//! file named by `CUDA_STANDIN_LOG` (several processes may share it: each line is one
//! `write` of an `O_APPEND` file). `cargo xtask ptx-check` reads it.
//!
//! ```text
//! module  HASH  ok|failed  PTX-VERSION  TARGET  libdevice|-  PROGRAM  ENTRY,ENTRY,…
//! launch  ENTRY  ok|refused  REASON
//! ```
//! Fields are separated by tabs. A module that ptxas refuses is also written beside the record
//! as `HASH.ptx` with ptxas's message in `HASH.ptxas.txt`, to fix it or to report it upstream.

use std::io::Write;
use std::path::PathBuf;

/// The record file, when `CUDA_STANDIN_LOG` names one.
pub fn path() -> Option<PathBuf> {
    std::env::var_os("CUDA_STANDIN_LOG")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// Appends one line of `fields` (tab-separated; tabs and newlines inside a field become
/// spaces). A record that cannot be written is reported on stderr; the driver call goes on.
pub fn line(fields: &[&str]) {
    let Some(path) = path() else { return };
    let mut text = fields
        .iter()
        .map(|f| f.replace(['\t', '\n', '\r'], " "))
        .collect::<Vec<_>>()
        .join("\t");
    text.push('\n');
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(text.as_bytes()));
    if let Err(e) = written {
        eprintln!("cuda-standin: cannot append to {}: {e}", path.display());
    }
}

/// Keeps a refused module beside the record: `HASH.ptx` and `HASH.ptxas.txt`.
pub fn keep_failed(hash: &str, ptx: &str, message: &str) {
    let Some(dir) = path().and_then(|p| p.parent().map(PathBuf::from)) else {
        return;
    };
    let _ = std::fs::write(dir.join(format!("{hash}.ptx")), ptx);
    let _ = std::fs::write(dir.join(format!("{hash}.ptxas.txt")), message);
}

/// This process's program name (its executable's file name, cargo's hash suffix removed).
pub fn program() -> String {
    let exe = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "?".into());
    match exe.rsplit_once('-') {
        Some((name, hash)) if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) => {
            name.to_string()
        }
        _ => exe,
    }
}

/// The FNV-1a hash of `bytes`, as 16 hex digits (names a module across processes).
pub fn hash(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn hash_is_stable() {
        assert_eq!(super::hash(b""), "cbf29ce484222325");
        assert_ne!(super::hash(b"a"), super::hash(b"b"));
    }
}
