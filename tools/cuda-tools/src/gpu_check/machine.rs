//! What `gpu-check run` finds out and sets up on the GPU machine before the rows: the Vulkan
//! loader packages, the driver's and NCCL's library folders on `LD_LIBRARY_PATH`, the
//! variables every check gets, and — in a child process that sees that environment — what
//! ddp-comm's own library checks say.
//!
//! The loader reads `LD_LIBRARY_PATH` once, at a process's start, so the checks
//! ([`ddp_nccl::check_libraries`], [`visible_cuda_devices`]) run in `xtask gpu-check
//! probe`, started with the environment the rows get; this process only looks for the folders
//! to add.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ddp_nccl::library::{cuda_present, nccl_present};
use ddp_nccl::{check_libraries, visible_cuda_devices};
use serde::{Deserialize, Serialize};

use super::process;

/// Folders the NVIDIA driver puts `libcuda.so.1` in, tried when the loader does not find it.
const DRIVER_DIRS: [&str; 5] = [
    "/usr/local/nvidia/lib64",
    "/usr/local/nvidia/lib",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/local/cuda/compat",
];

/// NVIDIA's Vulkan driver manifest on NVIDIA's container images (its folder is not on the loader's
/// default search path).
const NVIDIA_ICD: &str = "/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json";

/// The runtime name of NCCL, which cudarc 0.19 does not try (see `ddp_nccl::library`).
const NCCL_SONAME: &str = "libnccl.so.2";

/// Variables every check gets unless already set: NCCL over loopback with warnings only, few
/// autotune candidates (every process compiles its kernels through LLVM and the check has
/// minutes), a collective deadline that ranks compiling at different speeds don't trip.
const DEFAULT_ENV: [(&str, &str); 5] = [
    ("NCCL_SOCKET_IFNAME", "lo"),
    ("NCCL_DEBUG", "WARN"),
    ("RUST_BACKTRACE", "0"),
    ("CUBECL_AUTOTUNE_LEVEL", "minimal"),
    ("DDP_TIMEOUT_SECS", "120"),
];

/// Where the test binaries look for the rank programs they start (`ddp_tests::BIN_DIR_VAR`).
pub const TESTS_BIN_DIR_VAR: &str = "DDP_TESTS_BIN_DIR";

/// What `xtask gpu-check probe` reports, as JSON on its stdout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    /// [`cuda_present`].
    pub cuda_present: bool,
    /// [`nccl_present`].
    pub nccl_present: bool,
    /// [`check_libraries`]: the NCCL version, or its error.
    pub libraries: Result<String, String>,
    /// [`visible_cuda_devices`], or its error.
    pub devices: Result<usize, String>,
    /// The driver's CUDA version (`cuDriverGetVersion`), when libcuda loads.
    pub driver_cuda: Option<String>,
    /// The files of libcuda and libnccl this process has loaded (from `/proc/self/maps`).
    pub loaded: Vec<String>,
    /// What `cuInit(0)` returned, when libcuda loads ([`CUDA_ERROR_STUB_LIBRARY`]: a toolkit
    /// stub was loaded instead of the driver).
    #[serde(default)]
    pub cu_init: Option<i32>,
    /// Device 0's name (`cuDeviceGetName`), when a device is visible.
    #[serde(default)]
    pub device_name: Option<String>,
}

/// The header line of a run whose libcuda is the project's test-only driver stand-in
/// (`tools/cuda-standin`, whose device name says so): every CUDA row then fails by design.
pub fn standin_line(device_name: Option<&str>) -> Option<String> {
    device_name.filter(|n| n.contains("cuda-standin")).map(|n| {
        format!(
            "DRY RUN: the CUDA driver is the test-only STAND-IN ({n}): kernels are assembled by \
             ptxas and never run, so every CUDA row fails and no number below means anything"
        )
    })
}

/// `CUDA_ERROR_STUB_LIBRARY`: what a CUDA toolkit's stub `libcuda.so` answers to `cuInit`.
pub const CUDA_ERROR_STUB_LIBRARY: i32 = 34;

