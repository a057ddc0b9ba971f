//! `gpu-check build`: the CUDA binaries CI links and the programs the rows run, stripped and
//! packed into `OUT/bins.tar.xz`, with this xtask (release, stripped) beside it uncompressed
//! so that it runs on the GPU machine, which has no cargo.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use clap::Args;

use super::GpuCheckError;
use super::bundle::{self, Entry};

// ------------------------------------------------------------------------------------------
// What `build` builds: every cargo command and the executables taken from its output. Package
// and binary names live here alone.
// ------------------------------------------------------------------------------------------

/// One executable taken out of a cargo command's JSON messages.
#[derive(Debug, Clone, Copy)]
pub struct Pick {
    /// The cargo target's name.
    pub target: &'static str,
    /// The target kind: `bin` and `example` take the program, any other (`lib`, `test`) the
    /// target's test harness.
    pub kind: &'static str,
    /// The file name in the bundle (what the rows run).
    pub file: &'static str,
}

/// One cargo command of the build.
#[derive(Debug, Clone, Copy)]
pub struct CargoBuild {
    /// What it builds, for the log.
    pub what: &'static str,
    /// `cargo` arguments (without `--message-format`), in parts that are concatenated.
    pub args: &'static [&'static [&'static str]],
    /// The executables it provides.
    pub picks: &'static [Pick],
}

/// CI's build, limited to the CUDA targets (the same features and packages as `cargo xtask
/// ci`'s build step, so after CI it links nothing new).
pub use cargo_tasks::CUDA_BUILD_ARGS;

/// The cargo commands and their executables, in build order.
pub const CARGO_BUILDS: &[CargoBuild] = &[
    CargoBuild {
        what: "CI's build (dev profile), its CUDA targets: CubeCL on CUDA, NCCL on device memory, train-cnn",
        args: CUDA_BUILD_ARGS,
        picks: &[
            pick("burn_ddp", "lib", "burn-ddp-tests"),
            pick("sync_batch_norm", "test", "sync_batch_norm-tests"),
            pick("ddp", "test", "ddp-tests"),
            pick("ddp_worker", "bin", "ddp_worker"),
            pick("syncbn_worker", "bin", "syncbn_worker"),
            pick("train-cnn", "bin", "train-cnn"),
            pick("nccl", "test", "ddp-nccl-tests"),
        ],
    },
    CargoBuild {
        what: "release: ddprun and the all-reduce benchmark",
        args: &[&[
            "build",
            "--release",
            "-p",
            "ddprun",
            "-p",
            "ddp-bench",
            "--no-default-features",
            "--bin",
            "ddprun",
            "--bin",
            "allreduce_bench",
        ]],
        picks: &[
            pick("ddprun", "bin", "ddprun"),
            pick("allreduce_bench", "bin", "allreduce_bench"),
        ],
    },
    CargoBuild {
        what: "release: xtask (it runs the check on the GPU machine)",
        args: &[&["build", "--release", "-p", "xtask"]],
        picks: &[pick("xtask", "bin", XTASK)],
    },
];

/// The xtask binary's name beside the archive (`.gpu-bin/xtask gpu-check run`).
pub const XTASK: &str = "xtask";

/// Files of the repository packed as they are: (path in the repository, name in the bundle).
pub const REPO_FILES: &[(&str, &str)] = &[
    ("scripts/gloo_allreduce.py", "gloo_allreduce.py"),
    ("scripts/resnet18_torch.py", "resnet18_torch.py"),
];

/// The Debian packages of the Vulkan loader for the wgpu rows, downloaded into `.gl/` (the GPU
/// machine has NVIDIA's Vulkan driver but maybe no loader).
pub const GL_PACKAGES: &[&str] = &["libvulkan1"];

/// What may be copied to the GPU machine: the GPU check's machine takes at most 64 MiB of
/// files (the bundle folder and `.gl` together); `build` refuses a bundle above this, leaving
/// 4 MiB for the rest of the working tree that is copied with it.
pub const COPY_LIMIT_BYTES: u64 = 60 << 20;

const fn pick(target: &'static str, kind: &'static str, file: &'static str) -> Pick {
    Pick { target, kind, file }
}

// ------------------------------------------------------------------------------------------

/// Options of `cargo xtask gpu-check build`.
#[derive(Debug, Args)]
pub struct BuildArgs {
    /// The bundle folder (replaced) [default: .gpu-bin in the workspace].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Build nothing: pack only the `--add` files and the repository's files, with the running
    /// xtask binary beside them (to test the mechanics where the CUDA build is out of reach).
    #[arg(long)]
    pub dry: bool,
    /// More files to pack (under their file names); with `--dry`, the stand-ins for the
    /// programs not built.
    #[arg(long, value_name = "FILE")]
    pub add: Vec<PathBuf>,
    /// The fallback bundle: the same binaries with the CUDA kernels compiled by cubecl-cuda's
    /// CUDA C++ backend through NVRTC (burn-ddp's `cuda-nvrtc`) instead of LLVM, for a driver
    /// that refuses LLVM's PTX [default folder: .gpu-bin-nvrtc]. It needs libnvrtc (pip's
    /// nvidia-cuda-nvrtc, no newer than the driver's CUDA) on the GPU machine.
    #[arg(long)]
    pub nvrtc: bool,
}

/// The bundle folder in the workspace.
pub const BUNDLE_DIR: &str = ".gpu-bin";

/// The NVRTC (fallback) bundle folder in the workspace, beside [`BUNDLE_DIR`].
pub const NVRTC_BUNDLE_DIR: &str = ".gpu-bin-nvrtc";

/// The name of the bundle file that says which compiler made its CUDA kernels.
pub const COMPILER_FILE: &str = "compiler.txt";

/// Which compiler made a bundle's CUDA kernels, as `COMPILER_FILE` says it.
pub fn compiler_name(nvrtc: bool) -> &'static str {
    if nvrtc {
        "NVRTC (cubecl-cuda's CUDA C++ backend, feature cuda-nvrtc)"
    } else {
        "LLVM (cubecl-cuda's default PTX backend)"
    }
}

