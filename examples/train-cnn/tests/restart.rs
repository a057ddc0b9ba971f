//! A rank killed with SIGKILL in the middle of a 2-rank train-cnn run, under the launcher
//! library behind `ddprun` (real processes, real signal): with `max_restarts = 1` the launcher
//! stops the other rank, starts the group again, train-cnn resumes from the checkpoint of the
//! last finished epoch, and the run ends where an uninterrupted run ends; without restarts the
//! job fails with the killed rank's code (137).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ddprun::{LaunchConfig, LaunchReport, launch};
use train_cnn::checkpoint::{Checkpoint, FILE_NAME, parameter_values};
use train_cnn::metrics::{EpochMetrics, read_json};

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

/// Rank 0 of the first attempt — the rank that writes checkpoints — is killed (SIGKILL) in the
/// middle of its second checkpoint write: once the first checkpoint exists and the temporary
/// file of the next save appears (every write pauses half-way, `DDP_CHECKPOINT_WRITE_PAUSE_MS`).
/// The checkpoint in place at that moment and the temporaries are copied to `$MARKS` first.
const KILL_RANK_0_DURING_A_WRITE: &str = r#"
if [ "$RANK" = 0 ] && [ "$DDP_RESTART_COUNT" = 0 ]; then
  ( dir=$(dirname "$CHECKPOINT")
    while [ ! -f "$CHECKPOINT" ]; do sleep 0.01; done
    while ! ls "$dir"/.checkpoint.bin.tmp-* >/dev/null 2>&1; do sleep 0.01; done
    cp "$CHECKPOINT" "$MARKS/in-place-at-kill"
    ls "$dir"/.checkpoint.bin.tmp-* > "$MARKS/temporaries"
    kill -9 $$ ) &
fi
exec "$@"
"#;

/// Every checkpoint write pauses this long half-way in the run that kills a writer.
const WRITE_PAUSE_MS: &str = "700";

fn train_args(out: &Path, epochs: usize, extra: &str) -> Vec<String> {
    let s = format!(
        "--train-size 4000 --eval-size 200 --batch-size 16 --channels 4,8,8 --lr 0.05 --seed 3 \
         --sync-bn --no-progress --epochs {epochs} --out {}{extra}",
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

/// `cfg` as node `node` of two launchers with one rank each, meeting at `port` on loopback,
/// each node its own emulated host (`DDP_HOST_ID`: TCP between them).
fn on_node(mut cfg: LaunchConfig, node: usize, port: u16) -> LaunchConfig {
    cfg.nproc_per_node = 1;
    cfg.nnodes = 2;
    cfg.node_rank = node;
    cfg.master_port = Some(port);
    cfg.job_token = Some("two-nodes".into());
    cfg.rdzv_heartbeat = Duration::from_secs(5);
    cfg.extra_env
        .push(("DDP_HOST_ID".into(), format!("emulated-host-{node}")));
    cfg
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
    let cfg = config(max_restarts, marks, &out.join(FILE_NAME));
    run_under(cfg, KILL_RANK_1_IN_EPOCH_2, train_args(out, 3, ""), marks)
}

/// `sh -c SCRIPT sh train-cnn ARGS…` under the launcher.
fn run_under(cfg: LaunchConfig, script: &str, train: Vec<String>, marks: &Path) -> LaunchReport {
    std::fs::create_dir_all(marks).unwrap();
    let mut args = vec![
        "-c".to_string(),
        script.to_string(),
        "sh".to_string(),
        env!("CARGO_BIN_EXE_train-cnn").to_string(),
    ];
    args.extend(train);
    launch_with_deadline(cfg, "sh".into(), args)
}

/// Asserts that the run in `restarted` ended with the parameters of the run in `straight`
/// (within 1e-6); returns that difference and both runs' metrics.
fn same_end(straight: &Path, restarted: &Path) -> (f32, Vec<EpochMetrics>, Vec<EpochMetrics>) {
    let max_diff = max_param_diff(&straight.join(FILE_NAME), &restarted.join(FILE_NAME));
    assert!(
        max_diff <= 1e-6,
        "final parameters differ: max |Δparam| = {max_diff:e}"
    );
    let ha = read_json(&straight.join("metrics.json")).unwrap();
    let hb = read_json(&restarted.join("metrics.json")).unwrap();
    (max_diff, ha, hb)
}

/// Every epoch's train and eval loss and accuracy of two runs, to the bit.
fn assert_same_metrics(a: &[EpochMetrics], b: &[EpochMetrics], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: epochs");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(
            (x.train_loss, x.train_accuracy, x.eval_loss, x.eval_accuracy),
            (y.train_loss, y.train_accuracy, y.eval_loss, y.eval_accuracy),
            "{what}: epoch {}",
            x.epoch
        );
    }
}