/// Runs ddp-comm's checks in this process and prints them as JSON (`xtask gpu-check probe`).
pub fn probe_here() -> Probe {
    let cuda = cuda_present();
    let libraries = check_libraries()
        .map(|l| l.nccl_version.to_string())
        .map_err(|e| e.to_string());
    let devices = visible_cuda_devices().map_err(|e| e.to_string());
    let driver_cuda = cuda.then(driver_cuda_version).flatten();
    // SAFETY: only when cudarc can load libcuda, so its lazy loader does not panic.
    let cu_init = cuda.then(|| unsafe { ddp_nccl::cudarc::driver::sys::cuInit(0) } as i32);
    let device_name = matches!(devices, Ok(n) if n > 0)
        .then(|| {
            use ddp_nccl::cudarc::driver::result::device;
            device::get(0).and_then(device::get_name).ok()
        })
        .flatten();
    let loaded = std::fs::read_to_string("/proc/self/maps")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|p| p.contains("libcuda.so") || p.contains("libnccl.so"))
        .fold(Vec::<String>::new(), |mut v, p| {
            if !v.iter().any(|x| x == p) {
                v.push(p.to_string());
            }
            v
        });
    Probe {
        cuda_present: cuda,
        nccl_present: nccl_present(),
        libraries,
        devices,
        driver_cuda,
        loaded,
        cu_init,
        device_name,
    }
}

fn driver_cuda_version() -> Option<String> {
    let mut v: std::ffi::c_int = 0;
    // SAFETY: only called when cudarc can load libcuda (cuda_present), so its lazy loader
    // does not panic; cuDriverGetVersion writes one int and needs no cuInit.
    let r = unsafe { ddp_nccl::cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    (r == ddp_nccl::cudarc::driver::sys::CUresult::CUDA_SUCCESS)
        .then(|| format!("{}.{}", v / 1000, v % 1000 / 10))
}

/// The machine as the rows see it.
#[derive(Debug, Clone, Default)]
pub struct Machine {
    /// Variables for every check.
    pub env: Vec<(String, String)>,
    /// Lines above the table.
    pub header: Vec<String>,
    /// Lines below the table (ldd problems, setup warnings).
    pub notes: Vec<String>,
    /// CUDA devices visible.
    pub gpus: usize,
    /// Why no CUDA check can run (`None`: libcuda loads and a device is visible).
    pub cuda_error: Option<String>,
}

/// Prepends `dir` to the `:`-separated `path` (unless it is there already).
pub fn prepend_path(dir: &str, path: &str) -> String {
    if path.split(':').any(|d| d == dir) {
        path.to_string()
    } else if path.is_empty() {
        dir.to_string()
    } else {
        format!("{dir}:{path}")
    }
}

/// The first folder among `dirs` that holds `file`.
fn first_dir_with<'a>(dirs: impl IntoIterator<Item = &'a Path>, file: &str) -> Option<PathBuf> {
    dirs.into_iter()
        .find(|d| d.join(file).exists())
        .map(Path::to_path_buf)
}

/// Folders where pip's `nvidia-nccl-cu12`/`-cu13` wheels put `libnccl.so.2`, under each
/// site-packages folder: `nvidia/nccl/lib`, `nvidia/cu13/lib`, `nvidia/cu12/lib`, then any
/// `nvidia/*/lib`.
pub fn wheel_lib_dirs(site_packages: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for sp in site_packages {
        let nvidia = sp.join("nvidia");
        for sub in ["nccl", "cu13", "cu12"] {
            dirs.push(nvidia.join(sub).join("lib"));
        }
        if let Ok(rd) = std::fs::read_dir(&nvidia) {
            let mut more: Vec<PathBuf> = rd.flatten().map(|e| e.path().join("lib")).collect();
            more.sort();
            dirs.extend(more);
        }
    }
    dirs
}

