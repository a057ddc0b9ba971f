//! A rank killed with SIGKILL in the middle of a 2-rank train-cnn run, under the launcher
//! library behind `ddprun` (real processes, real signal): with `max_restarts = 1` the launcher
//! stops the other rank, starts the group again, train-cnn resumes from the checkpoint of the
//! last finished epoch, and the run ends where an uninterrupted run ends; without restarts the
//! job fails with the killed rank's code (137).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ddp_comm::launcher::{LaunchConfig, LaunchReport, launch};
use train_cnn::checkpoint::{Checkpoint, FILE_NAME};
use train_cnn::metrics::read_json;

/// Each launch gets this long; the launcher kills its ranks when the test thread dies.
const DEADLINE: Duration = Duration::from_secs(300);

/// Rank 1 of the first attempt kills itself (SIGKILL, from a background shell) once the first
/// checkpoint exists, i.e. during the second epoch; then `exec`s the real program, so the
/// killed process is train-cnn itself. Every attempt's start is recorded in `$MARKS`.
const KILL_RANK_1_IN_EPOCH_2: &str = r#"
date +%s.%N > "$MARKS/start.$DDP_RESTART_COUNT.$RANK"
if [ "$RANK" = 1 ] && [ "$DDP_RESTART_COUNT" = 0 ]; then
  ( while [ ! -f "$CHECKPOINT" ]; do sleep 0.01; done; sleep 0.2
    date +%s.%N > "$MARKS/killed"; kill -9 $$ ) &
fi
exec "$@"
"#;

fn train_args(out: &Path) -> Vec<String> {
    let s = format!(
        "--train-size 4000 --eval-size 200 --batch-size 16 --channels 4,8,8 --lr 0.05 --seed 3 \
         --sync-bn --no-progress --epochs 3 --out {}",
        out.display()
    );
    s.split(' ').map(String::from).collect()
}

fn config(max_restarts: usize, marks: &Path, checkpoint: &Path) -> LaunchConfig {
    LaunchConfig {
        nproc_per_node: 2,
        grace: Duration::from_secs(2),
        prefix_output: true,
        max_restarts,
        extra_env: vec![
            ("MARKS".into(), marks.display().to_string()),
            ("CHECKPOINT".into(), checkpoint.display().to_string()),
            ("RAYON_NUM_THREADS".into(), "1".into()),
        ],
        ..LaunchConfig::default()
    }
}

/// Runs `launch` on a thread of its own and fails the test past the deadline (the thread is
/// left behind; the ranks die with it when the test process exits).
fn launch_with_deadline(cfg: LaunchConfig, program: String, args: Vec<String>) -> LaunchReport {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(launch(&cfg, &program, &args).expect("launch"));
    });
    rx.recv_timeout(DEADLINE)
        .unwrap_or_else(|_| panic!("the launch overran its {DEADLINE:?} deadline"))
}

/// `sh -c KILL_RANK_1_IN_EPOCH_2 sh train-cnn ARGS…`.
fn killing_run(max_restarts: usize, out: &Path, marks: &Path) -> LaunchReport {
    std::fs::create_dir_all(marks).unwrap();
    let mut args = vec![
        "-c".to_string(),
        KILL_RANK_1_IN_EPOCH_2.to_string(),
        "sh".to_string(),
        env!("CARGO_BIN_EXE_train-cnn").to_string(),
    ];
    args.extend(train_args(out));
    let cfg = config(max_restarts, marks, &out.join(FILE_NAME));
    launch_with_deadline(cfg, "sh".into(), args)
}

fn read_time(path: PathBuf) -> f64 {
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn a_killed_rank_is_restarted_and_the_run_ends_as_an_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("straight");
    let marks = dir.path().join("marks");
    let cfg = config(0, &marks, &straight.join(FILE_NAME));
    let start = Instant::now();
    let report = launch_with_deadline(
        cfg,
        env!("CARGO_BIN_EXE_train-cnn").into(),
        train_args(&straight),
    );
    assert!(report.success(), "uninterrupted run failed: {report:?}");
    let straight_secs = start.elapsed().as_secs_f64();

    let restarted = dir.path().join("restarted");
    let start = Instant::now();
    let report = killing_run(1, &restarted, &marks);
    assert!(report.success(), "the restarted run failed: {report:?}");
    assert_eq!(report.attempt, 1, "no restart happened: {report:?}");
    assert_eq!(report.restarts[0].exit_code, 137, "{report:?}");
    assert!(
        report.restarts[0]
            .summary
            .contains("rank 1 was killed by signal 9"),
        "{report:?}"
    );
    let restarted_secs = start.elapsed().as_secs_f64();

    // The restarted attempt resumed and ended where the uninterrupted run ended.
    let a = Checkpoint::load(&straight.join(FILE_NAME)).unwrap();
    let b = Checkpoint::load(&restarted.join(FILE_NAME)).unwrap();
    assert_eq!(b.meta.epochs_done, 3);
    let (pa, pb) = (a.parameter_values().unwrap(), b.parameter_values().unwrap());
    assert_eq!(pa.len(), pb.len());
    let max_diff = pa
        .iter()
        .zip(&pb)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        max_diff <= 1e-6,
        "final parameters differ: max |Δparam| = {max_diff:e}"
    );
    let (ha, hb) = (
        read_json(&straight.join("metrics.json")).unwrap(),
        read_json(&restarted.join("metrics.json")).unwrap(),
    );
    assert_eq!(ha.len(), hb.len());
    for (x, y) in ha.iter().zip(&hb) {
        assert_eq!(
            (x.train_loss, x.eval_loss),
            (y.train_loss, y.eval_loss),
            "epoch {}",
            x.epoch
        );
    }
    let gap = read_time(marks.join("start.1.0")) - read_time(marks.join("killed"));
    eprintln!(
        "restart: {gap:.3} s from the SIGKILL to the restarted attempt's first rank starting; \
         max |Δparam| vs the uninterrupted run {max_diff:e}; uninterrupted run \
         {straight_secs:.1} s, run with a restart {restarted_secs:.1} s"
    );
}

#[test]
fn without_restarts_the_killed_rank_fails_the_job_with_137() {
    let dir = tempfile::tempdir().unwrap();
    let report = killing_run(0, &dir.path().join("run"), &dir.path().join("marks"));
    assert_eq!(report.exit_code(), 137, "{report:?}");
    assert!(report.restarts.is_empty());
    let line = report.summary().unwrap();
    assert!(
        line.contains("rank 1 was killed by signal 9 (SIGKILL)"),
        "{line}"
    );
}
