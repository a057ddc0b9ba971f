//! The hang doctor, end to end: real `ddprun` launches of `hang_worker` (CPU ranks), one
//! launcher and two (emulated hosts), a rank misbehaving in each way the doctor must name —
//! asleep in its data loader, spinning in its forward, deadlocked on its own mutexes, stopped
//! by SIGSTOP, skipping a collective, calling an extra one, three times slower than the others —
//! and a SIGUSR1 dump during a healthy run. Each hang verdict must name the rank, its phase
//! and the collective the others wait in, within `--hang-after` + 2 s of the hang, while every
//! rank is alive; the straggler's run completes with exit 0.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// `--hang-after` of every hang test.
const HANG_AFTER_S: f64 = 2.0;
/// How long a test waits for a verdict before it fails.
const VERDICT_WAIT: Duration = Duration::from_secs(60);

fn worker() -> PathBuf {
    ddp_testkit::bundled(env!("CARGO_BIN_EXE_hang_worker"))
}

fn ddprun() -> PathBuf {
    worker().with_file_name("ddprun")
}

fn unix_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        * 1e3
}

/// A `ddprun` whose stdout and stderr lines arrive, stamped, on a channel; killed and reaped
/// when dropped.
struct Launcher {
    child: Child,
    lines: mpsc::Receiver<(f64, String)>,
    seen: Vec<(f64, String)>,
}

