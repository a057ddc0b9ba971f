//! `cargo xtask setup-cuda-build`: lets Burn's CUDA backend build against a system LLVM
//! instead of the LLVM bundle its build script downloads.
//!
//! cubecl-cuda compiles kernels through cubecl-llvm, whose build script (tracel-llvm-bundler)
//! downloads an LLVM bundle into `$XDG_DATA_HOME/tracel/tracel-llvm-<version>` (default
//! `~/.local/share/…`) unless the file `.tracel-llvm-installed` exists there, and then runs that
//! folder's `bin/llvm-config --link-static`. On a machine without internet (CI) this command
//! makes that folder point at an installed LLVM (`apt-get install llvm-22-dev libpolly-22-dev
//! libzstd-dev` on Debian), so the bundler finds it and downloads nothing:
//!
//! - `bin`, `lib`, `include`, `share` link to the system LLVM's folders, and the sentinel file
//!   is created;
//! - `llvm-config --system-libs` may name a library by its path (`/usr/lib/…/libz3.so`), which
//!   the bundler turns into `-llibz3`; a link `liblibz3.so` in LLVM's library folder satisfies
//!   that name.
//!
//! Idempotent: a folder already set up (by this command or by a real download) is left alone.
//! Users with internet need none of this.

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Args;

/// The LLVM major versions tried, newest first, when no `--llvm` is given.
const LLVM_MAJORS: [u32; 3] = [23, 22, 21];
/// The file whose presence tells the bundler the folder is installed.
const SENTINEL: &str = ".tracel-llvm-installed";
/// The folders of an LLVM installation the bundler reads.
const LINKED_DIRS: [&str; 4] = ["bin", "lib", "include", "share"];

/// Options of `cargo xtask setup-cuda-build`.
#[derive(Debug, Args)]
pub struct SetupArgs {
    /// The installed LLVM's prefix (the folder holding `bin/llvm-config`) [default: the newest
    /// of /usr/lib/llvm-23, -22, -21].
    #[arg(long, value_name = "DIR")]
    pub llvm: Option<PathBuf>,
    /// Only report whether the build is set up; change nothing.
    #[arg(long)]
    pub check: bool,
}

/// Runs `cargo xtask setup-cuda-build`.
pub fn setup(root: &Path, a: &SetupArgs) -> Result<(), String> {
    let version = bundler_version(root)?;
    let folder = bundle_folder(&version)?;
    setup_folder(&folder, a.llvm.as_deref(), a.check)
}

/// `Ok` when the bundler's folder is set up (linked here or downloaded), else why not.
pub fn check(root: &Path) -> Result<(), String> {
    let folder = bundle_folder(&bundler_version(root)?)?;
    if folder.join(SENTINEL).exists() {
        Ok(())
    } else {
        Err(format!("{} is not set up", folder.display()))
    }
}

/// Sets up `folder` (the bundler's) to use the LLVM at `llvm` (default: [`find_llvm`]).
fn setup_folder(folder: &Path, llvm: Option<&Path>, check: bool) -> Result<(), String> {
    let sentinel = folder.join(SENTINEL);
    if sentinel.exists() {
        let how = match std::fs::read_link(folder.join("bin")) {
            Ok(target) => format!("links to {}", target.display()),
            Err(_) => "a downloaded bundle".to_string(),
        };
        println!(
            "setup-cuda-build: {} is set up ({how}); Burn's CUDA backend builds without a download",
            folder.display()
        );
        return Ok(());
    }
    let prefix = match llvm {
        Some(p) => p.to_path_buf(),
        None => find_llvm()?,
    };
    let llvm_config = prefix.join("bin").join("llvm-config");
    if !llvm_config.is_file() {
        return Err(format!(
            "{} not found: --llvm must be an LLVM prefix (the folder holding bin/llvm-config)",
            llvm_config.display()
        ));
    }
    if check {
        return Err(format!(
            "{} is not set up: `cargo xtask setup-cuda-build` would link it to {}",
            folder.display(),
            prefix.display()
        ));
    }
    std::fs::create_dir_all(folder)
        .map_err(|e| format!("cannot create {}: {e}", folder.display()))?;
    for d in LINKED_DIRS {
        let link = folder.join(d);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(prefix.join(d), &link)
            .map_err(|e| format!("cannot link {} -> {}: {e}", link.display(), d))?;
    }
    let libdir = llvm_config_output(&llvm_config, &["--libdir"])?;
    let system_libs = llvm_config_output(&llvm_config, &["--link-static", "--system-libs"])?;
    for lib in libs_named_by_path(&system_libs) {
        link_library_by_path(Path::new(libdir.trim()), &lib)?;
    }
    std::fs::write(&sentinel, b"")
        .map_err(|e| format!("cannot write {}: {e}", sentinel.display()))?;
    println!(
        "setup-cuda-build: {} now links to LLVM at {} (version {}); Burn's CUDA backend builds \
         with it (`cargo build -p train-cnn --features cuda`). Remove the folder to go back to \
         the bundler's download.",
        folder.display(),
        prefix.display(),
        llvm_config_output(&llvm_config, &["--version"])?.trim()
    );
    Ok(())
}

