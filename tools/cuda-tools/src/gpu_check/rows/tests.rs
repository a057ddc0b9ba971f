//! Unit tests of the rows: the gating and budget helpers, the pure task helpers, and whole
//! tables run against shell-script stand-ins for the bundle's programs.

use std::os::unix::fs::PermissionsExt;

use super::tasks::cpu_scaling;
use super::*;

#[test]
fn limits_shrink_to_the_budget_and_rows_are_skipped_when_it_is_spent() {
    assert_eq!(row_limit(150, Duration::from_secs(450)), Some(150));
    assert_eq!(row_limit(150, Duration::from_secs(100)), Some(95));
    assert_eq!(row_limit(150, Duration::from_secs(20)), Some(15));
    assert_eq!(row_limit(150, Duration::from_secs(19)), None);
    assert_eq!(row_limit(150, Duration::ZERO), None);
}

#[test]
fn the_most_valuable_rows_come_first_and_fit_the_default_budget() {
    let first = &CHECKS[..FIRST_ROWS];
    assert!(matches!(
        first[0].kind,
        Kind::Test(SMOKE_BINARY, SMOKE_TEST, _)
    ));
    assert!(matches!(
        first[1].kind,
        Kind::Test("ddp-nccl-tests", NCCL_RANKS_TEST, _)
    ));
    assert!(matches!(
        first[2].kind,
        Kind::Test("ddp-tests", DDP_NCCL_RANKS_TEST, _)
    ));
    assert_eq!(first[3].kind, Kind::Task(Task::ResnetBench, 300));
    // At their limits, after 15 s of unpacking and probing, the first three leave the ResNet
    // row at least 160 s of the default budget (what `row_limit` gives it).
    let limit = |c: &Check| match c.kind {
        Kind::Test(_, _, l) | Kind::Task(_, l) => l,
        Kind::Libtest(_) => unreachable!("the first rows are single tests and tasks"),
    };
    let before: u64 = 15 + first[..3].iter().map(limit).sum::<u64>();
    let left = Duration::from_secs(crate::gpu_check::DEFAULT_BUDGET_SECS - before);
    assert!(
        row_limit(limit(&first[3]), left) >= Some(160),
        "{before} s before the ResNet row"
    );
    // Every other row comes after them, the one that needs no GPU last.
    assert_eq!(CHECKS.last().unwrap().needs, Needs::Cpu);
    // The tests with a row of their own are in the binaries' libtest rows too (there they are
    // left out), so a new binary cannot hide them.
    for c in CHECKS {
        if let Kind::Test(binary, _, _) = c.kind {
            assert!(
                CHECKS.iter().any(|l| l.kind == Kind::Libtest(binary)),
                "{binary}"
            );
        }
    }
}

#[test]
fn two_gpu_tests_need_two_devices() {
    assert!(gpu_skip("two_gpus_uneven_batches", 0).is_some());
    assert_eq!(
        gpu_skip("nccl::two_gpus_all_reduce", 1).as_deref(),
        Some("needs 2 CUDA devices (1 visible)")
    );
    assert_eq!(gpu_skip("two_gpus_uneven_batches", 2), None);
    assert_eq!(gpu_skip("one_gpu_kernels", 1), None);
    assert_eq!(gpu_skip("one_gpu_kernels", 0), None);
}

#[test]
fn listings_drop_the_rank_entry_points() {
    let listing =
        "kernels::f32: test\nrank::child_entry: test\ntwo_gpus_x: test\nbench: benchmark\n";
    assert_eq!(listed_tests(listing), ["kernels::f32", "two_gpus_x"]);
}

#[test]
fn cuda_and_cpu_losses_are_compared_relatively() {
    let a = serde_json::json!({"train_loss": 1.0005, "eval_loss": 2.0, "eval_accuracy": 0.5});
    let b = serde_json::json!({"train_loss": 1.0, "eval_loss": 2.0, "eval_accuracy": 0.5});
    let (lines, worst) = compare_epochs(("cuda", &a), ("cpu", &b), 1e-3).unwrap();
    assert!((worst - 5e-4).abs() < 1e-9, "{worst}");
    assert_eq!(lines.len(), 3);
    assert!(
        lines[0].starts_with("OUTCOME train_loss: cuda 1.000500, cpu 1.000000"),
        "{}",
        lines[0]
    );
    let bad = serde_json::json!({"train_loss": 1.0});
    assert!(compare_epochs(("cuda", &bad), ("cpu", &b), 1e-3).is_err());
}