/// The largest difference between the final parameters of two runs.
fn max_param_diff(a: &Path, b: &Path) -> f32 {
    let (a, b) = (Checkpoint::read(a).unwrap(), Checkpoint::read(b).unwrap());
    let (pa, pb) = (parameter_values(&a).unwrap(), parameter_values(&b).unwrap());
    assert_eq!(pa.len(), pb.len());
    pa.iter()
        .zip(&pb)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
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
        train_args(&straight, 3, ""),
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
    let b = Checkpoint::read(&restarted.join(FILE_NAME)).unwrap();
    assert_eq!(b.progress.epochs_done, 3);
    let (max_diff, ha, hb) = same_end(&straight, &restarted);
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

    // The same job over two emulated nodes (two launchers, one rank each, their own host
    // identities, so TCP between them), rank 1 — node 1's — killed the same way: both
    // launchers restart in one round and the run ends with the same parameters.
    let nodes = dir.path().join("nodes");
    let node_marks = dir.path().join("node-marks");
    std::fs::create_dir_all(&node_marks).unwrap();
    let port = ddp_testkit::free_port();
    let start = Instant::now();
    let launches: Vec<_> = (0..2)
        .map(|node| {
            let cfg = on_node(config(2, &node_marks, &nodes.join(FILE_NAME)), node, port);
            let (nodes, marks) = (nodes.clone(), node_marks.clone());
            std::thread::spawn(move || {
                run_under(
                    cfg,
                    KILL_RANK_1_IN_EPOCH_2,
                    train_args(&nodes, 3, ""),
                    &marks,
                )
            })
        })
        .collect();
    for (node, h) in launches.into_iter().enumerate() {
        let report = h.join().expect("launch thread");
        assert!(report.success(), "node {node}: {report:?}");
        assert_eq!(report.attempt, 1, "node {node}: one restart: {report:?}");
        assert!(
            report.restarts[0].summary.contains("node 1 (ddprun pid"),
            "node {node}: {report:?}"
        );
    }
    let nodes_secs = start.elapsed().as_secs_f64();
    let (nodes_diff, _, _) = same_end(&straight, &nodes);
    let gap = read_time(node_marks.join("start.1.0")) - read_time(node_marks.join("killed"));
    eprintln!(
        "two nodes: {gap:.3} s from the SIGKILL on node 1 to node 0's restarted rank starting; \
         max |Δparam| vs the uninterrupted run {nodes_diff:e}; {nodes_secs:.1} s in all"
    );
}