/// The version of the LLVM Burn's CUDA backend is built with (`llvm-config --version` in the
/// bundler's folder), when the folder is set up.
pub fn llvm_version(root: &Path) -> Option<String> {
    let folder = bundle_folder(&bundler_version(root).ok()?).ok()?;
    llvm_config_output(&folder.join("bin").join("llvm-config"), &["--version"])
        .ok()
        .map(|v| v.trim().to_string())
}

/// The tracel-llvm-bundler version in Cargo.lock, e.g. `23.1.0-4`.
fn bundler_version(root: &Path) -> Result<String, String> {
    let lock = std::fs::read_to_string(root.join("Cargo.lock"))
        .map_err(|e| format!("cannot read Cargo.lock: {e}"))?;
    lock_version(&lock, "tracel-llvm-bundler")
        .ok_or_else(|| "Cargo.lock has no tracel-llvm-bundler package".to_string())
}

/// The version of package `name` in the text of a Cargo.lock.
fn lock_version(lock: &str, name: &str) -> Option<String> {
    let needle = format!("name = \"{name}\"\n");
    let at = lock.find(&needle)? + needle.len();
    let line = lock[at..].lines().next()?;
    let v = line.strip_prefix("version = \"")?.strip_suffix('"')?;
    Some(v.to_string())
}

/// Where the bundler looks: `$XDG_DATA_HOME` or `~/.local/share`, then
/// `tracel/tracel-llvm-<version>`.
fn bundle_folder(version: &str) -> Result<PathBuf, String> {
    let data = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .ok_or("neither XDG_DATA_HOME nor HOME is set")?;
    Ok(data.join("tracel").join(format!("tracel-llvm-{version}")))
}

fn find_llvm() -> Result<PathBuf, String> {
    LLVM_MAJORS
        .iter()
        .map(|m| PathBuf::from(format!("/usr/lib/llvm-{m}")))
        .find(|p| p.join("bin/llvm-config").is_file())
        .ok_or_else(|| {
            "no LLVM found in /usr/lib/llvm-{23,22,21}. Install one (Debian/Ubuntu: \
             `apt-get install llvm-22-dev libpolly-22-dev libzstd-dev`) or pass --llvm DIR; \
             with internet access, skip this command: the build downloads its own LLVM"
                .to_string()
        })
}

fn llvm_config_output(llvm_config: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(llvm_config)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", llvm_config.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} {} failed: {}",
            llvm_config.display(),
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The libraries `llvm-config --system-libs` names by an absolute path to a `lib*.so` file.
fn libs_named_by_path(system_libs: &str) -> Vec<PathBuf> {
    system_libs
        .split_whitespace()
        .filter(|t| t.starts_with('/'))
        .map(PathBuf::from)
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("lib"))
        })
        .collect()
}

