//! Live recovery meets a second fault (issue 54): the replacement dies while it joins, a
//! survivor dies during the re-forming or the hand-over, three losses in a row, a rank that
//! fails on its own error, a hung rank, and the budget on two launchers. Every case runs the
//! `ddp_worker --scenario live` job of 3 ranks (12 steps, SGD with momentum, rank 2 SIGKILLed
//! before step 5 unless said otherwise) under `ddprun --recover live`, and checks the job's
//! outcome, that every rank's final parameters are bitwise those of the run never killed, that
//! no wait ran into a timeout meant for something else, and that no process of the job left a
//! shared-memory segment behind.
//!
//! The race cases run `DDP_RACE_REPEATS` times each (2 by default, as CI runs them; 20 by
//! hand: `DDP_RACE_REPEATS=20 cargo test … second_faults`).

use std::path::Path;
use std::time::Duration;

use super::live_job::{self, Setup};
use super::recovered_at;

/// How many times each race case runs.
fn race_repeats() -> usize {
    std::env::var("DDP_RACE_REPEATS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
}

/// What every job here sets: the default 60 s connect timeout (a stall on a dead generation
/// would show), a collective timeout that no case should reach, one thread per rank.
const ENV: &[(&str, &str)] = &[
    ("DDP_CONNECT_TIMEOUT_SECS", "60"),
    ("DDP_TIMEOUT_SECS", "30"),
    ("RAYON_NUM_THREADS", "1"),
];

/// Rank 2 dies before step 5; `extra` adds the second fault.
const KILL_2_AT_5: &[&str] = &["--victim", "2", "--die-at-step", "5"];

/// A job that no case may take this long for: far under the 60 s connect timeout a stalled
/// recovery would wait out.
const NO_STALL: Duration = Duration::from_secs(30);

/// The run never killed of `steps` steps on `nproc` ranks, once per test binary's process.
fn straight_on(nproc: &str, steps: &str) -> &'static Path {
    type Runs = Vec<(String, String, &'static Path)>;
    static DIRS: std::sync::Mutex<Runs> = std::sync::Mutex::new(Vec::new());
    let mut dirs = DIRS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, _, d)) = dirs.iter().find(|(n, s, _)| n == nproc && s == steps) {
        return d;
    }
    // Kept for the test binary's lifetime (removed by the system's temporary-file cleanup).
    let dir: &'static Path = Box::leak(tempfile::tempdir().unwrap().keep().into_boxed_path());
    live_job::run(
        dir,
        steps,
        &[],
        &Setup {
            env: ENV,
            nproc: Some(nproc),
            ..Setup::default()
        },
        Duration::from_secs(120),
    );
    dirs.push((nproc.to_string(), steps.to_string(), dir));
    dir
}