impl Launcher {
    fn spawn(cmd: &mut Command) -> Launcher {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start ddprun");
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        for stream in [
            Box::new(out) as Box<dyn std::io::Read + Send>,
            Box::new(err),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = tx.send((unix_ms(), line));
                }
            });
        }
        Launcher {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The first line containing `needle` (and when it came), waiting up to `limit`.
    fn wait_line(&mut self, needle: &str, limit: Duration) -> Option<(f64, String)> {
        if let Some(l) = self.seen.iter().find(|(_, l)| l.contains(needle)) {
            return Some(l.clone());
        }
        let deadline = Instant::now() + limit;
        while let Ok(l) = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            self.seen.push(l.clone());
            if l.1.contains(needle) {
                return Some(l);
            }
        }
        None
    }

    /// Waits up to `limit` for the launcher to exit; then every line it wrote.
    fn wait(mut self, limit: Duration) -> (Option<ExitStatus>, String) {
        let deadline = Instant::now() + limit;
        let status = loop {
            match self.child.try_wait().unwrap() {
                Some(s) => break Some(s),
                None if Instant::now() >= deadline => break None,
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        // The pumps end with the streams.
        let drain = Instant::now() + Duration::from_secs(5);
        while let Ok(l) = self
            .lines
            .recv_timeout(drain.saturating_duration_since(Instant::now()))
        {
            self.seen.push(l);
        }
        let text = self
            .seen
            .iter()
            .map(|(_, l)| l.as_str())
            .collect::<Vec<_>>()
            .join("\n");
        (status, text)
    }

    /// SIGTERM (the ranks get it, then SIGKILL after the grace), then [`Self::wait`].
    fn stop(self) -> (Option<ExitStatus>, String) {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.wait(Duration::from_secs(30))
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One `ddprun --nproc-per-node 3` of `hang_worker` with `worker_args`.
fn one_launcher(launcher_args: &[&str], worker_args: &[&str]) -> Launcher {
    Launcher::spawn(
        Command::new(ddprun())
            .args(["--nproc-per-node", "3", "--grace-secs", "2"])
            .args(launcher_args)
            .arg("--")
            .arg(worker())
            .args(worker_args)
            .env("DDP_TIMEOUT_SECS", "60")
            .env("BURN_DEVICE", "flex"),
    )
}

/// Runs scenario `scenario` on one launcher until its hang verdict; checks the verdict's
/// timing against the victim's `HANG-START` and returns the verdict line.
fn hang_verdict(scenario: &str, extra: &[&str]) -> String {
    let hang_after = HANG_AFTER_S.to_string();
    let mut worker_args = vec!["--scenario", scenario, "--checkpoint-ms", "600000"];
    worker_args.extend_from_slice(extra);
    let mut job = one_launcher(&["--hang-after", &hang_after], &worker_args);
    let (started, start_line) = job
        .wait_line("HANG-START", VERDICT_WAIT)
        .unwrap_or_else(|| panic!("{scenario}: the victim never misbehaved"));
    let verdict = job.wait_line("ddprun: hang at step", VERDICT_WAIT);
    // The stack was taken and the rank let go: it is not held by its launcher any more.
    let victim = start_line
        .rsplit_once("pid=")
        .and_then(|(_, p)| p.trim().parse::<u32>().ok())
        .expect("the victim's pid");
    let status = std::fs::read_to_string(format!("/proc/{victim}/status")).unwrap_or_default();
    assert!(
        status.contains("TracerPid:\t0"),
        "{scenario}: rank process {victim} is still traced after the verdict:\n{status}"
    );
    let (status, text) = job.stop();
    let (at, line) = verdict.unwrap_or_else(|| panic!("{scenario}: no hang verdict:\n{text}"));
    let late = (at - started) / 1e3;
    assert!(
        late <= HANG_AFTER_S + 2.0,
        "{scenario}: the verdict came {late:.2} s after the hang (limit {} s):\n{text}",
        HANG_AFTER_S + 2.0
    );
    assert!(
        !status.expect("ddprun exits after SIGTERM").success(),
        "{scenario}: a hung job stopped by SIGTERM must not exit 0:\n{text}"
    );
    assert_eq!(
        text.matches("ddprun: hang at step").count(),
        1,
        "{scenario}: one verdict per incident:\n{text}"
    );
    line
}

fn assert_has(line: &str, parts: &[&str]) {
    for p in parts {
        assert!(line.contains(p), "missing {p:?} in:\n{line}");
    }
}

#[test]
fn a_rank_asleep_in_its_data_loader_is_named_with_its_phase_and_place() {
    let line = hang_verdict("data-sleep", &[]);
    assert_has(
        &line,
        &[
            "ddprun: hang at step 3: ranks 0,2 wait in all_reduce #",
            "(gradient presence of step 3)",
            "rank 1 never called it: in phase data of step 3 for ",
            "at load_batch (src/bin/hang_worker.rs:",
        ],
    );
}

#[test]
fn a_rank_spinning_in_its_forward_is_named_with_its_phase_and_place() {
    let line = hang_verdict("compute-loop", &[]);
    assert_has(
        &line,
        &[
            "ranks 0,2 wait in all_reduce #",
            "rank 1 never called it: in phase forward of step 3",
            "at forward_work (src/bin/hang_worker.rs:",
        ],
    );
}

#[test]
fn a_rank_deadlocked_on_its_own_mutexes_is_located() {
    let line = hang_verdict("deadlock", &["--victim", "2"]);
    assert_has(
        &line,
        &[
            "ranks 0,1 wait in all_reduce #",
            "rank 2 never called it: in phase forward of step 3",
            "at deadlock (src/bin/hang_worker.rs:",
        ],
    );
}

#[test]
fn a_stopped_rank_is_named_silent_and_stopped() {
    let line = hang_verdict("sigstop", &["--victim", "0"]);
    assert_has(
        &line,
        &[
            "ranks 1,2 wait in all_reduce #",
            "rank 0 silent: its last report is ",
            "its process is stopped (SIGSTOP, a debugger)",
        ],
    );
}

#[test]
fn a_rank_that_skips_a_collective_is_named_with_the_collective_it_skipped() {
    let line = hang_verdict("skip", &[]);
    assert_has(
        &line,
        &[
            "ranks 0,2 wait in all_reduce #",
            "(evaluation loss of step 10)",
            "rank 1 never called it: in phase checkpoint of step 10",
        ],
    );
}

#[test]
fn a_rank_that_calls_an_extra_collective_is_the_one_blamed() {
    let line = hang_verdict("extra", &[]);
    assert_has(
        &line,
        &[
            "rank 1 waits in all_reduce #",
            "(evaluation loss of step 10)",
            "rank 0 never called it: in phase checkpoint",
            "rank 2 never called it: in phase checkpoint",
            "(rank 1 called a collective the others did not)",
        ],
    );
}

#[test]
fn a_rank_three_times_slower_is_warned_about_and_the_job_completes() {
    let job = one_launcher(
        &[],
        &["--scenario", "slow", "--steps", "14", "--work-ms", "30"],
    );
    let (status, text) = job.wait(Duration::from_secs(120));
    assert!(status.expect("the job ends").success(), "{text}");
    let warnings: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("ddprun: warning: straggler"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning per incident:\n{text}");
    assert_has(
        warnings[0],
        &["rank 1's own work takes ", "most of it in phase forward"],
    );
    assert!(!text.contains("hang at step"), "{text}");
}

/// The `END` lines of a finished run, sorted.
fn ends(text: &str) -> Vec<String> {
    let mut v: Vec<String> = text
        .lines()
        .filter_map(|l| l.split_once("END ").map(|(_, e)| e.to_string()))
        .collect();
    v.sort();
    v
}

#[test]
fn a_dump_on_sigusr1_leaves_a_healthy_run_bitwise_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let dumps = dir.path().join("dumps");
    let args = ["--scenario", "healthy", "--steps", "40", "--work-ms", "25"];
    let plain = one_launcher(&[], &args).wait(Duration::from_secs(120));
    assert!(plain.0.expect("ends").success(), "{}", plain.1);
    let mut job = one_launcher(&["--dump-on-hang", dumps.to_str().unwrap()], &args);
    job.wait_line("STEP 8", VERDICT_WAIT)
        .expect("training runs");
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(job.child.id() as i32, libc::SIGUSR1) };
    let (status, text) = job.wait(Duration::from_secs(120));
    assert!(status.expect("ends").success(), "{text}");
    assert_eq!(ends(&text).len(), 3, "{text}");
    assert_eq!(
        ends(&text),
        ends(&plain.1),
        "a dump changed the run:\n{text}"
    );
    assert_has(
        &text,
        &["ddprun: wrote the flight recorders of 3 rank(s) to "],
    );
    let read = ddp_doctor_read(&dumps);
    assert_eq!(read.0.code(), Some(0), "{}", read.1);
    assert_has(
        &read.1,
        &[
            "3 rank(s); as of the dump:",
            "rank 0: ",
            "rank 2: ",
            "verdict: no hang",
        ],
    );
    let empty = ddp_doctor_read(dir.path().join("nothing-here").as_path());
    assert_eq!(empty.0.code(), Some(2), "{}", empty.1);
}

#[test]
fn a_job_that_died_leaves_a_dump_the_doctor_reads() {
    let dir = tempfile::tempdir().unwrap();
    let dumps = dir.path().join("dumps");
    let job = one_launcher(
        &["--dump-on-hang", dumps.to_str().unwrap()],
        &["--scenario", "fail", "--at-step", "4"],
    );
    let (status, text) = job.wait(Duration::from_secs(120));
    assert!(!status.expect("the job ends").success(), "{text}");
    assert_has(
        &text,
        &["ddprun: wrote the flight recorders of 3 rank(s) to "],
    );
    let verdicts: Vec<String> = std::fs::read_dir(&dumps)
        .unwrap()
        .flatten()
        .filter_map(|d| std::fs::read_to_string(d.path().join("verdict.txt")).ok())
        .collect();
    assert_eq!(verdicts.len(), 1, "one dump for the failure: {verdicts:?}");
    assert_has(&verdicts[0], &["failed: ", "rank 1"]);
    let (code, report) = ddp_doctor_read(&dumps);
    assert_eq!(code.code(), Some(0), "{report}");
    assert_has(
        &report,
        &["3 rank(s); as of the dump:", "rank 1: ", "(process exited)"],
    );
}

/// `ddprun doctor DIR`: its status and stdout + stderr.
fn ddp_doctor_read(dir: &Path) -> (ExitStatus, String) {
    let out = Command::new(ddprun())
        .arg("doctor")
        .arg(dir)
        .output()
        .expect("run ddprun doctor");
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status, text)
}

/// Two launchers (one rank each, emulated hosts) of `scenario`, rank 1 (node 1's) the victim,
/// until node 1's verdict: checks its timing, that node 0 tells none, and that both nodes
/// exit non-zero once node 1's launcher is stopped; returns the verdict.
fn two_launchers_verdict(scenario: &str) -> String {
    let port = ddp_testkit::free_port().to_string();
    let token = ddp_testkit::job_token();
    let hang_after = HANG_AFTER_S.to_string();
    let node = |n: usize| {
        Launcher::spawn(
            Command::new(ddprun())
                .args(["--nnodes", "2", "--node-rank", &n.to_string()])
                .args(["--nproc-per-node", "1", "--master-port", &port])
                .args(["--grace-secs", "2", "--hang-after", &hang_after])
                .arg("--")
                .arg(worker())
                .args(["--scenario", scenario, "--checkpoint-ms", "0"])
                .env("DDP_TIMEOUT_SECS", "60")
                .env("BURN_DEVICE", "flex")
                .env("DDP_JOB_TOKEN", &token)
                .env("DDP_HOST_ID", format!("emulated-host-{n}")),
        )
    };
    let mut node0 = node(0);
    let mut node1 = node(1);
    let (started, _) = node1
        .wait_line("HANG-START", VERDICT_WAIT)
        .expect("rank 1 misbehaves");
    let verdict = node1.wait_line("ddprun: hang at step", VERDICT_WAIT);
    // Node 0 has no culprit: it tells nothing (give it the same time).
    let quiet = node0.wait_line("ddprun: hang at step", Duration::from_secs(1));
    let (s1, t1) = node1.stop();
    let (s0, t0) = node0.wait(Duration::from_secs(30));
    let (at, line) =
        verdict.unwrap_or_else(|| panic!("{scenario}: no verdict on node 1:\n{t1}\nnode 0:\n{t0}"));
    assert!((at - started) / 1e3 <= HANG_AFTER_S + 2.0, "{t1}");
    assert!(quiet.is_none(), "node 0 told a verdict too:\n{t0}");
    assert!(
        !t0.contains("hang at step"),
        "node 0 told a verdict too, later:\n{t0}"
    );
    assert!(!s1.expect("node 1 ends").success(), "{t1}");
    assert!(!s0.expect("node 0 ends").success(), "{t0}");
    line
}

#[test]
fn on_two_launchers_the_node_of_the_stuck_rank_tells_the_verdict_with_its_stack() {
    let line = two_launchers_verdict("data-sleep");
    assert_has(
        &line,
        &[
            "rank 0 waits in all_reduce #",
            "(gradient presence of step 3)",
            "rank 1 never called it: in phase data of step 3",
            "at load_batch (src/bin/hang_worker.rs:",
        ],
    );
}

#[test]
fn on_two_launchers_a_stopped_rank_is_named_stopped_by_its_node() {
    let line = two_launchers_verdict("sigstop");
    assert_has(
        &line,
        &[
            "rank 0 waits in all_reduce #",
            "rank 1 silent: its last report is ",
            "its process is stopped (SIGSTOP, a debugger)",
        ],
    );
}