/// The CUDA major version of the pip wheel (`nvidia-nccl-cu12`, `nvidia-nccl-cu13`) that
/// installed the NCCL library `nccl`: the `nvidia_nccl_cuNN-….dist-info` beside its `nvidia`
/// folder whose `RECORD` lists the file. `None` for a library that no wheel installed.
pub fn nccl_wheel_cuda_major(nccl: &Path) -> Option<u32> {
    let file = std::fs::canonicalize(nccl).unwrap_or_else(|_| nccl.to_path_buf());
    let nvidia = file
        .ancestors()
        .find(|a| a.file_name() == Some("nvidia".as_ref()))?;
    let site = nvidia.parent()?;
    let relative = file.strip_prefix(site).ok()?.to_string_lossy().into_owned();
    std::fs::read_dir(site).ok()?.flatten().find_map(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        let major: u32 = name
            .strip_prefix("nvidia_nccl_cu")?
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()?;
        let record = std::fs::read_to_string(e.path().join("RECORD")).ok()?;
        record
            .lines()
            .any(|l| l.split(',').next() == Some(relative.as_str()))
            .then_some(major)
    })
}

/// A warning when NCCL was built for a newer CUDA major version than the driver's (`12.8`):
/// every NCCL initialisation would then fail with a driver-version error that looks like a bug
/// of the code under test.
pub fn nccl_driver_warning(wheel_major: Option<u32>, driver_cuda: Option<&str>) -> Option<String> {
    let wheel = wheel_major?;
    let driver: u32 = driver_cuda?.split('.').next()?.parse().ok()?;
    (wheel > driver).then(|| {
        format!(
            "WARNING: NCCL comes from the CUDA {wheel} wheel (nvidia-nccl-cu{wheel}) but the \
             driver supports CUDA {driver}: NCCL will fail to initialise; install \
             nvidia-nccl-cu{driver} and put its nvidia/nccl/lib first on LD_LIBRARY_PATH"
        )
    })
}

/// The path of `soname` in `ldconfig -p`'s output.
pub fn ldconfig_path(listing: &str, soname: &str) -> Option<PathBuf> {
    listing.lines().find_map(|l| {
        let (name, rest) = l.trim().split_once(' ')?;
        let path = rest.rsplit("=> ").next()?.trim();
        (name == soname).then(|| PathBuf::from(path))
    })
}

/// Finds `libnccl.so.2` on `LD_LIBRARY_PATH`, in Python's site-packages (pip's wheels), or in
/// the ldconfig cache.
fn find_nccl(ld_path: &str, scratch: &Path) -> Option<PathBuf> {
    let on_path: Vec<PathBuf> = ld_path
        .split(':')
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .collect();
    if let Some(d) = first_dir_with(on_path.iter().map(PathBuf::as_path), NCCL_SONAME) {
        return Some(d.join(NCCL_SONAME));
    }
    let mut py = Command::new("python3");
    py.args([
        "-c",
        "import site; print('\\n'.join(site.getsitepackages() + [site.getusersitepackages()]))",
    ]);
    let sites: Vec<PathBuf> = process::output_within(&mut py, Duration::from_secs(30), scratch)
        .unwrap_or_default()
        .lines()
        .map(PathBuf::from)
        .collect();
    let wheels = wheel_lib_dirs(&sites);
    if let Some(d) = first_dir_with(wheels.iter().map(PathBuf::as_path), NCCL_SONAME) {
        return Some(d.join(NCCL_SONAME));
    }
    let mut ldconfig = Command::new("ldconfig");
    ldconfig.arg("-p");
    let listing = process::output_within(&mut ldconfig, Duration::from_secs(30), scratch)?;
    ldconfig_path(&listing, NCCL_SONAME)
}

