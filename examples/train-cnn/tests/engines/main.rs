//! train-cnn under the engines clusters use instead of ddprun — a real OpenMPI `mpirun`
//! (Debian's `openmpi-bin`) and a real Slurm (`slurm-wlm` and `munge`, two nodes on this host:
//! `engines/slurm.rs`) — against the same job under the launcher library behind `ddprun`,
//! bitwise in every metric and parameter. `.ci/run` installs the three packages and sets
//! `DDP_TEST_ENGINES=required`, under which a missing one fails the test; elsewhere a test whose
//! engine is not installed prints `SKIPPED` with what to install, and passes.

mod slurm;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ddprun::{LaunchConfig, launch};
use train_cnn::checkpoint::{Checkpoint, FILE_NAME, parameter_values};
use train_cnn::metrics::{EpochMetrics, read_json};

/// Each job gets this long.
pub const DEADLINE: Duration = Duration::from_secs(180);

/// The train-cnn binary under test.
pub const TRAIN_CNN: &str = env!("CARGO_BIN_EXE_train-cnn");

/// train-cnn's arguments for a small job of 2 epochs writing into `out`.
pub fn train_args(out: &Path) -> Vec<String> {
    train_args_for(out, 2)
}

/// train-cnn's arguments for a small job of `epochs` epochs writing into `out`.
pub fn train_args_for(out: &Path, epochs: usize) -> Vec<String> {
    format!(
        "--train-size 2000 --eval-size 200 --batch-size 16 --channels 4,8,8 --lr 0.05 --seed 3 \
         --no-progress --epochs {epochs} --out {}",
        out.display()
    )
    .split(' ')
    .map(String::from)
    .collect()
}

/// The variables every rank of these jobs gets (one thread each: ranks share 2 cores; Burn's
/// CPU backend).
pub const RANK_ENV: &[(&str, &str)] = &[("RAYON_NUM_THREADS", "1"), ("BURN_DEVICE", "flex")];

/// The job of `ranks` ranks on this host under the launcher library (ddprun's), writing into
/// `out`: the reference.
pub fn reference(ranks: usize, out: &Path) {
    reference_of(ranks, train_args(out));
}

/// [`reference`] with the arguments `args`.
pub fn reference_of(ranks: usize, args: Vec<String>) {
    let cfg = LaunchConfig {
        nproc_per_node: ranks,
        extra_env: RANK_ENV
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..LaunchConfig::default()
    };
    let report = launch(&cfg, TRAIN_CNN, &args).expect("launch");
    assert!(report.success(), "the ddprun job failed: {report:?}");
}

/// Asserts that two jobs' outputs hold the same metrics (train and eval) and parameters, bit
/// for bit.
pub fn assert_same_job(a: &Path, b: &Path, what: &str) {
    let (ha, hb): (Vec<EpochMetrics>, Vec<EpochMetrics>) = (
        read_json(&a.join("metrics.json")).unwrap(),
        read_json(&b.join("metrics.json")).unwrap(),
    );
    assert!(ha.len() >= 2, "{what}");
    assert_eq!(ha.len(), hb.len(), "{what}: epochs");
    for (x, y) in ha.iter().zip(&hb) {
        assert_eq!(
            (x.train_loss, x.train_accuracy, x.eval_loss, x.eval_accuracy),
            (y.train_loss, y.train_accuracy, y.eval_loss, y.eval_accuracy),
            "{what}: epoch {}",
            x.epoch
        );
    }
    let params = |d: &Path| parameter_values(&Checkpoint::read(&d.join(FILE_NAME)).unwrap());
    assert!(
        params(a).unwrap() == params(b).unwrap(),
        "{what}: parameters differ"
    );
}

/// `program`'s full path, if installed.
fn find(program: &str) -> Option<PathBuf> {
    ["/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin"]
        .iter()
        .map(|dir| Path::new(dir).join(program))
        .find(|p| p.is_file())
}

/// `program`'s full path, or a failure naming the Debian package that provides it.
pub fn tool(program: &str, package: &str) -> PathBuf {
    find(program)
        .unwrap_or_else(|| panic!("{program} not found: install Debian's {package} (.ci/run does)"))
}