/// The cargo arguments of build `b`: the CUDA build with `--nvrtc` takes
/// [`cargo_tasks::CUDA_NVRTC_BUILD_ARGS`] instead of CI's, and the CUDA build (dev profile)
/// compiles the packages of `gpu_stack` at opt-level 2 (see [`optimised_gpu_stack`]).
fn args_of(b: &CargoBuild, nvrtc: bool, gpu_stack: &[String]) -> Vec<String> {
    let cuda = b.args == CUDA_BUILD_ARGS;
    let base = if nvrtc && cuda {
        cargo_tasks::CUDA_NVRTC_BUILD_ARGS.concat()
    } else {
        b.args.concat()
    };
    let mut args: Vec<String> = base.into_iter().map(String::from).collect();
    if cuda {
        for package in gpu_stack {
            args.push("--config".into());
            args.push(format!(
                "profile.dev.package.{package}.opt-level={GPU_STACK_OPT_LEVEL}"
            ));
        }
    }
    args
}

/// The opt-level of the GPU stack's host code in the bundle's binaries.
pub const GPU_STACK_OPT_LEVEL: u8 = 2;

/// The packages the workspace manifest `manifest` compiles at opt-level 0 in the dev profile:
/// the GPU stack's host code (CubeCL's compilers, wgpu, Burn's CubeCL backend), unoptimised in
/// CI's build to make it faster (`.cargo/config.toml` says why).
///
/// The bundle compiles them at [`GPU_STACK_OPT_LEVEL`] instead, with `--config` overrides of
/// that list, which lives in `.cargo/config.toml` alone (the workspace's per-package
/// profile settings, in the same TOML form as a manifest's): at opt-level 0 the stripped CUDA binaries grew
/// from 652 to 832 MiB and the bundle to 70 MiB, over the 60 allowed; optimised, the kernel
/// compilers also spend less of the GPU machine's minutes. Everything else is CI's build, so
/// its dependencies below the GPU stack are reused.
pub fn optimised_gpu_stack(manifest: &str) -> Result<Vec<String>, toml::de::Error> {
    let doc: toml::Table = manifest.parse()?;
    let packages = doc
        .get("profile")
        .and_then(|p| p.get("dev"))
        .and_then(|d| d.get("package"))
        .and_then(|p| p.as_table());
    let Some(packages) = packages else {
        return Ok(Vec::new());
    };
    Ok(packages
        .iter()
        .filter(|(name, settings)| {
            name.as_str() != "*"
                && settings.get("opt-level").and_then(toml::Value::as_integer) == Some(0)
        })
        .map(|(name, _)| name.clone())
        .collect())
}