/// Sets the machine up for the rows and reports what it found. `self_exe` is this xtask
/// binary (run again as `gpu-check probe`); `gl` a folder of Debian packages to unpack into
/// `/` first (the Vulkan loader), when it has any.
pub fn prepare(self_exe: &Path, bin_dir: &Path, log_dir: &Path, gl: Option<&Path>) -> Machine {
    let mut m = Machine::default();
    let scratch = log_dir.join("query.tmp");
    if let Some(gl) = gl {
        unpack_debs(gl, &scratch, &mut m.notes);
    }
    let inherited = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    if inherited("VK_DRIVER_FILES").is_none() && Path::new(NVIDIA_ICD).exists() {
        m.env.push(("VK_DRIVER_FILES".into(), NVIDIA_ICD.into()));
    }

    let inherited_path = inherited("LD_LIBRARY_PATH").unwrap_or_default();
    // A CUDA toolkit's stub libcuda.so (…/stubs/) on the path wins over the driver's
    // libcuda.so.1, since cudarc tries `libcuda.so` first; its cuInit fails with
    // CUDA_ERROR_STUB_LIBRARY. Drop such folders, and give the rows a `libcuda.so` that is the
    // driver itself.
    let (stubs, kept): (Vec<&str>, Vec<&str>) = inherited_path
        .split(':')
        .filter(|d| !d.is_empty())
        .partition(|d| is_stub_dir(Path::new(d)));
    if !stubs.is_empty() {
        m.header.push(format!(
            "toolkit stub libcuda.so removed from LD_LIBRARY_PATH: {}",
            stubs.join(", ")
        ));
    }
    let mut ld_path = kept.join(":");
    let mut cuda_dir = None;
    match real_driver(&scratch) {
        Some(driver) => match link_as(&driver, bin_dir, "libcuda.so") {
            Ok(link_dir) => {
                ld_path = prepend_path(&link_dir, &ld_path);
                cuda_dir = Some(driver);
            }
            Err(e) => m.notes.push(format!("--- cannot link libcuda.so: {e}")),
        },
        None if !cuda_present() => {
            if let Some(d) = first_dir_with(DRIVER_DIRS.iter().map(Path::new), "libcuda.so.1") {
                ld_path = prepend_path(&d.display().to_string(), &ld_path);
                cuda_dir = Some(d);
            }
        }
        None => {}
    }
    let mut nccl_file = None;
    if !nccl_present() {
        nccl_file = find_nccl(&ld_path, &scratch);
        if let Some(f) = &nccl_file {
            match link_as(f, bin_dir, "libnccl.so") {
                Ok(link_dir) => {
                    if let Some(real_dir) = std::fs::canonicalize(f)
                        .ok()
                        .and_then(|r| r.parent().map(|p| p.display().to_string()))
                    {
                        ld_path = prepend_path(&real_dir, &ld_path);
                    }
                    ld_path = prepend_path(&link_dir, &ld_path);
                }
                Err(e) => m.notes.push(format!("--- cannot link libnccl.so: {e}")),
            }
        }
    }
    if !ld_path.is_empty() {
        m.env.push(("LD_LIBRARY_PATH".into(), ld_path));
    }
    for (k, v) in DEFAULT_ENV {
        if inherited(k).is_none() {
            m.env.push((k.into(), v.into()));
        }
    }
    m.env
        .push((TESTS_BIN_DIR_VAR.into(), bin_dir.display().to_string()));
    // libdevice.10.bc for the kernels that call exp/log (no CUDA toolkit on the machine is
    // the normal case): the lookup burn-ddp itself makes, here once for every row.
    match ddp_nccl::cuda_toolkit::find_libdevice().and_then(|f| {
        ddp_nccl::cuda_toolkit::cuda_path_for(&f, &bin_dir.join("cuda")).map(|p| (f, p))
    }) {
        Ok((file, cuda_path)) => {
            m.header.push(format!(
                "libdevice: {} (CUDA_PATH={})",
                file.display(),
                cuda_path.display()
            ));
            prepare_nvrtc(&mut m, bin_dir, Some(&cuda_path));
            m.env
                .push(("CUDA_PATH".into(), cuda_path.display().to_string()));
        }
        Err(e) => {
            m.header.push(format!("libdevice: NOT FOUND — {e}"));
            prepare_nvrtc(&mut m, bin_dir, None);
        }
    }

    // ddp-comm's checks, in a process that sees the rows' environment.
    let mut probe_cmd = Command::new(self_exe);
    probe_cmd
        .args(["gpu-check", "probe"])
        .envs(m.env.iter().map(|(k, v)| (k, v)));
    let probe =
        process::output_within(&mut probe_cmd, Duration::from_secs(60), &scratch).and_then(|out| {
            out.lines()
                .rev()
                .find_map(|l| serde_json::from_str::<Probe>(l).ok())
        });

    let mut smi = Command::new("nvidia-smi");
    smi.args([
        "--query-gpu=name,memory.total,driver_version",
        "--format=csv,noheader",
    ]);
    let smi = process::output_within(&mut smi, Duration::from_secs(30), &scratch);
    let gpu_line = smi
        .as_deref()
        .and_then(|s| s.lines().next())
        .map(str::trim)
        .unwrap_or("none found by nvidia-smi")
        .to_string();

    match &probe {
        Some(p) => {
            m.gpus = *p.devices.as_ref().unwrap_or(&0);
            m.cuda_error = match &p.devices {
                _ if p.cu_init == Some(CUDA_ERROR_STUB_LIBRARY) => Some(format!(
                    "the libcuda.so loaded ({}) is a CUDA toolkit stub (cuInit: \
                     CUDA_ERROR_STUB_LIBRARY), not the NVIDIA driver; put the driver's folder \
                     first on LD_LIBRARY_PATH",
                    p.loaded
                        .iter()
                        .find(|f| f.contains("libcuda"))
                        .map_or("?", String::as_str)
                )),
                Err(e) => Some(e.clone()),
                Ok(0) => Some(format!(
                    "libcuda loads but no CUDA device is visible (CUDA_VISIBLE_DEVICES={})",
                    inherited("CUDA_VISIBLE_DEVICES").unwrap_or_else(|| "<unset>".into())
                )),
                Ok(_) => None,
            };
            if let Some(line) = standin_line(p.device_name.as_deref()) {
                m.header.push(line);
            }
            m.header.push(format!(
                "GPU: {gpu_line}; {} CUDA device(s) visible; driver CUDA {}",
                m.gpus,
                p.driver_cuda.as_deref().unwrap_or("?")
            ));
            let loaded = |name: &str| {
                p.loaded
                    .iter()
                    .find(|f| f.contains(name))
                    .cloned()
                    .unwrap_or_else(|| "not loaded".into())
            };
            m.header.push(format!(
                "libcuda: {} ({}); libnccl: {} ({}){}",
                if p.cuda_present { "loads" } else { "NOT FOUND" },
                cuda_dir.map_or(loaded("libcuda"), |d| format!("{} linked", d.display())),
                match &p.libraries {
                    Ok(v) => format!("NCCL {v}"),
                    Err(_) if p.nccl_present => "loads, check failed".to_string(),
                    Err(_) => "NOT FOUND".to_string(),
                },
                nccl_file
                    .as_ref()
                    .map_or(loaded("libnccl"), |f| format!("{} linked", f.display())),
                match &p.libraries {
                    Err(e) => format!("\nlibraries: {e}"),
                    Ok(_) => String::new(),
                }
            ));
            let nccl_in_use = nccl_file.clone().or_else(|| {
                p.loaded
                    .iter()
                    .find(|f| f.contains("libnccl"))
                    .map(PathBuf::from)
            });
            if let Some(w) = nccl_driver_warning(
                nccl_in_use.as_deref().and_then(nccl_wheel_cuda_major),
                p.driver_cuda.as_deref(),
            ) {
                m.header.push(w);
            }
        }
        None => {
            m.cuda_error = None;
            m.header.push(format!("GPU: {gpu_line}"));
            m.header.push(
                "libraries: `xtask gpu-check probe` gave no answer; the CUDA rows run anyway"
                    .into(),
            );
        }
    }
    let setting = |k: &str| {
        m.env
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .or_else(|| inherited(k))
            .unwrap_or_default()
    };
    m.header.push(format!(
        "CUBECL_AUTOTUNE_LEVEL={}; DDP_TIMEOUT_SECS={}; NCCL_SOCKET_IFNAME={}; binaries: CI's CUDA build (dev profile, optimised dependencies)",
        setting("CUBECL_AUTOTUNE_LEVEL"),
        setting("DDP_TIMEOUT_SECS"),
        setting("NCCL_SOCKET_IFNAME"),
    ));
    ldd_notes(bin_dir, &m.env, &scratch, &mut m.notes);
    m
}