#[test]
fn step_time_table() {
    let lines = step_time_lines(
        &[
            ("cuda-bn", Some(4000.0)),
            ("cuda-syncbn", Some(3200.0)),
            ("wgpu-syncbn", None),
            ("cpu-syncbn", Some(400.0)),
        ],
        32,
    );
    assert_eq!(lines[1], "BENCH | cuda-bn | 4000 | 8.00 | 10.00x |");
    assert_eq!(lines[3], "OUTCOME wgpu-syncbn: no metrics (the run failed)");
    assert_eq!(
        lines[5],
        "BENCH | SyncBatchNorm vs BatchNorm step time on CUDA (world 1) | +25.0 % | | |"
    );
}

#[test]
fn allreduce_rows_become_bench_lines() {
    let out =
        "launch -> first barrier done (2 ranks): 3.0 ms\n  size  median\n1M  12 us\n25M 300 us\n";
    assert_eq!(
        allreduce_bench_lines(out, 2),
        [
            "BENCH | ddp-comm shm, 2 ranks | 1M  12 us",
            "BENCH | ddp-comm shm, 2 ranks | 25M 300 us"
        ]
    );
}

fn script(dir: &Path, name: &str, body: &str) {
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A stand-in for a libtest binary: lists three tests, passes `ok`, fails `bad`, and
/// records what it ran.
const FAKE_LIBTEST: &str = r#"
if [ "$1" = --list ]; then
  printf 'ok: test\nbad: test\ntwo_gpus_pair: test\nworker::child_entry: test\n'; exit 0
fi
echo "$3" >> "$DDP_TESTS_BIN_DIR/ran"
case "$2" in
  ok) echo "test ok ... OUTCOME all good"; exit 0 ;;
  bad) echo "thread 'ok' panicked at tests/x.rs:1:1:"; echo "wrong sum"; exit 101 ;;
  two_gpus_pair) exit 0 ;;
esac
exit 3
"#;

fn ctx(dir: &Path, gpus: usize, cuda_error: Option<&str>) -> Ctx {
    let bin_dir = dir.join("bin");
    let log_dir = dir.join("logs");
    std::fs::create_dir_all(&bin_dir).unwrap();
    std::fs::create_dir_all(&log_dir).unwrap();
    script(&bin_dir, "fake-tests", FAKE_LIBTEST);
    Ctx {
        env: vec![("DDP_TESTS_BIN_DIR".into(), bin_dir.display().to_string())],
        bin_dir,
        log_dir,
        xtask: PathBuf::from("/nonexistent/xtask"),
        gpus,
        cuda_error: cuda_error.map(str::to_string),
        start: Instant::now(),
        budget: Duration::from_secs(300),
    }
}

const FAKE_CHECK: Check = Check {
    label: "fake",
    kind: Kind::Libtest("fake-tests"),
    needs: Needs::Cuda,
    binaries: &["fake-tests"],
};

fn statuses(r: &Report) -> Vec<(String, Status)> {
    r.rows.iter().map(|r| (r.label.clone(), r.status)).collect()
}

#[test]
fn one_gpu_skips_the_two_gpu_tests_and_a_failure_does_not_stop_the_table() {
    let dir = tempfile::tempdir().unwrap();
    let c = ctx(dir.path(), 1, None);
    let missing = Check {
        label: "absent",
        kind: Kind::Task(Task::CpuScaling, 10),
        needs: Needs::Cpu,
        binaries: &["ddprun"],
    };
    let mut r = Report::default();
    // Every row is announced as it ends, with the report so far.
    let mut seen: Vec<(usize, String)> = Vec::new();
    run_all(
        &c,
        &[FAKE_CHECK, missing, FAKE_CHECK],
        &mut r,
        &mut |so_far, row| seen.push((so_far.rows.len(), row.label.clone())),
    );
    assert_eq!(
        seen.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        (1..=7).collect::<Vec<_>>()
    );
    assert_eq!(seen[3].1, "absent");
    let one = [
        ("fake::ok".to_string(), Status::Pass),
        ("fake::bad".to_string(), Status::Fail),
        ("fake::two_gpus_pair".to_string(), Status::Skipped),
    ];
    let mut want = one.to_vec();
    want.push(("absent".into(), Status::Missing));
    want.extend(one);
    assert_eq!(statuses(&r), want);
    assert_eq!(r.rows[0].note, "all good");
    assert_eq!(r.rows[0].limit, Some(TEST_LIMIT_SECS));
    assert_eq!(r.rows[1].note, "wrong sum");
    assert_eq!(r.rows[2].note, "needs 2 CUDA devices (1 visible)");
    assert!(r.rows[3].note.contains("ddprun"));
    assert!(r.failed());
    assert!(r.notes.contains(&"OUTCOME all good".to_string()));
    assert!(r.notes.contains(&"--- fake::bad".to_string()));
    let ran = std::fs::read_to_string(c.bin_dir.join("ran")).unwrap();
    assert_eq!(ran, "--ignored\n--ignored\n--ignored\n--ignored\n");
}