/// [`optimised_gpu_stack`] of the workspace's `.cargo/config.toml`.
fn read_gpu_stack(root: &Path) -> Result<Vec<String>, GpuCheckError> {
    let path = root.join(".cargo").join("config.toml");
    let text =
        std::fs::read_to_string(&path).map_err(|e| GpuCheckError::io("cannot read", &path, e))?;
    optimised_gpu_stack(&text).map_err(|source| GpuCheckError::Manifest { path, source })
}

/// The executable of the last artifact of `pick` in cargo's JSON messages `json`.
pub fn find_executable(json: &str, pick: &Pick) -> Option<PathBuf> {
    let harness = !matches!(pick.kind, "bin" | "example");
    let mut found = None;
    for line in json.lines() {
        let Ok(m) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if m["reason"] != "compiler-artifact" || m["target"]["name"] != pick.target {
            continue;
        }
        let kinds = m["target"]["kind"].as_array();
        if !kinds.is_some_and(|k| k.iter().any(|x| x == pick.kind)) {
            continue;
        }
        if m["profile"]["test"].as_bool() != Some(harness) {
            continue;
        }
        if let Some(exe) = m["executable"].as_str() {
            found = Some(PathBuf::from(exe));
        }
    }
    found
}

/// Copies `from` to `to` and strips it (a file `strip` can't handle stays unstripped).
fn copy_stripped(from: &Path, to: &Path) -> Result<(), GpuCheckError> {
    std::fs::copy(from, to).map_err(|e| GpuCheckError::io("cannot copy", from, e))?;
    let stripped = Command::new("strip")
        .arg(to)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !stripped {
        eprintln!("gpu-check: {} left unstripped", to.display());
    }
    Ok(())
}

/// The bytes of every file under `dir`.
pub fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