/// NVRTC and the CUDA headers for a bundle whose kernels the CUDA C++ backend compiles
/// (`gpu-check build --nvrtc`; harmless for the other): `libnvrtc.so` and its builtins linked
/// into `bin_dir/lib` (already on the rows' `LD_LIBRARY_PATH` when another library was linked
/// there; else added), the headers linked into `CUDA_PATH/include` when that is a link folder of
/// ours, and a warning when NVRTC is newer than the driver (its PTX would be refused).
fn prepare_nvrtc(m: &mut Machine, bin_dir: &Path, cuda_path: Option<&Path>) {
    use ddp_nccl::nvrtc_files;
    let nvrtc = match nvrtc_files::find_nvrtc() {
        Ok(f) => f,
        Err(e) => {
            m.header.push(format!(
                "NVRTC (the --nvrtc bundle's compiler): not found — {e}"
            ));
            return;
        }
    };
    let lib = bin_dir.join("lib");
    if let Err(e) = nvrtc_files::link_nvrtc(&nvrtc, &lib) {
        m.notes.push(format!("--- cannot link NVRTC: {e}"));
        return;
    }
    let lib = lib.display().to_string();
    match m.env.iter_mut().find(|(k, _)| k == "LD_LIBRARY_PATH") {
        Some((_, v)) => *v = prepend_path(&lib, v),
        None => m.env.push(("LD_LIBRARY_PATH".into(), lib)),
    }
    let version = nvrtc_files::builtins_beside(&nvrtc)
        .as_deref()
        .and_then(nvrtc_files::version_of_builtins);
    let driver = cuda_present()
        .then(driver_cuda_version)
        .flatten()
        .and_then(|v| {
            let mut p = v.split('.');
            Some((
                p.next()?.parse::<u32>().ok()?,
                p.next()?.parse::<u32>().ok()?,
            ))
        });
    let shown = version.map_or_else(|| "version unknown".into(), |(a, b)| format!("{a}.{b}"));
    m.header
        .push(format!("NVRTC: {} ({shown})", nvrtc.display()));
    if let (Some(n), Some(d)) = (version, driver)
        && nvrtc_files::ptx_too_new_for(n, d)
    {
        m.header.push(format!(
            "WARNING: NVRTC {}.{} is newer than the driver's CUDA {}.{}: the --nvrtc bundle's PTX \
             will be refused (install nvidia-cuda-nvrtc {}.{}.*)",
            n.0, n.1, d.0, d.1, d.0, d.1
        ));
    }
    if let Some(cp) = cuda_path.filter(|cp| cp.starts_with(bin_dir)) {
        match nvrtc_files::find_headers()
            .and_then(|h| nvrtc_files::link_headers(cp, &h).map(|()| h))
        {
            Ok(h) => m.header.push(format!("CUDA headers: {}", h.display())),
            Err(e) => m.header.push(format!("CUDA headers: {e}")),
        }
    }
}