/// Makes `lib<stem>.so` in `libdir` point at `lib` (the bundler links `-l<stem>` for a path
/// whose file stem is `<stem>`, e.g. `-llibz3` for `libz3.so`).
fn link_library_by_path(libdir: &Path, lib: &Path) -> Result<(), String> {
    let stem = lib
        .file_stem()
        .ok_or_else(|| format!("odd library path {}", lib.display()))?
        .to_string_lossy();
    let link = libdir.join(format!("lib{stem}.so"));
    if std::fs::read_link(&link).is_ok_and(|t| t == lib) {
        return Ok(());
    }
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(lib, &link).map_err(|e| {
        format!(
            "cannot create {} -> {} ({e}); the bundler links it as -l{stem}. Run this command \
             as root, or create the link by hand",
            link.display(),
            lib.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_versions_are_read_by_package_name() {
        let lock = "[[package]]\nname = \"tracel-llvm\"\nversion = \"1.0.0\"\n\n[[package]]\n\
                    name = \"tracel-llvm-bundler\"\nversion = \"23.1.0-4\"\nsource = \"x\"\n";
        assert_eq!(
            lock_version(lock, "tracel-llvm-bundler").as_deref(),
            Some("23.1.0-4")
        );
        assert_eq!(lock_version(lock, "tracel-llvm").as_deref(), Some("1.0.0"));
        assert_eq!(lock_version(lock, "other"), None);
    }

    #[test]
    fn only_libraries_named_by_path_need_a_link() {
        let libs = "-lrt -ldl -lm /usr/lib/x86_64-linux-gnu/libz3.so -lz -lzstd -lxml2";
        assert_eq!(
            libs_named_by_path(libs),
            vec![PathBuf::from("/usr/lib/x86_64-linux-gnu/libz3.so")]
        );
    }

    #[test]
    fn a_library_link_is_made_once() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("libz3.so");
        std::fs::write(&lib, b"").unwrap();
        link_library_by_path(dir.path(), &lib).unwrap();
        link_library_by_path(dir.path(), &lib).unwrap();
        assert_eq!(
            std::fs::read_link(dir.path().join("liblibz3.so")).unwrap(),
            lib
        );
    }

    /// A stand-in LLVM prefix whose `llvm-config` answers like Debian's LLVM 22.
    fn fake_llvm(dir: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let prefix = dir.join("llvm");
        for d in LINKED_DIRS {
            std::fs::create_dir_all(prefix.join(d)).unwrap();
        }
        let z3 = dir.join("libz3.so");
        std::fs::write(&z3, b"").unwrap();
        let script = format!(
            "#!/bin/sh\ncase \"$*\" in\n  --libdir) echo {lib};;\n  --version) echo 22.1.0;;\n  \
             *system-libs*) echo -lrt {z3} -lz;;\nesac\n",
            lib = prefix.join("lib").display(),
            z3 = z3.display()
        );
        let config = prefix.join("bin/llvm-config");
        std::fs::write(&config, script).unwrap();
        std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o755)).unwrap();
        prefix
    }

    #[test]
    fn setup_links_the_folders_once_and_check_reports_it() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = fake_llvm(dir.path());
        let folder = dir.path().join("tracel/tracel-llvm-23.1.0-4");
        let err = setup_folder(&folder, Some(&prefix), true).unwrap_err();
        assert!(err.contains("is not set up"), "{err}");
        setup_folder(&folder, Some(&prefix), false).unwrap();
        for d in LINKED_DIRS {
            assert_eq!(std::fs::read_link(folder.join(d)).unwrap(), prefix.join(d));
        }
        assert!(folder.join(SENTINEL).exists());
        assert_eq!(
            std::fs::read_link(prefix.join("lib/liblibz3.so")).unwrap(),
            dir.path().join("libz3.so")
        );
        // Idempotent, and --check now passes.
        setup_folder(&folder, Some(&prefix), false).unwrap();
        setup_folder(&folder, Some(&prefix), true).unwrap();
    }

    #[test]
    fn a_prefix_without_llvm_config_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = setup_folder(&dir.path().join("b"), Some(dir.path()), false).unwrap_err();
        assert!(err.contains("bin/llvm-config not found"), "{err}");
    }
}