/// Plain BatchNorm (no `--sync-bn`): every rank's running statistics differ. Rank 1 killed
/// in epoch 2, after the first checkpoint, and the group restarted: the run ends with the
/// uninterrupted run's parameters and its train *and* eval metrics to every digit — the
/// checkpoint keeps every rank's statistics and each rank resumes with its own.
#[test]
fn a_restart_with_per_rank_batch_norm_ends_as_an_uninterrupted_one() {
    let without_sync_bn = |out: &Path| -> Vec<String> {
        train_args(out, 3, "")
            .into_iter()
            .filter(|a| a != "--sync-bn")
            .collect()
    };
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("straight");
    let marks = dir.path().join("marks");
    let cfg = config(0, &marks, &straight.join(FILE_NAME));
    let report = launch_with_deadline(
        cfg,
        env!("CARGO_BIN_EXE_train-cnn").into(),
        without_sync_bn(&straight),
    );
    assert!(report.success(), "uninterrupted run failed: {report:?}");
    let restarted = dir.path().join("restarted");
    let cfg = config(1, &marks, &restarted.join(FILE_NAME));
    let report = run_under(
        cfg,
        KILL_RANK_1_IN_EPOCH_2,
        without_sync_bn(&restarted),
        &marks,
    );
    assert!(report.success(), "the restarted run failed: {report:?}");
    assert_eq!(report.attempt, 1, "no restart happened: {report:?}");
    let (_, ha, hb) = same_end(&straight, &restarted);
    assert_eq!(ha.len(), 3);
    assert_same_metrics(&ha, &hb, "restarted");
    // The checkpoint holds both ranks' statistics, and they differ.
    let ck = Checkpoint::read(&restarted.join(FILE_NAME)).unwrap();
    assert_eq!(ck.rank_buffers.len(), 2);
    assert_ne!(ck.rank_buffers[0], ck.rank_buffers[1]);
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

/// The writer of the checkpoints, killed in the middle of a save (its temporary file half
/// written): the restarted job resumes from the previous checkpoint — saved in the middle of
/// an epoch (`--checkpoint-every-steps`), so the run continues at that exact batch — and ends
/// where an uninterrupted run ends.
#[test]
fn a_kill_during_a_checkpoint_write_resumes_from_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("marks");
    // 4000 samples, 2 ranks, batch 16: 125 steps per epoch; saves at steps 40, 80, 120, 125, …
    let every = " --checkpoint-every-steps 40";
    let straight = dir.path().join("straight");
    let cfg = config(0, &marks, &straight.join(FILE_NAME));
    let report = launch_with_deadline(
        cfg,
        env!("CARGO_BIN_EXE_train-cnn").into(),
        train_args(&straight, 2, every),
    );
    assert!(report.success(), "uninterrupted run failed: {report:?}");

    let restarted = dir.path().join("restarted");
    let mut cfg = config(1, &marks, &restarted.join(FILE_NAME));
    cfg.extra_env.push((
        burn_ddp::checkpoint::WRITE_PAUSE_VAR.into(),
        WRITE_PAUSE_MS.into(),
    ));
    let report = run_under(
        cfg,
        KILL_RANK_0_DURING_A_WRITE,
        train_args(&restarted, 2, every),
        &marks,
    );
    assert!(report.success(), "the restarted run failed: {report:?}");
    assert_eq!(report.attempt, 1, "no restart happened: {report:?}");
    assert!(
        report.restarts[0]
            .summary
            .contains("rank 0 was killed by signal 9"),
        "{report:?}"
    );

    // At the kill, a save was half-way (its temporary existed) and the checkpoint in place was
    // the previous one, from step 40 in the middle of epoch 1.
    let temporaries = std::fs::read_to_string(marks.join("temporaries")).unwrap();
    assert!(
        temporaries.contains(".checkpoint.bin.tmp-"),
        "{temporaries}"
    );
    let in_place = Checkpoint::read(&marks.join("in-place-at-kill")).unwrap();
    assert_eq!(in_place.progress.step, 40, "{:?}", in_place.progress);
    assert_eq!(in_place.progress.epochs_done, 0);
    // The dead writer's temporary was removed when the restarted job read the checkpoint.
    let left: Vec<_> = std::fs::read_dir(&restarted)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");

    let (max_diff, ha, hb) = same_end(&straight, &restarted);
    assert_eq!(ha.len(), 2);
    assert_eq!(hb.len(), 2);
    for (x, y) in ha.iter().zip(&hb) {
        // The resumed epoch's training sums were carried over in the checkpoint and added in
        // another order. Evaluation reads BatchNorm's running statistics, which come back
        // from the mid-epoch record within float rounding (the trainable parameters exactly:
        // the train losses agree to the last bit in a one-process run).
        let rel = |a: f64, b: f64| ((a - b) / a).abs();
        assert!(
            rel(x.train_loss, y.train_loss) < 1e-9,
            "epoch {}: train loss {} vs {}",
            x.epoch,
            x.train_loss,
            y.train_loss
        );
        assert!(
            rel(x.eval_loss, y.eval_loss) < 1e-6,
            "epoch {}: eval loss {} vs {}",
            x.epoch,
            x.eval_loss,
            y.eval_loss
        );
        assert_eq!(x.train_accuracy, y.train_accuracy, "epoch {}", x.epoch);
    }
    eprintln!("kill during a checkpoint write: resumed from step 40, max |Δparam| {max_diff:e}");
}