/// Links `bin_dir/lib/NAME` (a name cudarc loads) to `file`; returns the link's folder.
pub fn link_as(file: &Path, bin_dir: &Path, name: &str) -> std::io::Result<String> {
    let real = std::fs::canonicalize(file)?;
    let dir = bin_dir.join("lib");
    std::fs::create_dir_all(&dir)?;
    let link = dir.join(name);
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&real, &link)?;
    Ok(dir.display().to_string())
}

/// Whether `dir` is a CUDA toolkit's stub folder holding a `libcuda.so` (`…/stubs/`).
pub fn is_stub_dir(dir: &Path) -> bool {
    dir.components().any(|c| c.as_os_str() == "stubs") && dir.join("libcuda.so").exists()
}

/// The NVIDIA driver's `libcuda.so.1` (never a stub): from the ldconfig cache, else the first
/// of [`DRIVER_DIRS`] holding it.
fn real_driver(scratch: &Path) -> Option<PathBuf> {
    let mut ldconfig = Command::new("ldconfig");
    ldconfig.arg("-p");
    let from_cache = process::output_within(&mut ldconfig, Duration::from_secs(30), scratch)
        .and_then(|listing| ldconfig_path(&listing, "libcuda.so.1"));
    from_cache
        .into_iter()
        .chain(
            DRIVER_DIRS
                .iter()
                .map(|d| Path::new(d).join("libcuda.so.1")),
        )
        .find(|f| f.exists() && !f.components().any(|c| c.as_os_str() == "stubs"))
}