/// The processes of a job, from its output: the ranks' `PID` lines and ddprun's replacement
/// lines (`(pid P)`), which name the replacements that died before they printed anything.
fn job_pids(all: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for line in all.lines() {
        for (marker, end) in [(" pid=", ' '), ("(pid ", ')')] {
            if let Some(rest) = line.split(marker).nth(1)
                && let Ok(pid) = rest.split(end).next().unwrap_or_default().parse()
            {
                pids.push(pid);
            }
        }
    }
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// The highest generation of the group in which a rank's first recovery ended (its first
/// `RECOVERED … generation=G` line): 1 after one re-forming, more when a generation was given
/// up or the recovery re-formed again after a second loss inside it (a second loss after it is
/// a second recovery, a second line).
fn first_recovery_generation(stdout: &str) -> u64 {
    (0..3)
        .filter_map(|r| {
            ddp_testkit::rank_lines(stdout, r)
                .iter()
                .find(|l| l.starts_with("RECOVERED "))?
                .split(" generation=")
                .nth(1)?
                .trim()
                .parse::<u64>()
                .ok()
        })
        .max()
        .unwrap_or(0)
}

/// What processes `pids` left behind: shared-memory segments (`/dev/shm/ddp-pg-{pid}-…`) and
/// local socket directories (`ddp-comm-{pid}-…` in the temporary directory or
/// `$XDG_RUNTIME_DIR`).
fn leftover_segments(pids: &[u32]) -> Vec<String> {
    let mut places = vec![
        (std::path::PathBuf::from("/dev/shm"), "ddp-pg"),
        (std::env::temp_dir(), "ddp-comm"),
    ];
    if let Some(runtime) = std::env::var_os("XDG_RUNTIME_DIR") {
        places.push((runtime.into(), "ddp-comm"));
    }
    places
        .iter()
        .flat_map(|(dir, kind)| {
            let names: Vec<String> = std::fs::read_dir(dir)
                .map(|entries| {
                    entries
                        .filter_map(|e| e.ok()?.file_name().into_string().ok())
                        .collect()
                })
                .unwrap_or_default();
            names
                .into_iter()
                .filter(|name| {
                    pids.iter()
                        .any(|p| name.starts_with(&format!("{kind}-{p}-")))
                })
                .map(|name| dir.join(name).display().to_string())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The checks every successful case makes on a job of 3 ranks that ended `ended`.
fn assert_recovered_bitwise(dir: &Path, steps: &str, ended: &live_job::Ended, case: &str) {
    assert_recovered_bitwise_on("3", dir, steps, ended, case);
}

/// [`assert_recovered_bitwise`] for a job of `nproc` ranks; prints the job's wall time and its
/// ranks' recovery times (`RECOVERED … ms=`) for the bounds in docs/failures.md.
fn assert_recovered_bitwise_on(
    nproc: &str,
    dir: &Path,
    steps: &str,
    ended: &live_job::Ended,
    case: &str,
) {
    let all = &ended.all;
    assert!(ended.status.success(), "{case}: {}\n{all}", ended.status);
    assert!(
        ended.after < NO_STALL,
        "{case}: the job took {:?}: a stall\n{all}",
        ended.after
    );
    let recoveries: Vec<&str> = ended
        .stdout
        .lines()
        .filter_map(|l| l.split(" ms=").nth(1)?.split_whitespace().next())
        .collect();
    eprintln!(
        "BOUND {case}: job {:.2} s, recover() took {} ms",
        ended.after.as_secs_f64(),
        recoveries.join(", ")
    );
    let reference = straight_on(nproc, steps);
    let read = |d: &Path, r: usize| std::fs::read(d.join(format!("rank{r}.f32"))).unwrap();
    for r in 0..nproc.parse().unwrap() {
        assert!(
            read(reference, r) == read(dir, r),
            "{case}: rank {r}'s parameters differ from the run never killed\n{all}"
        );
    }
    let pids = job_pids(all);
    assert!(pids.len() >= 3, "{case}: no pids in\n{all}");
    let left = leftover_segments(&pids);
    assert!(left.is_empty(), "{case}: left behind: {left:?}\n{all}");
}

/// Runs the job of `steps` steps with `extra` worker arguments and `max_restarts`.
fn job(dir: &Path, steps: &str, extra: &[&str], max_restarts: &str) -> live_job::Ended {
    live_job::run_any(
        dir,
        steps,
        extra,
        &Setup {
            env: ENV,
            max_restarts: Some(max_restarts),
            ..Setup::default()
        },
        Duration::from_secs(120),
    )
}

/// The replacement of rank 2 dies too, at 0, 5 and 20 ms after its start (before it connects,
/// while it joins the re-forming group) and right after it claimed its slot in the survivors'
/// generation (the generation can never form with it): with `--max-restarts 2` its own
/// replacement is started, the survivors give the dead generation up for the next one, and the
/// job ends bitwise, without waiting out the 60 s connect timeout.
#[test]
fn a_replacement_lost_while_it_joins_is_replaced_again_without_a_stall() {
    for repeat in 0..race_repeats() {
        for death in [
            &["--replacement-dies-after-ms", "0"][..],
            &["--replacement-dies-after-ms", "5"],
            &["--replacement-dies-after-ms", "20"],
            &["--replacement-dies-after-claim"],
        ] {
            let case = format!("repeat {repeat}, replacement {death:?}");
            let dir = tempfile::tempdir().unwrap();
            let extra = [KILL_2_AT_5, &["--replacement-deaths", "1"], death].concat();
            let ended = job(dir.path(), "12", &extra, "2");
            assert_recovered_bitwise(dir.path(), "12", &ended, &case);
            for r in 0..2 {
                assert_eq!(
                    recovered_at(&ended.stdout, r),
                    Some(5),
                    "{case}: rank {r}\n{}",
                    ended.all
                );
            }
            assert!(
                ended.all.contains("2 lost rank(s) replaced"),
                "{case}\n{}",
                ended.all
            );
            // Dead after its claim: the generation it claimed in was given up for a later one.
            if death == ["--replacement-dies-after-claim"] {
                assert!(
                    first_recovery_generation(&ended.stdout) >= 2,
                    "{case}: no generation given up\n{}",
                    ended.all
                );
            }
        }
    }
}

/// After rank 2's loss, a survivor dies too, 5 to 100 ms into its recovery: rank 1 (while
/// the group re-forms) and rank 0 (the lowest survivor, whose state is handed over): both
/// losses are replaced live (`--max-restarts 2`), the survivors' recovery goes on in the next
/// generation inside the library, and the job (300 steps: still running when the second
/// loss comes) ends bitwise.
#[test]
fn a_survivor_lost_during_the_recovery_is_replaced_too() {
    // How many runs re-formed more than once (the second loss came inside the recovery, not
    // after it): at least one must, or the case tests nothing new.
    let mut re_formed_again = 0;
    for repeat in 0..race_repeats() {
        for survivor in ["1", "0"] {
            for ms in ["5", "20", "50", "100"] {
                let case = format!("repeat {repeat}, rank {survivor} dies {ms} ms into it");
                let dir = tempfile::tempdir().unwrap();
                let second = format!("{survivor}:{ms}");
                let extra = [KILL_2_AT_5, &["--survivor-dies-in-recovery", &second]].concat();
                let ended = job(dir.path(), "300", &extra, "2");
                assert_recovered_bitwise(dir.path(), "300", &ended, &case);
                assert!(
                    ended.all.contains("2 lost rank(s) replaced"),
                    "{case}\n{}",
                    ended.all
                );
                re_formed_again += usize::from(first_recovery_generation(&ended.stdout) >= 2);
            }
        }
    }
    assert!(re_formed_again > 0, "no second loss fell inside a recovery");
}

/// Three losses in a row (rank 2, then its replacement 5 ms after its start, then the next
/// one's): with `--max-restarts 3` all three are replaced live and the job ends bitwise; with
/// `--max-restarts 2` the third loss finds the budget spent, and the job fails, saying so.
#[test]
fn three_losses_in_a_row_spend_the_budget_of_three_and_no_more() {
    let extra = [
        KILL_2_AT_5,
        &[
            "--replacement-deaths",
            "2",
            "--replacement-dies-after-ms",
            "5",
        ],
    ]
    .concat();
    let dir = tempfile::tempdir().unwrap();
    let ended = job(dir.path(), "12", &extra, "3");
    assert_recovered_bitwise(dir.path(), "12", &ended, "K=3");
    assert!(
        ended.all.contains("3 lost rank(s) replaced")
            && ended.all.contains("restart budget 3 of 3 spent"),
        "{}",
        ended.all
    );

    let dir = tempfile::tempdir().unwrap();
    let ended = job(dir.path(), "12", &extra, "2");
    assert!(!ended.status.success(), "K=2 exited 0\n{}", ended.all);
    assert!(
        ended
            .all
            .contains("the --max-restarts budget is spent: 2 of 2"),
        "{}",
        ended.all
    );
    let left = leftover_segments(&job_pids(&ended.all));
    assert!(left.is_empty(), "left behind: {left:?}\n{}", ended.all);
}

/// A rank that fails with an error of its own (exit code 3, no lost peer behind it) is not
/// replaced live (a replacement would fail the same way): the group restarts from the start
/// (`--max-restarts 1`), and the job ends with the parameters of the run never killed.
#[test]
fn a_rank_that_fails_on_its_own_error_restarts_the_group_instead() {
    let dir = tempfile::tempdir().unwrap();
    let ended = job(
        dir.path(),
        "12",
        &["--victim", "1", "--fail-at-step", "5"],
        "1",
    );
    assert_recovered_bitwise(dir.path(), "12", &ended, "own error");
    assert!(
        ended.all.contains("error of its own")
            && ended
                .all
                .contains("restarting the group (restart budget 1 of 1 spent)")
            && !ended.all.contains("started a replacement"),
        "{}",
        ended.all
    );
}

/// A rank that stops (SIGSTOP before step 5) hangs the others' gradient all-reduce: they time
/// out after `DDP_TIMEOUT_SECS` (3 s here), the launcher kills the hung rank and it is replaced
/// live; the job ends bitwise, well within the timeout and a few seconds, not the 60 s connect
/// timeout after it.
#[test]
fn a_hung_rank_is_killed_and_replaced_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let env = [
        ("DDP_CONNECT_TIMEOUT_SECS", "60"),
        ("DDP_TIMEOUT_SECS", "3"),
        ("RAYON_NUM_THREADS", "1"),
    ];
    let ended = live_job::run_any(
        dir.path(),
        "12",
        &["--victim", "2", "--stop-at-step", "5"],
        &Setup {
            env: &env,
            ..Setup::default()
        },
        Duration::from_secs(120),
    );
    assert_recovered_bitwise(dir.path(), "12", &ended, "SIGSTOP");
    assert!(
        ended.all.contains("rank 2 hangs") && ended.all.contains("1 lost rank(s) replaced"),
        "{}",
        ended.all
    );
    // From the stop to the replacement's first finished step.
    let at = |marker: &str| -> u128 {
        ended
            .stdout
            .lines()
            .find_map(|l| l.split(marker).nth(1)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {marker:?} in\n{}", ended.all))
    };
    let took = at("FIRST STEP rank=2 at=").saturating_sub(at("STOPPING rank=2 at="));
    assert!(
        took < 3_000 + 8_000,
        "{took} ms from the stop to the replacement's first step\n{}",
        ended.all
    );
    eprintln!("hung rank: {took} ms from its stop to its replacement's first step");
}

/// The job on two launchers of one rank each (emulated hosts, TCP) under `--recover live
/// --max-restarts K`, with `extra` worker arguments and `env`: both launchers' ends, and
/// everything they printed.
fn two_launchers(
    dir: &Path,
    extra: &[&str],
    max_restarts: &str,
    env: &[(&str, &str)],
) -> (Vec<ddp_testkit::Finished>, String) {
    let port = ddp_testkit::free_port().to_string();
    let token = ddp_testkit::job_token();
    let launcher_args = ["--nnodes", "2", "--max-restarts", max_restarts];
    let launched: Vec<_> = (0..2)
        .map(|node| live_launcher(dir, node, &port, &token, &launcher_args, extra, env))
        .collect();
    let ended: Vec<_> = launched
        .into_iter()
        .map(|l| l.wait_for(Duration::from_secs(120)))
        .collect();
    let all = format!(
        "node 0:\n{}\n{}\nnode 1:\n{}\n{}",
        ended[0].stdout, ended[0].stderr, ended[1].stdout, ended[1].stderr
    );
    (ended, all)
}

/// Two launchers of one rank each, `--max-restarts 1`: node 1's rank dies before step 3 and is
/// replaced live (the budget spent, in the launchers' shared state), then node 0's rank dies
/// before step 7: the budget is spent, so the job ends on both nodes with the same non-zero
/// code and the same last line, after one live recovery.
#[test]
fn on_two_launchers_the_budget_is_the_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let (ended, all) = two_launchers(
        dir.path(),
        &["--victim", "1,0", "--die-at-steps", "3,7"],
        "1",
        ENV,
    );
    let last = |e: &ddp_testkit::Finished| e.stderr.lines().last().unwrap_or_default().to_string();
    assert!(ended.iter().all(|e| e.status.code() == Some(137)), "{all}");
    assert_eq!(last(&ended[0]), last(&ended[1]), "{all}");
    assert!(
        all.contains("started a replacement for rank 1")
            && all.contains("the --max-restarts budget is spent: 1 of 1")
            && !all.contains("restarting the group"),
        "{all}"
    );
    let left = leftover_segments(&job_pids(&all));
    assert!(left.is_empty(), "left behind: {left:?}\n{all}");
}

/// Two launchers of one rank each: node 1's rank stops (SIGSTOP before step 5). Rank 0's
/// all-reduce times out on it after `DDP_TIMEOUT_SECS` (3 s); node 0's launcher reports it in
/// the launchers' shared state, node 1's kills it and replaces it live: both exit 0, bitwise
/// the two-launcher job never killed.
#[test]
fn on_two_launchers_a_hung_rank_is_killed_by_its_own_launcher() {
    let env = [
        ("DDP_CONNECT_TIMEOUT_SECS", "60"),
        ("DDP_TIMEOUT_SECS", "3"),
        ("RAYON_NUM_THREADS", "1"),
    ];
    let (straight, stopped) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (ended, all) = two_launchers(straight.path(), &[], "1", &env);
    assert!(ended.iter().all(|e| e.status.success()), "{all}");
    let (ended, all) = two_launchers(
        stopped.path(),
        &["--victim", "1", "--stop-at-step", "5"],
        "1",
        &env,
    );
    assert!(ended.iter().all(|e| e.status.success()), "{all}");
    assert!(
        all.contains("rank 1 hangs: a rank of another node waited for it")
            && all.contains("started a replacement for rank 1"),
        "{all}"
    );
    assert!(
        ended.iter().all(|e| e.after < Duration::from_secs(20)),
        "{all}"
    );
    two_ranks_end_as_never_killed_and_leave_nothing(straight.path(), stopped.path(), &all);
}

/// Two ranks: rank 1 dies before step 5, and rank 0 — the only rank that holds the state —
/// dies 0 to 20 ms into its recovery, before or during the hand-over to rank 1's replacement.
/// Either the hand-over had finished (rank 1's replacement holds the state and hands it to rank
/// 0's, bitwise), or nobody holds the state any more: then no rank may pass its fresh model off
/// as the state (a replacement holds none until a hand-over completed), every rank says so,
/// and the group restarts from the start, paid for by the two replacements (`--max-restarts
/// 2`). Both end with the parameters of the run never killed.
#[test]
fn the_source_lost_during_the_hand_over_never_leaves_a_fresh_model_as_the_state() {
    for repeat in 0..race_repeats() {
        for ms in ["0", "5", "10", "20"] {
            let case = format!("repeat {repeat}, rank 0 dies {ms} ms into its recovery");
            let dir = tempfile::tempdir().unwrap();
            let second = format!("0:{ms}");
            let ended = live_job::run_any(
                dir.path(),
                "300",
                &[
                    "--victim",
                    "1",
                    "--die-at-step",
                    "5",
                    "--survivor-dies-in-recovery",
                    &second,
                ],
                &Setup {
                    env: ENV,
                    nproc: Some("2"),
                    max_restarts: Some("2"),
                    ..Setup::default()
                },
                Duration::from_secs(120),
            );
            assert_recovered_bitwise_on("2", dir.path(), "300", &ended, &case);
            let restarted = ended
                .all
                .contains("every rank that held the training state was lost")
                && ended
                    .all
                    .contains("restarting the group (paid for by the live recovery");
            let handed = ended.all.contains("2 lost rank(s) replaced");
            assert!(restarted || handed, "{case}\n{}", ended.all);
        }
    }
}

/// One launcher of one rank of the worker (`--scenario live`, 12 steps, `extra` arguments)
/// under `--recover live`, on emulated host `node`, with `launcher_args` (its `--nnodes`,
/// `--max-restarts` and the like), the job's `token` and `env`.
fn live_launcher(
    dir: &Path,
    node: usize,
    port: &str,
    token: &str,
    launcher_args: &[&str],
    extra: &[&str],
    env: &[(&str, &str)],
) -> ddp_testkit::Launched {
    let worker = ddp_testkit::bundled(env!("CARGO_BIN_EXE_ddp_worker"));
    let ddprun = worker.with_file_name("ddprun");
    let mut cmd = std::process::Command::new(&ddprun);
    cmd.args(["--node-rank", &node.to_string(), "--nproc-per-node", "1"])
        .args(["--master-port", port, "--recover", "live"])
        .args(launcher_args)
        .arg("--")
        .arg(&worker)
        .args(["--scenario", "live", "--steps", "12", "--out"])
        .arg(dir)
        .args(extra)
        .envs(env.iter().copied())
        .env("DDP_JOB_TOKEN", token)
        .env("DDP_HOST_ID", format!("emulated-host-{node}"));
    ddp_testkit::Launched::spawn(&mut cmd).expect("start ddprun")
}

/// One launcher of the spare's job: `--nnodes 2:3 --max-restarts 1`, a last call of 1 s.
fn elastic_launcher(
    dir: &Path,
    node: usize,
    port: &str,
    token: &str,
    extra: &[&str],
) -> ddp_testkit::Launched {
    let launcher_args = [
        "--nnodes",
        "2:3",
        "--max-restarts",
        "1",
        "--rdzv-last-call",
        "1",
    ];
    live_launcher(dir, node, port, token, &launcher_args, extra, ENV)
}

/// A whole host lost, a spare waiting: nodes 0 and 1 (`--nnodes 2:3 --recover live`) form the
/// round, node 2 arrives while it runs and waits as a spare (under live recovery a running
/// round does not restart to admit it). Before step 5, node 1's rank SIGKILLs node 1's
/// launcher (the rank dies with it): the rendezvous host hands node 1 over to the spare, whose
/// launcher starts rank 1 as a replacement in the running group; rank 0 never stops. Nodes 0
/// and 2 exit 0, and both ranks end bitwise as the two-launcher job never killed.
#[test]
fn a_lost_host_is_replaced_live_by_a_spare_launcher() {
    a_spare_takes_the_lost_host_over(&[]);
}

/// The same with the optimizer state sharded (ZeRO-1): rank 1's shard comes back from rank 0's
/// copy, across the emulated hosts, bitwise.
#[test]
fn a_lost_host_with_a_sharded_optimizer_is_replaced_live_by_a_spare_launcher() {
    a_spare_takes_the_lost_host_over(&["--sharded"]);
}

/// The spare's case with the worker's `optimizer` arguments (the job never killed has them
/// too).
fn a_spare_takes_the_lost_host_over(optimizer: &[&str]) {
    use std::os::unix::process::ExitStatusExt;
    let straight = tempfile::tempdir().unwrap();
    let (ended, all) = two_launchers(straight.path(), optimizer, "1", ENV);
    assert!(ended.iter().all(|e| e.status.success()), "{all}");
    let victim = [
        optimizer,
        &["--victim", "1", "--kill-launcher-at-step", "5"],
    ]
    .concat();
    let dir = tempfile::tempdir().unwrap();
    let (port, token) = (
        ddp_testkit::free_port().to_string(),
        ddp_testkit::job_token(),
    );
    let mut launched: Vec<_> = (0..2)
        .map(|node| elastic_launcher(dir.path(), node, &port, &token, &victim))
        .collect();
    // The round closes after the last call (1 s) with nodes 0 and 1; then the spare comes, and
    // is given time to join (a few milliseconds when the machine is idle; CI runs tests side
    // by side).
    std::thread::sleep(Duration::from_secs(4));
    launched.push(elastic_launcher(dir.path(), 2, &port, &token, &victim));
    std::thread::sleep(Duration::from_secs(3));
    std::fs::write(dir.path().join("kill-launcher-now"), b"").unwrap();
    let ended: Vec<_> = launched
        .into_iter()
        .map(|l| l.wait_for(Duration::from_secs(120)))
        .collect();
    let all = ended
        .iter()
        .enumerate()
        .map(|(n, e)| format!("node {n} ({}):\n{}\n{}", e.status, e.stdout, e.stderr))
        .collect::<Vec<_>>()
        .join("\n");
    // (The victim's own line went down with its launcher, which copied its output.)
    assert!(
        all.contains("rank 0: lost a peer in step 5") && all.contains("RECOVERED rank=1 step=5"),
        "{all}"
    );
    assert_eq!(
        ended[1].status.signal(),
        Some(9),
        "node 1's launcher was killed\n{all}"
    );
    assert!(
        ended[0].status.success() && ended[2].status.success(),
        "node 0 and the spare exit 0\n{all}"
    );
    assert!(
        all.contains("replaced live on node 2")
            && all.contains("takes over node 1 of round 0")
            && !all.contains("restarting the group"),
        "{all}"
    );
    two_ranks_end_as_never_killed_and_leave_nothing(straight.path(), dir.path(), &all);
}

/// Ranks 0 and 1 wrote the parameters of the job never killed (`straight`) into `dir`, and the
/// job's processes (named in `all`, everything the launchers printed) left nothing behind.
fn two_ranks_end_as_never_killed_and_leave_nothing(straight: &Path, dir: &Path, all: &str) {
    for r in 0..2 {
        let read = |d: &Path| std::fs::read(d.join(format!("rank{r}.f32"))).unwrap();
        assert!(
            read(straight) == read(dir),
            "rank {r}: the parameters differ from the job never killed\n{all}"
        );
    }
    let left = leftover_segments(&job_pids(all));
    assert!(left.is_empty(), "left behind: {left:?}\n{all}");
}