/// A checkpoint save that takes longer than the collective deadline (`DDP_TIMEOUT_SECS`) is no
/// failure: the ranks waiting for rank 0's save wait by the checkpoint deadline instead.
/// Before, rank 1 timed out in the outcome broadcast and blamed rank 0 as stalled.
#[test]
fn a_save_slower_than_the_collective_deadline_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut cfg = config(0, &dir.path().join("marks"), &out.join(FILE_NAME));
    cfg.extra_env.extend([
        ("DDP_TIMEOUT_SECS".to_string(), "5".to_string()),
        (
            burn_ddp::checkpoint::WRITE_PAUSE_VAR.to_string(),
            "8000".to_string(),
        ),
    ]);
    let args: Vec<String> = format!(
        "--train-size 256 --eval-size 64 --batch-size 32 --channels 4,8,8 --seed 3 \
         --no-progress --epochs 1 --out {}",
        out.display()
    )
    .split(' ')
    .map(String::from)
    .collect();
    let t = std::time::Instant::now();
    let report = launch_with_deadline(cfg, env!("CARGO_BIN_EXE_train-cnn").into(), args);
    assert!(report.success(), "a slow save failed the job: {report:?}");
    assert!(
        t.elapsed() >= Duration::from_secs(8),
        "the save did not pause (the test proves nothing)"
    );
    assert!(Checkpoint::read(&out.join(FILE_NAME)).is_ok());
}

/// Under `--recover live`: every rank records its process id (every start of it,
/// `$MARKS/pids.$RANK`) and rank `$VICTIM` (1 unless set), in its first start only, kills
/// itself (SIGKILL) `$KILL_DELAY_MS` after the first mid-epoch checkpoint exists — or, with
/// `$KILL_IN_WRITE` set, once rank 0's next checkpoint write is half-way (its temporary file
/// exists). The replacement deletes the checkpoint before it starts: the state it trains on can
/// only come from the survivors' memory.
const LIVE_KILL: &str = r#"
echo $$ >> "$MARKS/pids.$RANK"
if [ "$DDP_REJOIN" = 1 ]; then
  rm -f "$CHECKPOINT"
elif [ "$RANK" = "${VICTIM:-1}" ]; then
  ( dir=$(dirname "$CHECKPOINT")
    while [ ! -f "$CHECKPOINT" ]; do sleep 0.005; done
    if [ -n "$KILL_IN_WRITE" ]; then
      while ! ls "$dir"/.checkpoint.bin.tmp-* >/dev/null 2>&1; do sleep 0.005; done
    else
      sleep "$(awk "BEGIN { print $KILL_DELAY_MS / 1000 }")"
    fi
    kill -9 $$ ) &
fi
exec "$@"
"#;