#[test]
fn two_gpus_run_every_test() {
    let dir = tempfile::tempdir().unwrap();
    let c = ctx(dir.path(), 2, None);
    let mut r = Report::default();
    run_all(&c, &[FAKE_CHECK], &mut r, &mut |_, _| {});
    assert_eq!(
        r.rows.iter().map(|r| r.status).collect::<Vec<_>>(),
        [Status::Pass, Status::Fail, Status::Pass]
    );
}

#[test]
fn without_libcuda_cuda_rows_fail_unrun_and_a_spent_budget_skips() {
    let dir = tempfile::tempdir().unwrap();
    let c = ctx(
        dir.path(),
        0,
        Some("libcuda not found: cudarc could not load …"),
    );
    let task = Check {
        label: "cuda task",
        kind: Kind::Task(Task::CompareBackends, 10),
        needs: Needs::Cuda,
        binaries: &["train-cnn"],
    };
    let mut r = Report::default();
    run_all(&c, &[FAKE_CHECK, task], &mut r, &mut |_, _| {});
    assert_eq!(
        r.rows.iter().map(|r| r.status).collect::<Vec<_>>(),
        [Status::Fail, Status::Fail, Status::Skipped, Status::Fail]
    );
    assert!(r.rows[0].note.starts_with("libcuda not found"));
    assert!(r.rows[3].note.starts_with("libcuda not found"));
    assert!(!c.bin_dir.join("ran").exists(), "nothing ran");

    let spent = Ctx {
        budget: Duration::from_secs(10),
        cuda_error: None,
        ..c
    };
    let mut r = Report::default();
    run_all(&spent, &[FAKE_CHECK], &mut r, &mut |_, _| {});
    assert!(r.rows.iter().all(|r| r.status == Status::Skipped));
    assert!(!r.failed());
}

#[test]
fn a_task_past_its_limit_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = ctx(dir.path(), 0, None);
    script(&c.bin_dir, "ddprun", "sleep 30\n");
    script(&c.bin_dir, "allreduce_bench", "exit 0\n");
    c.budget = Duration::from_secs(26); // the limit becomes 26 - 5 = 21 s: too long a test
    let log = dir.path().join("t.log");
    let steps = Steps {
        ctx: &c,
        deadline: Instant::now() + Duration::from_millis(300),
        log: &log,
    };
    let t = Instant::now();
    assert!(matches!(cpu_scaling(&steps), Err(StepError::TimedOut)));
    assert!(t.elapsed() < Duration::from_secs(6));
}

#[test]
fn cpu_scaling_collects_bench_lines() {
    let dir = tempfile::tempdir().unwrap();
    let c = ctx(dir.path(), 0, Some("libcuda not found"));
    // ddprun stand-in: run the program after `--` once, as one rank.
    script(
        &c.bin_dir,
        "ddprun",
        "while [ \"$1\" != -- ]; do shift; done; shift; exec \"$@\"\n",
    );
    script(
        &c.bin_dir,
        "allreduce_bench",
        "echo header; echo '1M 10 us'\n",
    );
    let check = CHECKS.iter().find(|c| c.needs == Needs::Cpu).unwrap();
    let mut r = Report::default();
    run_all(&c, std::slice::from_ref(check), &mut r, &mut |_, _| {});
    assert_eq!(r.rows[0].status, Status::Pass, "{:?} {:?}", r.rows, r.notes);
    assert!(
        r.notes
            .contains(&"BENCH | ddp-comm shm, 8 ranks | 1M 10 us".to_string())
    );
    assert!(r.notes.iter().any(|n| n.contains("gloo not measured")));
}