/// Runs `cargo xtask gpu-check build`.
pub fn build(root: &Path, a: &BuildArgs) -> Result<(), GpuCheckError> {
    let default_out = if a.nvrtc {
        NVRTC_BUNDLE_DIR
    } else {
        BUNDLE_DIR
    };
    let out = a.out.clone().unwrap_or_else(|| root.join(default_out));
    if out.exists() {
        std::fs::remove_dir_all(&out).map_err(|e| GpuCheckError::io("cannot remove", &out, e))?;
    }
    let stage = out.join("stage");
    std::fs::create_dir_all(&stage).map_err(|e| GpuCheckError::io("cannot create", &stage, e))?;

    let mut packed: Vec<Entry> = Vec::new();
    if a.dry {
        let me = std::env::current_exe()
            .map_err(|e| GpuCheckError::io("cannot find", Path::new("the xtask binary"), e))?;
        copy_stripped(&me, &out.join(XTASK))?;
    } else {
        let gpu_stack = read_gpu_stack(root)?;
        eprintln!(
            "==> gpu-check build: the GPU stack's host code at opt-level {GPU_STACK_OPT_LEVEL} \
             ({} packages at opt-level 0 in CI's build)",
            gpu_stack.len()
        );
        for b in CARGO_BUILDS {
            let args = args_of(b, a.nvrtc, &gpu_stack);
            eprintln!("==> gpu-check build: {}: cargo {}", b.what, args.join(" "));
            let output = cargo_tasks::cargo()
                .current_dir(root)
                .args(&args)
                .arg("--message-format=json")
                .stderr(Stdio::inherit())
                .output()
                .map_err(|e| GpuCheckError::io("cannot run", Path::new("cargo"), e))?;
            if !output.status.success() {
                return Err(GpuCheckError::Cargo {
                    what: b.what,
                    status: output.status.to_string(),
                });
            }
            let json = String::from_utf8_lossy(&output.stdout);
            for p in b.picks {
                let exe = find_executable(&json, p).ok_or(GpuCheckError::NoArtifact {
                    target: p.target,
                    kind: p.kind,
                })?;
                if p.file == XTASK {
                    copy_stripped(&exe, &out.join(XTASK))?;
                } else {
                    let staged = stage.join(p.file);
                    copy_stripped(&exe, &staged)?;
                    packed.push(Entry {
                        name: p.file.into(),
                        source: staged,
                    });
                }
            }
        }
    }
    let marker = stage.join(COMPILER_FILE);
    std::fs::write(&marker, compiler_name(a.nvrtc))
        .map_err(|e| GpuCheckError::io("cannot write", &marker, e))?;
    packed.push(Entry {
        name: COMPILER_FILE.into(),
        source: marker,
    });
    for (path, name) in REPO_FILES {
        packed.push(Entry {
            name: (*name).into(),
            source: root.join(path),
        });
    }
    for f in &a.add {
        let name = f
            .file_name()
            .ok_or_else(|| {
                GpuCheckError::io("not a file", f, std::io::ErrorKind::InvalidInput.into())
            })?
            .to_string_lossy()
            .into_owned();
        packed.retain(|e| e.name != name);
        packed.push(Entry {
            name,
            source: f.clone(),
        });
    }

    let archive = out.join(bundle::ARCHIVE);
    eprintln!(
        "==> gpu-check build: packing {} files (xz preset {}, {} MiB dictionary)",
        packed.len(),
        bundle::PRESET,
        bundle::DICT_SIZE >> 20
    );
    let raw = bundle::pack(&packed, &archive, bundle::DICT_SIZE)?;
    std::fs::remove_dir_all(&stage).map_err(|e| GpuCheckError::io("cannot remove", &stage, e))?;

    if !a.dry {
        download_gl(root);
    }
    let bundle_bytes = dir_bytes(&out);
    let gl_bytes = dir_bytes(&root.join(".gl"));
    let names: Vec<&str> = packed.iter().map(|e| e.name.as_str()).collect();
    println!(
        "gpu-check: {:.1} MiB in {} files ({}) packed into {} ({:.1} MiB); {} {:.1} MiB; \
         folder {} {:.1} MiB (+ .gl {:.1} MiB = {:.1} MiB to copy to the GPU machine; at most {} MiB)",
        mib(raw),
        packed.len(),
        names.join(", "),
        archive.display(),
        mib(std::fs::metadata(&archive).map_or(0, |m| m.len())),
        out.join(XTASK).display(),
        mib(std::fs::metadata(out.join(XTASK)).map_or(0, |m| m.len())),
        out.display(),
        mib(bundle_bytes),
        mib(gl_bytes),
        mib(bundle_bytes + gl_bytes),
        COPY_LIMIT_BYTES >> 20,
    );
    within_copy_limit(bundle_bytes, gl_bytes)?;
    println!(
        "gpu-check: on the GPU machine, from the repository root: {}/{XTASK} gpu-check run",
        out.strip_prefix(root).unwrap_or(&out).display()
    );
    Ok(())
}

/// Refuses a bundle folder and `.gl` that together exceed [`COPY_LIMIT_BYTES`]: the GPU
/// machine could not receive them.
pub fn within_copy_limit(bundle_bytes: u64, gl_bytes: u64) -> Result<(), GpuCheckError> {
    let bytes = bundle_bytes + gl_bytes;
    if bytes > COPY_LIMIT_BYTES {
        return Err(GpuCheckError::TooBig {
            bytes,
            limit: COPY_LIMIT_BYTES,
        });
    }
    Ok(())
}

