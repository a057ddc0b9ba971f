//! `burn_ddp::recovery::LiveTraining` under `ddprun --recover live`: the loop a program writes
//! to recover a lost rank live, with plain BatchNorm (each rank's running statistics its own),
//! dropout and an evaluation between steps, against the same job never killed, bitwise in every
//! printed metric and every rank's final parameters and buffers. Real processes (3 CPU ranks of
//! `live_worker`, ddprun serving their store), deadlines, every child reaped.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const WORKER: &str = env!("CARGO_BIN_EXE_live_worker");

/// How a job ended: its status, its stdout (the ranks' lines) and everything it printed.
struct Ended {
    ok: bool,
    stdout: String,
    all: String,
}

/// `ddprun --recover live --nproc-per-node 3 --max-restarts 1 -- live_worker ARGS --out DIR`.
fn job(dir: &Path, args: &[&str]) -> Ended {
    let worker = ddp_testkit::bundled(WORKER);
    let ddprun = worker.with_file_name("ddprun");
    let mut cmd = Command::new(&ddprun);
    cmd.args([
        "--recover",
        "live",
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "1",
        "--",
    ])
    .arg(&worker)
    .args(args)
    .arg("--out")
    .arg(dir)
    .envs([("DDP_TIMEOUT_SECS", "30"), ("RAYON_NUM_THREADS", "1")]);
    let ended = ddp_testkit::Launched::spawn(&mut cmd)
        .expect("start ddprun")
        .wait_until(Instant::now() + Duration::from_secs(120));
    Ended {
        ok: ended.status.success(),
        all: format!("{}\n{}", ended.stdout, ended.stderr),
        stdout: ended.stdout,
    }
}

/// [`job`], checked to exit 0.
fn ok_job(dir: &Path, args: &[&str]) -> Ended {
    let ended = job(dir, args);
    assert!(ended.ok, "{args:?}\n{}", ended.all);
    ended
}

/// What a job printed that must not change: rank 0's `STEP` and `EVAL` lines (the sums over
/// the ranks) and every rank's `END` sum, in order.
fn metrics(stdout: &str) -> Vec<String> {
    let mut lines: Vec<String> = ddp_testkit::rank_lines(stdout, 0)
        .iter()
        .filter(|l| l.starts_with("STEP ") || l.starts_with("EVAL "))
        .map(|l| l.to_string())
        .collect();
    for r in 0..3 {
        let end = ddp_testkit::rank_lines(stdout, r)
            .iter()
            .find_map(|l| l.strip_prefix("END ").map(str::to_string))
            .unwrap_or_else(|| panic!("rank {r} printed no END line\n{stdout}"));
        lines.push(format!(
            "rank {r} sum {}",
            end.split("sum=").nth(1).unwrap_or("?")
        ));
    }
    lines
}

/// The ranks whose final parameters and buffers differ between two jobs' outputs.
fn differing_ranks(a: &Path, b: &Path) -> Vec<usize> {
    (0..3)
        .filter(|r| {
            let read = |d: &Path| std::fs::read(d.join(format!("rank{r}.f32"))).unwrap();
            let (x, y) = (read(a), read(b));
            assert!(!x.is_empty());
            x != y
        })
        .collect()
}

/// The checks of a job `recovered` (writing into `killed`) against the same job never killed
/// (`base`, into `straight`): ddprun replaced one rank, what `pick` takes of their outputs is
/// the same, and so is every rank's final parameters and buffers.
fn assert_replaced_bitwise(
    (straight, base): (&Path, &Ended),
    (killed, recovered): (&Path, &Ended),
    pick: impl Fn(&str) -> Vec<String>,
    what: &str,
) {
    let all = &recovered.all;
    assert!(all.contains("1 lost rank(s) replaced"), "{what}\n{all}");
    assert_eq!(pick(&base.stdout), pick(&recovered.stdout), "{what}\n{all}");
    assert_eq!(
        differing_ranks(straight, killed),
        Vec::<usize>::new(),
        "{what}\n{all}"
    );
}