/// `dpkg -x` of every `.deb` in `gl` into `/`, then `ldconfig` (how the Vulkan loader is
/// installed without apt on a machine that has no network).
fn unpack_debs(gl: &Path, scratch: &Path, notes: &mut Vec<String>) {
    let Ok(rd) = std::fs::read_dir(gl) else {
        return;
    };
    let mut debs: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "deb"))
        .collect();
    if debs.is_empty() {
        return;
    }
    debs.sort();
    for deb in &debs {
        let mut cmd = Command::new("dpkg");
        cmd.arg("-x").arg(deb).arg("/");
        if process::output_within(&mut cmd, Duration::from_secs(60), scratch).is_none() {
            notes.push(format!(
                "--- could not unpack {}; the wgpu rows may fail",
                deb.display()
            ));
        }
    }
    let _ = process::output_within(
        &mut Command::new("ldconfig"),
        Duration::from_secs(60),
        scratch,
    );
}

/// The libraries `ldd` cannot resolve for each program of `bin_dir`.
fn ldd_notes(bin_dir: &Path, env: &[(String, String)], scratch: &Path, notes: &mut Vec<String>) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(rd) = std::fs::read_dir(bin_dir) else {
        return;
    };
    let mut files: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .collect();
    files.sort();
    for f in files {
        let mut cmd = Command::new("ldd");
        cmd.arg(&f).envs(env.iter().map(|(k, v)| (k, v)));
        // Scripts and static programs make ldd fail: nothing to report for them.
        let Some(out) = process::output_within(&mut cmd, Duration::from_secs(30), scratch) else {
            continue;
        };
        let missing: Vec<&str> = out
            .lines()
            .map(str::trim)
            .filter(|l| l.contains("not found"))
            .collect();
        if !missing.is_empty() {
            notes.push(format!(
                "--- ldd {}: {}",
                f.file_name().unwrap_or_default().to_string_lossy(),
                missing.join("; ")
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_prepended_once() {
        assert_eq!(prepend_path("/a", ""), "/a");
        assert_eq!(prepend_path("/a", "/b:/c"), "/a:/b:/c");
        assert_eq!(prepend_path("/b", "/a:/b"), "/a:/b");
    }

    #[test]
    fn ldconfig_listing_is_read() {
        let listing = "1234 libs found in cache `/etc/ld.so.cache'\n\
            \tlibnccl.so.2 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnccl.so.2\n\
            \tlibnccl.so (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnccl.so\n";
        assert_eq!(
            ldconfig_path(listing, "libnccl.so.2"),
            Some(PathBuf::from("/usr/lib/x86_64-linux-gnu/libnccl.so.2"))
        );
        assert_eq!(ldconfig_path(listing, "libcuda.so.1"), None);
    }

    #[test]
    fn a_wheel_layout_is_found_and_linked() {
        let dir = tempfile::tempdir().unwrap();
        let site = dir.path().join("site-packages");
        let lib = site.join("nvidia").join("nccl").join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join(NCCL_SONAME), b"").unwrap();
        let dirs = wheel_lib_dirs(std::slice::from_ref(&site));
        assert_eq!(dirs[0], lib);
        let found = first_dir_with(dirs.iter().map(PathBuf::as_path), NCCL_SONAME);
        assert_eq!(found.as_deref(), Some(lib.as_path()));
        let bin = dir.path().join("bin");
        let link_dir = link_as(&lib.join(NCCL_SONAME), &bin, "libnccl.so").unwrap();
        let target = std::fs::read_link(bin.join("lib").join("libnccl.so")).unwrap();
        assert_eq!(
            target,
            std::fs::canonicalize(lib.join(NCCL_SONAME)).unwrap()
        );
        assert_eq!(PathBuf::from(link_dir), bin.join("lib"));
        // Linking again replaces the link.
        assert!(link_as(&lib.join(NCCL_SONAME), &bin, "libnccl.so").is_ok());
    }

    #[test]
    fn a_run_under_the_driver_stand_in_says_so() {
        let line = standin_line(Some(
            "NVIDIA H200 (cuda-standin: no GPU, kernels never run)",
        ));
        assert!(
            line.unwrap()
                .starts_with("DRY RUN: the CUDA driver is the test-only STAND-IN")
        );
        assert_eq!(standin_line(Some("NVIDIA H200")), None);
        assert_eq!(standin_line(None), None);
    }

    #[test]
    fn an_nccl_wheel_newer_than_the_driver_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let site = dir.path().join("site-packages");
        let lib = site.join("nvidia").join("nccl").join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join(NCCL_SONAME), b"").unwrap();
        let info = site.join("nvidia_nccl_cu13-2.28.9.dist-info");
        std::fs::create_dir_all(&info).unwrap();
        std::fs::write(
            info.join("RECORD"),
            "nvidia/nccl/include/nccl.h,sha256=x,1\nnvidia/nccl/lib/libnccl.so.2,sha256=y,2\n",
        )
        .unwrap();
        // Another wheel's RECORD does not claim the file.
        let other = site.join("nvidia_nccl_cu12-2.27.3.dist-info");
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(other.join("RECORD"), "nvidia/cu12/lib/libnccl.so.2,,\n").unwrap();
        assert_eq!(nccl_wheel_cuda_major(&lib.join(NCCL_SONAME)), Some(13));
        assert_eq!(
            nccl_wheel_cuda_major(Path::new("/usr/lib/libnccl.so.2")),
            None
        );

        let w = nccl_driver_warning(Some(13), Some("12.8")).unwrap();
        assert!(w.contains("nvidia-nccl-cu12"), "{w}");
        assert_eq!(nccl_driver_warning(Some(13), Some("13.0")), None);
        assert_eq!(nccl_driver_warning(Some(12), Some("13.0")), None);
        assert_eq!(nccl_driver_warning(None, Some("12.8")), None);
        assert_eq!(nccl_driver_warning(Some(13), None), None);
    }

    #[test]
    fn a_toolkit_stub_folder_is_recognised() {
        let dir = tempfile::tempdir().unwrap();
        let stubs = dir.path().join("cuda/lib64/stubs");
        std::fs::create_dir_all(&stubs).unwrap();
        assert!(!is_stub_dir(&stubs), "no libcuda.so there yet");
        std::fs::write(stubs.join("libcuda.so"), b"").unwrap();
        assert!(is_stub_dir(&stubs));
        let driver = dir.path().join("driver");
        std::fs::create_dir_all(&driver).unwrap();
        std::fs::write(driver.join("libcuda.so"), b"").unwrap();
        assert!(!is_stub_dir(&driver));
    }

    #[test]
    fn the_probe_agrees_with_ddp_comm_and_round_trips() {
        let p = probe_here();
        assert_eq!(p.cuda_present, cuda_present());
        if !p.cuda_present {
            let e = p.devices.clone().unwrap_err();
            assert!(e.contains("libcuda not found"), "{e}");
            assert!(
                p.libraries
                    .as_ref()
                    .unwrap_err()
                    .contains("libcuda not found")
            );
            assert_eq!(p.driver_cuda, None);
        }
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<Probe>(&json).unwrap(), p);
    }
}