/// Lose a rank, lose one step: rank 1 of a 2-rank SyncBatchNorm run is SIGKILLed in the middle
/// of training — at a moment that varies (forward with its SyncBatchNorm exchange, backward,
/// the gradient all-reduce, the optimizer step), once while a checkpoint is being written, and
/// once with the optimizer state sharded (ZeRO-1) — and rank 0 once, under `ddprun --recover
/// live`. Each time: one attempt, the killed rank replaced, the other the same process
/// throughout, no checkpoint read, and the final parameters and every printed
/// train/eval metric **bitwise** those of the run that was never killed.
#[test]
fn a_rank_replaced_live_ends_bitwise_as_the_run_never_killed() {
    let args = |out: &Path| train_args(out, 2, " --checkpoint-every-steps 20");
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("straight");
    let marks = dir.path().join("marks");
    let report = launch_with_deadline(
        config(0, &marks, &straight.join(FILE_NAME)),
        env!("CARGO_BIN_EXE_train-cnn").into(),
        args(&straight),
    );
    assert!(report.success(), "uninterrupted run failed: {report:?}");
    let ha = read_json(&straight.join("metrics.json")).unwrap();
    assert_eq!(ha.len(), 2);

    // The sharded optimizer (ZeRO-1) trains bitwise as the unsharded one: the same reference.
    for (case, env, extra, victim) in [
        ("killed 0 ms after step 20", ("KILL_DELAY_MS", "0"), "", 1),
        (
            "killed 170 ms after step 20",
            ("KILL_DELAY_MS", "170"),
            "",
            1,
        ),
        (
            "killed during a checkpoint write",
            ("KILL_IN_WRITE", "1"),
            "",
            1,
        ),
        (
            "ZeRO-1, killed 90 ms after step 20",
            ("KILL_DELAY_MS", "90"),
            " --shard-optimizer",
            1,
        ),
        (
            "rank 0 killed 60 ms after step 20",
            ("KILL_DELAY_MS", "60"),
            "",
            0,
        ),
    ] {
        let out = dir.path().join(case.replace([' ', ','], "-"));
        let marks = out.join("marks");
        let mut cfg = config(1, &marks, &out.join(FILE_NAME));
        cfg.live_recovery = true;
        cfg.extra_env.extend([
            (env.0.into(), env.1.into()),
            ("VICTIM".into(), victim.to_string()),
            ("DDP_CHECKPOINT_WRITE_PAUSE_MS".into(), "100".into()),
        ]);
        let mut train = args(&out);
        train.extend(extra.split_whitespace().map(String::from));
        let report = run_under(cfg, LIVE_KILL, train, &marks);
        assert!(report.success(), "{case}: {report:?}");
        assert_eq!(report.attempt, 0, "{case}: the group restarted: {report:?}");
        assert_eq!(report.replaced.len(), 1, "{case}: {report:?}");
        assert_eq!(report.replaced[0].rank, victim, "{case}: {report:?}");
        let pids = |rank: usize| -> Vec<String> {
            std::fs::read_to_string(marks.join(format!("pids.{rank}")))
                .unwrap()
                .lines()
                .map(String::from)
                .collect()
        };
        let survivor = 1 - victim;
        assert_eq!(
            pids(survivor).len(),
            1,
            "{case}: rank {survivor} started again"
        );
        assert_eq!(
            pids(victim).len(),
            2,
            "{case}: rank {victim} not replaced once"
        );
        let max_diff = max_param_diff(&straight.join(FILE_NAME), &out.join(FILE_NAME));
        assert_eq!(max_diff, 0.0, "{case}: final parameters differ");
        let hb = read_json(&out.join("metrics.json")).unwrap();
        assert_same_metrics(&ha, &hb, case);
    }
}

/// Lose a rank with plain BatchNorm (each rank's running statistics its own, so each rank's
/// evaluation too): rank 1 SIGKILLed 60 ms after the first mid-epoch checkpoint under `ddprun
/// --recover live`. train-cnn's loop runs on `LiveTraining`, which keeps every rank's
/// statistics and gives the replacement its own: every train and eval column and the final
/// parameters are bitwise those of the plain-BatchNorm run never killed.
#[test]
fn a_rank_replaced_live_with_plain_batch_norm_keeps_every_eval_column() {
    let args = |out: &Path| -> Vec<String> {
        train_args(out, 2, " --checkpoint-every-steps 20")
            .into_iter()
            .filter(|a| a != "--sync-bn")
            .collect()
    };
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("straight");
    let report = launch_with_deadline(
        config(0, &dir.path().join("marks"), &straight.join(FILE_NAME)),
        env!("CARGO_BIN_EXE_train-cnn").into(),
        args(&straight),
    );
    assert!(report.success(), "uninterrupted run failed: {report:?}");
    let ha = read_json(&straight.join("metrics.json")).unwrap();
    let out = dir.path().join("killed");
    let marks = out.join("marks");
    let mut cfg = config(1, &marks, &out.join(FILE_NAME));
    cfg.live_recovery = true;
    cfg.extra_env.extend([
        ("KILL_DELAY_MS".into(), "60".into()),
        ("VICTIM".into(), "1".into()),
    ]);
    let report = run_under(cfg, LIVE_KILL, args(&out), &marks);
    assert!(report.success(), "{report:?}");
    assert_eq!(report.attempt, 0, "the group restarted: {report:?}");
    assert_eq!(report.replaced.len(), 1, "{report:?}");
    assert_eq!(
        max_param_diff(&straight.join(FILE_NAME), &out.join(FILE_NAME)),
        0.0
    );
    assert_same_metrics(
        &ha,
        &read_json(&out.join("metrics.json")).unwrap(),
        "plain BatchNorm",
    );
}

