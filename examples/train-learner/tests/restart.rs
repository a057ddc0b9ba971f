//! A `Learner` job that loses a rank restarts from its last checkpoint on its own and ends
//! bitwise as the job never killed, on one launcher and on two: under `ddprun --max-restarts
//! 1`, rank 1 of the first attempt is SIGKILLed soon after rank 0's checkpoint of epoch 1 is
//! whole (an epoch takes a fraction of a second here, so the kill lands in epoch 2 or a little
//! later); the launchers start the group again, every rank resumes after the last epoch
//! checkpointed whole (`LearnerCheckpoints`, the train loader set to that epoch), and the final
//! parameters and every epoch line printed after the resume are those of the same job never
//! killed.

use std::path::Path;
use std::time::Duration;

use ddp_testkit::{Launched, rank_lines, read_f32};

const PROGRAM: &str = env!("CARGO_BIN_EXE_train-learner");

/// The job's epochs.
const EPOCHS: usize = 5;

/// Each launch gets this long.
const DEADLINE: Duration = Duration::from_secs(300);

/// Rank 1 of the first attempt kills itself (SIGKILL, from a background shell) 0.05 s after
/// rank 0's checkpoint of epoch 1 is complete (its last file, the scheduler's, renamed into
/// place), then `exec`s the program, so the killed process is train-learner itself. The watcher
/// gives up after about a minute (then nothing is killed and the test fails).
const KILL_RANK_1_IN_EPOCH_2: &str = r#"
if [ "$RANK" = 1 ] && [ "$DDP_RESTART_COUNT" = 0 ]; then
  ( i=0; while [ ! -f "$OUT/checkpoint/scheduler-1.bpk" ]; do
      i=$((i + 1)); [ $i -gt 6000 ] && exit 0; sleep 0.01; done
    sleep 0.05; kill -9 $$ ) &
fi
exec "$@"
"#;

/// What a job's launchers printed and how they ended.
struct Ended {
    /// Every launcher exited 0.
    success: bool,
    /// Their stdout, node 0's first.
    stdout: String,
    /// Their stderr, node 0's first.
    stderr: String,
    /// Their exit statuses, for messages.
    statuses: String,
}

/// The job on `nodes` launchers (one of 2 ranks, or two of 1 rank each on emulated hosts under
/// one job token), train-learner (`EPOCHS` epochs) writing to `out`, through `sh -c
/// KILL_RANK_1_IN_EPOCH_2` when `kill`, `--max-restarts 1`.
fn launch(out: &Path, kill: bool, nodes: usize) -> Ended {
    let ddprun = Path::new(PROGRAM).with_file_name("ddprun");
    assert!(
        ddprun.exists(),
        "{} is missing: `cargo test --workspace` builds it",
        ddprun.display()
    );
    let port = ddp_testkit::free_port().to_string();
    let token = ddp_testkit::job_token();
    let launched: Vec<Launched> = (0..nodes)
        .map(|node| {
            let mut cmd = std::process::Command::new(&ddprun);
            cmd.args(["--master-port", &port, "--max-restarts", "1"]);
            if nodes == 1 {
                cmd.args(["--nproc-per-node", "2"]);
            } else {
                cmd.args(["--nproc-per-node", "1", "--nnodes", "2"])
                    .args(["--node-rank", &node.to_string()])
                    .env("DDP_JOB_TOKEN", &token)
                    .env("DDP_HOST_ID", format!("emulated-host-{node}"));
            }
            cmd.arg("--");
            if kill {
                cmd.args(["sh", "-c", KILL_RANK_1_IN_EPOCH_2, "sh"]);
            }
            cmd.arg(PROGRAM)
                .args(["--epochs", &EPOCHS.to_string(), "--train-size", "3000"])
                .args(["--batch-size", "10"])
                .arg("--out")
                .arg(out)
                .env("OUT", out)
                .env("RAYON_NUM_THREADS", "1");
            Launched::spawn(&mut cmd).expect("start ddprun")
        })
        .collect();
    let finished: Vec<_> = launched.into_iter().map(|l| l.wait_for(DEADLINE)).collect();
    Ended {
        success: finished.iter().all(|f| f.status.success()),
        stdout: finished.iter().map(|f| f.stdout.as_str()).collect(),
        stderr: finished.iter().map(|f| f.stderr.as_str()).collect(),
        statuses: format!(
            "{:?}",
            finished.iter().map(|f| f.status).collect::<Vec<_>>()
        ),
    }
}

/// Rank 0's last line that starts with `prefix`.
fn last_line<'a>(stdout: &'a str, prefix: &str) -> &'a str {
    rank_lines(stdout, 0)
        .into_iter()
        .rfind(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line {prefix:?} of rank 0 in:\n{stdout}"))
}

/// The job never killed and the job with rank 1 killed, on `nodes` launchers: the killed one
/// restarts, resumes after a whole epoch, and ends bitwise as the other.
fn resumes_bitwise(nodes: usize) {
    let dir = tempfile::tempdir().unwrap();
    let never = launch(&dir.path().join("never"), false, nodes);
    assert!(
        never.success,
        "the job never killed: {}\n{}\n{}",
        never.statuses, never.stdout, never.stderr
    );
    let killed = launch(&dir.path().join("killed"), true, nodes);
    let log = format!(
        "{nodes} launcher(s), {}\nstdout:\n{}\nstderr:\n{}",
        killed.statuses, killed.stdout, killed.stderr
    );
    assert!(killed.success, "the killed job: {log}");
    assert!(
        killed.stderr.contains("rank 1 was killed by signal 9"),
        "rank 1 was not killed: {log}"
    );
    let resumed_after: usize = killed
        .stderr
        .split("restarted, resuming after epoch ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the second attempt did not resume: {log}"));
    assert!(
        (1..EPOCHS).contains(&resumed_after),
        "resumed after epoch {resumed_after} of {EPOCHS}: {log}"
    );
    assert_eq!(
        read_f32(&dir.path().join("killed/params.f32")),
        read_f32(&dir.path().join("never/params.f32")),
        "the resumed job's parameters differ from the job never killed: {log}"
    );
    for epoch in resumed_after + 1..=EPOCHS {
        for split in ["train", "valid"] {
            let prefix = format!("epoch {epoch}/{EPOCHS} {split}:");
            assert_eq!(
                last_line(&killed.stdout, &prefix),
                last_line(&never.stdout, &prefix),
                "{prefix} after the resume: {log}"
            );
        }
    }
}

#[test]
fn a_learner_job_that_loses_a_rank_resumes_from_its_checkpoint_bitwise() {
    resumes_bitwise(1);
}

/// The same on two launchers (`--nnodes 2`, emulated hosts): node 1's rank is killed, every
/// launcher restarts its ranks, and the ranks of both nodes resume from rank 0's checkpoint.
#[test]
fn on_two_launchers_a_learner_job_resumes_from_its_checkpoint_bitwise() {
    resumes_bitwise(2);
}