fn recoveries(stdout: &str, r: usize) -> usize {
    ddp_testkit::rank_lines(stdout, r)
        .iter()
        .filter(|l| l.starts_with("RECOVERED "))
        .count()
}

/// Rank 2 of 3 SIGKILLed before step 5 of 12: ddprun replaces it, the survivors hand it the
/// model, the optimizer's momentum, the progress and the loss so far, and its own BatchNorm
/// running statistics (kept by every rank); every step's dropout draws from a seed of (seed,
/// rank, step). Every STEP, EVAL and END line and every rank's final parameters and buffers are
/// bitwise those of the job never killed. Without the kept buffers rank 2's statistics (so the
/// evaluation) differ, and without the seeded steps its dropout does: the test sees both.
#[test]
fn a_lost_rank_with_plain_batch_norm_and_dropout_recovers_bitwise() {
    let dir = || tempfile::tempdir().unwrap();
    let seeded = ["--seed", "7"];
    let kill = ["--seed", "7", "--victim", "2", "--die-at-step", "5"];
    let (straight, killed) = (dir(), dir());
    let base = ok_job(straight.path(), &seeded);
    let recovered = ok_job(killed.path(), &kill);
    assert_replaced_bitwise(
        (straight.path(), &base),
        (killed.path(), &recovered),
        metrics,
        "rank 2 killed before step 5",
    );
    for r in 0..3 {
        assert_eq!(
            recoveries(&recovered.stdout, r),
            1,
            "rank {r}\n{}",
            recovered.all
        );
    }

    // The controls: what each part keeps is needed.
    let forgot = dir();
    let args = [&kill[..], &["--forget-rank-buffers"]].concat();
    let without_buffers = ok_job(forgot.path(), &args);
    assert_ne!(
        metrics(&base.stdout),
        metrics(&without_buffers.stdout),
        "the evaluation must see rank 2's own statistics missing"
    );
    assert!(differing_ranks(straight.path(), forgot.path()).contains(&2));
    let (unseeded, unseeded_killed) = (dir(), dir());
    ok_job(unseeded.path(), &[]);
    ok_job(
        unseeded_killed.path(),
        &["--victim", "2", "--die-at-step", "5"],
    );
    assert!(
        !differing_ranks(unseeded.path(), unseeded_killed.path()).is_empty(),
        "an unseeded replacement's dropout must differ"
    );
}

/// Rank 1 SIGKILLed inside the evaluation after step 4 (a collective between steps, through
/// `LiveTraining::collective`): the survivors that finished it do not make it again, those that
/// had not make it once more, rank 0 prints its EVAL line once, and the job is bitwise the one
/// never killed. With ZeRO-1 (each shard's copy on its successor) the same job with rank 2
/// killed before step 5 is bitwise its own job never killed.
#[test]
fn a_rank_lost_between_steps_or_with_a_sharded_optimizer_recovers_bitwise() {
    let dir = || tempfile::tempdir().unwrap();
    let (straight, killed) = (dir(), dir());
    let base = ok_job(straight.path(), &["--seed", "3"]);
    let recovered = ok_job(
        killed.path(),
        &[
            "--seed",
            "3",
            "--victim",
            "1",
            "--die-at-step",
            "4",
            "--die-in-eval",
        ],
    );
    assert_replaced_bitwise(
        (straight.path(), &base),
        (killed.path(), &recovered),
        metrics,
        "rank 1 killed in an evaluation",
    );
    let evals_at_4 = ddp_testkit::rank_lines(&recovered.stdout, 0)
        .iter()
        .filter(|l| l.starts_with("EVAL 4 "))
        .count();
    assert_eq!(evals_at_4, 1, "{}", recovered.all);

    let (sharded, sharded_killed) = (dir(), dir());
    let base = ok_job(sharded.path(), &["--seed", "3", "--sharded"]);
    let recovered = ok_job(
        sharded_killed.path(),
        &[
            "--seed",
            "3",
            "--sharded",
            "--victim",
            "2",
            "--die-at-step",
            "5",
        ],
    );
    assert_replaced_bitwise(
        (sharded.path(), &base),
        (sharded_killed.path(), &recovered),
        metrics,
        "ZeRO-1, rank 2 killed before step 5",
    );
}