/// Lose a rank on another node: the same job on two launchers (one rank each, emulated hosts,
/// TCP between them, gradients in bf16 on the wire), under `--recover live` on both. Node 1's
/// rank is SIGKILLed right after the first mid-epoch checkpoint, then while rank 0 writes a
/// checkpoint; node 0's rank 0 60 ms after the first checkpoint (node 0's launcher serves the
/// ranks' store). Each time the lost rank's own launcher alone replaces it, the other launcher
/// sees no failure and its rank stays the same process, both exit 0 after one round, and the
/// final parameters and every metric are bitwise those of the same two-launcher job never
/// killed. (On one node the ranks' gradients meet in shared memory in f32: bf16 compresses
/// only what crosses between hosts.)
#[test]
fn a_rank_replaced_live_on_another_node_ends_bitwise_as_the_run_never_killed() {
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("straight");
    for report in two_launchers(&straight, None) {
        assert!(report.success(), "uninterrupted run failed: {report:?}");
    }
    let ha = read_json(&straight.join("metrics.json")).unwrap();
    for (case, victim, env) in [
        (
            "rank 1 killed after a checkpoint",
            1,
            ("KILL_DELAY_MS", "0"),
        ),
        (
            "rank 1 killed in a checkpoint write",
            1,
            ("KILL_IN_WRITE", "1"),
        ),
        (
            "rank 0 killed 60 ms after a checkpoint",
            0,
            ("KILL_DELAY_MS", "60"),
        ),
    ] {
        let out = dir.path().join(case.replace(' ', "-"));
        let kill = [(env.0, env.1.to_string()), ("VICTIM", victim.to_string())];
        for (node, report) in two_launchers(&out, Some(&kill)).into_iter().enumerate() {
            assert!(report.success(), "{case}, node {node}: {report:?}");
            assert_eq!(
                report.attempt, 0,
                "{case}, node {node}: a new round: {report:?}"
            );
            let replaced: Vec<usize> = report.replaced.iter().map(|f| f.rank).collect();
            // One rank per node: node n runs rank n.
            let expected: &[usize] = if node == victim { &[victim] } else { &[] };
            assert_eq!(replaced, expected, "{case}, node {node}: {report:?}");
        }
        let pids = |rank: usize| {
            std::fs::read_to_string(out.join("marks").join(format!("pids.{rank}")))
                .unwrap()
                .lines()
                .count()
        };
        assert_eq!(pids(1 - victim), 1, "{case}: the other rank started again");
        assert_eq!(pids(victim), 2, "{case}: rank {victim} not replaced once");
        let max_diff = max_param_diff(&straight.join(FILE_NAME), &out.join(FILE_NAME));
        assert_eq!(max_diff, 0.0, "{case}: final parameters differ");
        let hb = read_json(&out.join("metrics.json")).unwrap();
        assert_same_metrics(&ha, &hb, case);
    }
}

/// train-cnn (2 epochs, a checkpoint every 20 steps, bf16 gradients) in `out` on two launchers
/// of one rank each, their own emulated hosts; with `kill` (the variables of [`LIVE_KILL`]),
/// under `--recover live` and that script. Both reports, by node.
fn two_launchers(out: &Path, kill: Option<&[(&str, String)]>) -> Vec<LaunchReport> {
    let marks = out.join("marks");
    let port = ddp_testkit::free_port();
    let launches: Vec<_> = (0..2)
        .map(|node| {
            let mut cfg = on_node(
                config(usize::from(kill.is_some()), &marks, &out.join(FILE_NAME)),
                node,
                port,
            );
            cfg.live_recovery = kill.is_some();
            let vars = kill.into_iter().flatten();
            cfg.extra_env
                .extend(vars.map(|(k, v)| (k.to_string(), v.clone())));
            let script = match kill {
                Some(_) => {
                    // A write long enough for the kill inside one.
                    cfg.extra_env
                        .push(("DDP_CHECKPOINT_WRITE_PAUSE_MS".into(), "100".into()));
                    LIVE_KILL
                }
                None => "exec \"$@\"",
            };
            let train = train_args(out, 2, " --checkpoint-every-steps 20 --compression bf16");
            let marks = marks.clone();
            std::thread::spawn(move || run_under(cfg, script, train, &marks))
        })
        .collect();
    launches
        .into_iter()
        .map(|h| h.join().expect("launch thread"))
        .collect()
}