/// Downloads the Vulkan loader packages into `root/.gl` unless some are there (needs apt-get
/// and its package lists; a failure is only reported: the wgpu rows need a loader there).
fn download_gl(root: &Path) {
    let gl = root.join(".gl");
    let has_debs = std::fs::read_dir(&gl).is_ok_and(|rd| {
        rd.flatten()
            .any(|e| e.path().extension().is_some_and(|x| x == "deb"))
    });
    if has_debs {
        return;
    }
    let lists = Path::new("/tmp/gpu-check-apt");
    let _ = std::fs::create_dir_all(lists.join("partial"));
    let _ = std::fs::create_dir_all(&gl);
    let opts = [
        "-oAPT::Architecture=amd64".to_string(),
        "-oAPT::Architectures=amd64".to_string(),
        format!("-oDir::State::Lists={}", lists.display()),
    ];
    let quiet = |c: &mut Command| {
        c.stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let ok = quiet(Command::new("apt-get").args(&opts).args(["update", "-qq"]))
        && quiet(
            Command::new("apt-get")
                .current_dir(&gl)
                .args(&opts)
                .args(["download", "-qq"])
                .args(GL_PACKAGES),
        );
    if ok {
        eprintln!("gpu-check: Vulkan loader packages in {}", gl.display());
    } else {
        eprintln!(
            "gpu-check: could not download the Vulkan loader; the wgpu rows need one on the GPU machine"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu_check::rows::{CHECKS, Kind};

    #[test]
    fn a_bundle_over_the_copy_limit_is_refused_with_its_size() {
        assert!(within_copy_limit(COPY_LIMIT_BYTES - (1 << 20), 1 << 20).is_ok());
        let e = within_copy_limit(COPY_LIMIT_BYTES, 1).unwrap_err();
        assert!(matches!(e, GpuCheckError::TooBig { bytes, limit }
            if bytes == COPY_LIMIT_BYTES + 1 && limit == COPY_LIMIT_BYTES));
        let e = within_copy_limit(70 << 20, 0).unwrap_err().to_string();
        assert!(
            e.starts_with("the bundle and .gl are 70.0 MiB, over the 60 MiB"),
            "{e}"
        );
    }

    #[test]
    fn the_cuda_build_is_the_one_ci_links() {
        let args = CARGO_BUILDS[0].args.concat();
        assert_eq!(args[..3], ["test", "--no-run", "--workspace"]);
        let features = args.iter().position(|a| *a == "--features").unwrap();
        assert_eq!(args[features + 1], cargo_tasks::FEATURES);
        assert_eq!(args.len(), features + 2, "{args:?}");
    }

    #[test]
    fn the_nvrtc_bundle_is_ci_s_cuda_build_and_one_feature() {
        let concat = |b: &CargoBuild| -> Vec<String> {
            b.args.concat().into_iter().map(String::from).collect()
        };
        let mut want = concat(&CARGO_BUILDS[0]);
        want.extend(["--features".into(), "burn-ddp/cuda-nvrtc".into()]);
        assert_eq!(args_of(&CARGO_BUILDS[0], true, &[]), want);
        assert_eq!(
            args_of(&CARGO_BUILDS[0], false, &[]),
            concat(&CARGO_BUILDS[0])
        );
        // The other builds do not change, and CI never compiles with NVRTC.
        assert_eq!(
            args_of(&CARGO_BUILDS[1], true, &[]),
            concat(&CARGO_BUILDS[1])
        );
        assert!(!cargo_tasks::FEATURES.contains("nvrtc"));
        assert!(compiler_name(true).contains("NVRTC") && compiler_name(false).contains("LLVM"));
    }

    #[test]
    fn the_bundle_optimises_the_packages_ci_leaves_at_opt_level_0() {
        let manifest = r#"
[profile.dev]
opt-level = 1
[profile.dev.package."*"]
opt-level = 0
[profile.dev.package.cubecl-ir]
opt-level = 0
[profile.dev.package.burn-flex]
opt-level = 3
[profile.dev.package.naga]
opt-level = 0
debug = false
"#;
        let stack = optimised_gpu_stack(manifest).unwrap();
        assert_eq!(stack, ["cubecl-ir", "naga"]);
        let cuda = args_of(&CARGO_BUILDS[0], false, &stack);
        let overrides: Vec<&str> = cuda
            .windows(2)
            .filter(|w| w[0] == "--config")
            .map(|w| w[1].as_str())
            .collect();
        assert_eq!(
            overrides,
            [
                "profile.dev.package.cubecl-ir.opt-level=2",
                "profile.dev.package.naga.opt-level=2"
            ]
        );
        // Only the dev-profile CUDA build: the release builds are optimised already.
        assert!(!args_of(&CARGO_BUILDS[1], false, &stack).contains(&"--config".to_string()));
        assert!(
            optimised_gpu_stack("[package]\nname = \"x\"")
                .unwrap()
                .is_empty()
        );
        assert!(optimised_gpu_stack("[profile.dev").is_err());
    }

    #[test]
    fn the_workspace_config_lists_the_gpu_stack() {
        let path = cargo_tasks::workspace_root().join(".cargo/config.toml");
        let text = std::fs::read_to_string(path).unwrap();
        let stack = optimised_gpu_stack(&text).unwrap();
        for package in ["cubecl-cuda", "cubecl-core", "burn-cubecl"] {
            assert!(stack.iter().any(|p| p == package), "{package}: {stack:?}");
        }
        // burn-cpu's kernel compiler (also the CUDA path's PTX compiler) is optimised in CI's
        // build too, so the bundle needs no override for it.
        for package in ["burn-flex", "cubecl-llvm", "pliron", "cubecl-opt"] {
            assert!(!stack.iter().any(|p| p == package), "{package}: {stack:?}");
        }
    }

    #[test]
    fn every_program_a_row_runs_is_built() {
        let files: Vec<&str> = CARGO_BUILDS
            .iter()
            .flat_map(|b| b.picks.iter().map(|p| p.file))
            .chain(REPO_FILES.iter().map(|f| f.1))
            .collect();
        for check in CHECKS {
            for b in check.binaries {
                assert!(
                    files.contains(b),
                    "{} needs {b}, which build does not pack",
                    check.label
                );
            }
            if let Kind::Libtest(b) = check.kind {
                assert!(check.binaries.contains(&b));
            }
        }
        assert!(files.contains(&XTASK));
        for (path, _) in REPO_FILES {
            assert!(cargo_tasks::workspace_root().join(path).is_file(), "{path}");
        }
    }

    #[test]
    fn executables_are_picked_from_cargo_json() {
        let json = r#"{"reason":"compiler-artifact","target":{"name":"ddp","kind":["test"]},"profile":{"test":true},"executable":"/t/debug/deps/ddp-1"}
not json
{"reason":"compiler-artifact","target":{"name":"ddprun","kind":["bin"]},"profile":{"test":false},"executable":"/t/release/ddprun"}
{"reason":"compiler-artifact","target":{"name":"burn_ddp","kind":["lib"]},"profile":{"test":false},"executable":null}
{"reason":"compiler-artifact","target":{"name":"burn_ddp","kind":["lib"]},"profile":{"test":true},"executable":"/t/debug/deps/burn_ddp-2"}
{"reason":"compiler-artifact","target":{"name":"ddp","kind":["test"]},"profile":{"test":true},"executable":"/t/debug/deps/ddp-3"}
{"reason":"build-finished","success":true}"#;
        let get = |t, k| find_executable(json, &pick(t, k, "f"));
        assert_eq!(get("ddp", "test"), Some("/t/debug/deps/ddp-3".into()));
        assert_eq!(get("ddprun", "bin"), Some("/t/release/ddprun".into()));
        assert_eq!(
            get("burn_ddp", "lib"),
            Some("/t/debug/deps/burn_ddp-2".into())
        );
        assert_eq!(get("ddprun", "example"), None);
        assert_eq!(get("missing", "bin"), None);
    }
}