/// Whether every `(program, package)` is installed. Where one is not: under
/// `DDP_TEST_ENGINES=required` (CI) a failure naming the package; elsewhere `false`, after a
/// line saying that `test` is skipped and what to install.
pub fn engines_installed(test: &str, tools: &[(&str, &str)]) -> bool {
    let missing: Vec<String> = tools
        .iter()
        .filter(|(program, _)| find(program).is_none())
        .map(|(program, package)| format!("{program} (Debian's {package})"))
        .collect();
    if missing.is_empty() {
        return true;
    }
    let what = format!("{test}: not installed: {}", missing.join(", "));
    assert!(
        std::env::var("DDP_TEST_ENGINES").as_deref() != Ok("required"),
        "{what} (DDP_TEST_ENGINES=required)"
    );
    eprintln!("SKIPPED {what}; .ci/run installs them");
    false
}

/// OpenMPI's launcher.
const MPIRUN: &[(&str, &str)] = &[("mpirun", "openmpi-bin")];

/// A TCP port free on loopback right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a loopback port")
        .port()
}

/// How a job run with a deadline ended.
pub struct Ended {
    pub ok: bool,
    pub code: Option<i32>,
    pub all: String,
    pub after: Duration,
}

/// Runs `cmd` to its end or its deadline (then kills its process group) and returns its output.
pub fn run(cmd: &mut Command, deadline: Duration) -> Ended {
    let ended = ddp_testkit::Launched::spawn(cmd)
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"))
        .wait_until(Instant::now() + deadline);
    Ended {
        ok: ended.status.success(),
        code: ended.status.code(),
        all: format!("{}\n{}", ended.stdout, ended.stderr),
        after: ended.after,
    }
}

/// `mpirun -np 2` in a container as root: ranks may outnumber the cores, and every rank gets
/// the rendezvous host and port.
fn mpirun(port: u16) -> Command {
    let mut cmd = Command::new(tool("mpirun", "openmpi-bin"));
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .args(["-x", "MASTER_ADDR=127.0.0.1", "-x"])
        .arg(format!("MASTER_PORT={port}"));
    for (k, v) in RANK_ENV {
        cmd.args(["-x", &format!("{k}={v}")]);
    }
    cmd
}

/// `mpirun -np 2 train-cnn …` (OpenMPI's `OMPI_COMM_WORLD_*`, the rendezvous host from `-x
/// MASTER_ADDR`) trains bitwise the job ddprun runs; without `MASTER_ADDR` every rank says in
/// one line how to pass it, and mpirun exits non-zero.
#[test]
fn mpirun_trains_bitwise_as_ddprun() {
    if !engines_installed("mpirun_trains_bitwise_as_ddprun", MPIRUN) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (by_ddprun, by_mpirun) = (dir.path().join("ddprun"), dir.path().join("mpirun"));
    reference(2, &by_ddprun);
    let ended = run(
        mpirun(free_port())
            .arg(TRAIN_CNN)
            .args(train_args(&by_mpirun)),
        DEADLINE,
    );
    assert!(ended.ok, "{}", ended.all);
    assert!(ended.all.contains("train-cnn: 2 ranks"), "{}", ended.all);
    assert_same_job(&by_ddprun, &by_mpirun, "mpirun vs ddprun");

    let mut cmd = Command::new(tool("mpirun", "openmpi-bin"));
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .arg(TRAIN_CNN)
        .args(train_args(&dir.path().join("no-master")));
    let refused = run(&mut cmd, DEADLINE);
    assert!(!refused.ok, "{}", refused.all);
    assert_eq!(
        refused.all.matches("mpirun -x MASTER_ADDR=").count(),
        2,
        "one line from each rank: {}",
        refused.all
    );
    assert!(!refused.all.contains("panicked"), "{}", refused.all);
}

/// A rank SIGKILLed in the middle of an mpirun job: the other rank sees it lost and exits
/// non-zero with one line, mpirun exits non-zero, nothing hangs.
#[test]
fn a_rank_killed_under_mpirun_fails_the_job() {
    if !engines_installed("a_rank_killed_under_mpirun_fails_the_job", MPIRUN) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("killed");
    let kill_rank_1 = r#"
if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then ( sleep 0.4; kill -9 $$ ) & fi
exec "$@"
"#;
    // Long enough that the kill falls inside the training.
    let args = train_args_for(&out, 50);
    let ended = run(
        mpirun(free_port())
            .args(["sh", "-c", kill_rank_1, "sh", TRAIN_CNN])
            .args(args),
        DEADLINE,
    );
    assert!(!ended.ok && ended.code.is_some(), "{}", ended.all);
    assert!(
        ended.after < Duration::from_secs(90),
        "{:?}\n{}",
        ended.after,
        ended.all
    );
    assert!(ended.all.contains("train-cnn: error"), "{}", ended.all);
}