/// Rank 1 SIGKILLed 5, 20 and 60 ms into a job of 400 steps with an evaluation every 3,
/// wherever it then is (a step's passes, the buffers' gather, the sums' all-reduce, the
/// gradient synchronisation, an evaluation; the survivors may stand a step or an evaluation
/// apart, and the group goes on from the furthest): every rank's final parameters and buffers,
/// and every rank's loss sum, are bitwise those of the job never killed.
#[test]
fn a_rank_killed_at_any_moment_recovers_bitwise() {
    let dir = || tempfile::tempdir().unwrap();
    let args = ["--seed", "5", "--steps", "400", "--eval-every", "3"];
    let straight = dir();
    let base = ok_job(straight.path(), &args);
    let sums = |stdout: &str| metrics(stdout).split_off(metrics(stdout).len() - 3);
    for ms in ["5", "20", "60"] {
        let killed = dir();
        let kill = [&args[..], &["--victim", "1", "--die-after-ms", ms]].concat();
        let recovered = ok_job(killed.path(), &kill);
        assert_replaced_bitwise(
            (straight.path(), &base),
            (killed.path(), &recovered),
            sums,
            &format!("killed {ms} ms in"),
        );
    }
}

/// The README's adoption loop with live recovery (`readme_live`, the README's block word for
/// word: checked here) on 2 ranks under `ddprun --recover live`, rank 1 SIGKILLed 500 ms into
/// its training (a wrapper's timer; its replacement is not): the epoch lines rank 0 prints
/// (every loss in full precision) are those of the job never killed.
#[test]
fn the_readme_s_live_loop_recovers_bitwise() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let after = readme
        .split("**With live recovery**")
        .nth(1)
        .expect("the README's live-recovery section");
    let block = after
        .split("```rust\n")
        .nth(1)
        .and_then(|b| b.split("\n```").next())
        .expect("its Rust block");
    let program = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/src/bin/readme_live.rs"
    ))
    .unwrap();
    let code: String = program
        .lines()
        .skip_while(|l| l.starts_with("//!") || l.is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    assert_eq!(
        code.trim_end(),
        block.trim_end(),
        "README block and readme_live.rs differ"
    );

    let program = ddp_testkit::bundled(env!("CARGO_BIN_EXE_readme_live"));
    let ddprun = program.with_file_name("ddprun");
    let kill = r#"
if [ "$RANK" = 1 ] && [ "$DDP_REJOIN" != 1 ]; then ( sleep 0.5; kill -9 $$ ) & fi
exec "$@"
"#;
    let launch = |killing: bool| {
        let mut cmd = Command::new(&ddprun);
        cmd.args([
            "--recover",
            "live",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--",
        ]);
        if killing {
            cmd.args(["sh", "-c", kill, "sh"]);
        }
        cmd.arg(&program)
            .envs([("DDP_TIMEOUT_SECS", "30"), ("RAYON_NUM_THREADS", "1")]);
        let ended = ddp_testkit::Launched::spawn(&mut cmd)
            .expect("start ddprun")
            .wait_until(Instant::now() + Duration::from_secs(120));
        let all = format!("{}\n{}", ended.stdout, ended.stderr);
        assert!(ended.status.success(), "{all}");
        let epochs: Vec<String> = ddp_testkit::rank_lines(&ended.stdout, 0)
            .iter()
            .filter(|l| l.starts_with("epoch "))
            .map(|l| l.to_string())
            .collect();
        assert_eq!(epochs.len(), 3, "{all}");
        (epochs, all)
    };
    let (straight, _) = launch(false);
    let (recovered, all) = launch(true);
    assert!(all.contains("1 lost rank(s) replaced"), "{all}");
    assert_eq!(straight, recovered, "{all}");
}
