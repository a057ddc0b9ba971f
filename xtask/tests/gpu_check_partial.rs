//! `gpu-check run` cut short, on a machine without a GPU: the real xtask binary over a bundle
//! whose CPU row's programs are shell scripts. Killed in the middle of a row (what the GPU
//! machine's time limit does), it has already printed every row it finished and left them in
//! `$OUT/gpu-check-summary.md`, titled PARTIAL; with its budget spent, the rows that no longer
//! fit are SKIPPED in a complete table.
//!
//! No GPU is needed or used: without libcuda every CUDA row fails at once (with libcuda and
//! these bundles, whose CUDA programs are absent, they are MISSING at once), so only the CPU
//! row runs a program.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Every wait of these tests ends by then.
const DEADLINE: Duration = Duration::from_secs(90);

fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// A bundle folder whose archive holds `files` (xz preset 1: the tests need no small archive).
fn bundle(dir: &Path, files: &[PathBuf]) -> PathBuf {
    let out = dir.join(".gpu-bin");
    std::fs::create_dir_all(&out).unwrap();
    let xz =
        liblzma::write::XzEncoder::new(std::fs::File::create(out.join("bins.tar.xz")).unwrap(), 1);
    let mut tar = tar::Builder::new(xz);
    for f in files {
        tar.append_path_with_name(f, f.file_name().unwrap())
            .unwrap();
    }
    tar.into_inner().unwrap().finish().unwrap().flush().unwrap();
    out
}

/// `xtask gpu-check run` over `bundle` with `OUT=out`, its stderr lines sent to the receiver.
fn run(dir: &Path, bundle: &Path, out: &Path, budget: u32) -> (Child, mpsc::Receiver<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["gpu-check", "run", "--bundle"])
        .arg(bundle)
        .arg("--bin-dir")
        .arg(dir.join("bin"))
        .arg("--log-dir")
        .arg(dir.join("logs"))
        .arg("--gl")
        .arg(dir.join("no-gl"))
        .args(["--budget-secs", &budget.to_string()])
        .env("OUT", out)
        .env_remove("GPU_CHECK_BUDGET")
        .env_remove("GPU_CHECK_BIN_DIR")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn xtask gpu-check run");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// The progress lines (`gpu-check: [N] STATUS …`) among `lines`.
fn progress(lines: &[String]) -> Vec<&String> {
    lines
        .iter()
        .filter(|l| l.starts_with("gpu-check: [") && l.contains("] "))
        .collect()
}

/// The table rows of a summary (`| label | result | …`, without the heading and the rule).
fn table_rows(summary: &str) -> Vec<&str> {
    summary
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| check "))
        .collect()
}

/// Kills the run and the CPU row's hanging program (whose pid the script wrote) however the
/// test ends, so that a failing assertion leaves no process behind.
struct Reap<'a> {
    child: &'a mut Child,
    pid_file: &'a Path,
}

impl Drop for Reap<'_> {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(pid) = std::fs::read_to_string(self.pid_file)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            // SAFETY: kill(2) on the pid the script wrote (its `exec`ed sleep), nothing else.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

#[test]
fn a_run_killed_in_the_middle_of_a_row_leaves_the_rows_it_finished() {
    let tmp = tempfile::tempdir().unwrap();
    let progs = tmp.path().join("progs");
    std::fs::create_dir_all(&progs).unwrap();
    // The CPU row's launcher: says it started, then hangs like a row the limit cuts short.
    let pid_file = tmp.path().join("ddprun.pid");
    let ddprun = script(
        &progs,
        "ddprun",
        &format!("echo $$ > {}\nexec sleep 120\n", pid_file.display()),
    );
    let bench = script(&progs, "allreduce_bench", "exit 0\n");
    let b = bundle(tmp.path(), &[ddprun, bench]);
    let out = tmp.path().join("out");
    let (mut child, rx) = run(tmp.path(), &b, &out, 60);
    let reap = Reap {
        child: &mut child,
        pid_file: &pid_file,
    };

    let start = Instant::now();
    let mut lines = Vec::new();
    while !pid_file.is_file() {
        assert!(
            start.elapsed() < DEADLINE,
            "the CPU row never started: {lines:#?}"
        );
        if let Some(status) = reap.child.try_wait().unwrap() {
            panic!("gpu-check run ended ({status}) before the CPU row: {lines:#?}");
        }
        lines.extend(rx.try_iter());
        std::thread::sleep(Duration::from_millis(50));
    }
    // Mid-row: every earlier row has ended and was printed; now the machine's limit strikes.
    std::thread::sleep(Duration::from_millis(300));
    drop(reap);
    lines.extend(rx.iter().take_while(|_| start.elapsed() < DEADLINE));

    let printed = progress(&lines);
    assert!(!printed.is_empty(), "no row printed: {lines:#?}");
    let summary = std::fs::read_to_string(out.join("gpu-check-summary.md"))
        .expect("the partial table under $OUT");
    let n = printed.len();
    assert!(
        summary.contains(&format!("of a 60 s budget; PARTIAL: {n} rows so far")),
        "{summary}"
    );
    let rows = table_rows(&summary);
    assert_eq!(rows.len(), n, "{summary}");
    for (i, (row, line)) in rows.iter().zip(&printed).enumerate() {
        let label = row.split('|').nth(1).unwrap().trim();
        assert!(
            line.starts_with(&format!("gpu-check: [{}] ", i + 1)) && line.contains(label),
            "{row} vs {line}"
        );
    }
    assert!(
        !summary.contains("CPU all-reduce"),
        "the row cut short is not in the table: {summary}"
    );
    assert!(out.join("gpu-check-logs.txt").is_file());
}

#[test]
fn a_spent_budget_skips_the_rows_that_no_longer_fit_and_ends_the_table() {
    let tmp = tempfile::tempdir().unwrap();
    let progs = tmp.path().join("progs");
    std::fs::create_dir_all(&progs).unwrap();
    let ran = tmp.path().join("ran");
    let ddprun = script(&progs, "ddprun", &format!("touch {}\n", ran.display()));
    let bench = script(&progs, "allreduce_bench", "exit 0\n");
    let b = bundle(tmp.path(), &[ddprun, bench]);
    let out = tmp.path().join("out");
    // 19 s: less than the 20 s a row needs to start.
    let (mut child, rx) = run(tmp.path(), &b, &out, 19);
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("gpu-check run overran {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let lines: Vec<String> = rx.iter().collect();
    assert!(!status.success(), "the CUDA rows fail or are missing here");
    assert!(!ran.exists(), "no program ran after the budget was spent");
    let summary = std::fs::read_to_string(out.join("gpu-check-summary.md")).unwrap();
    assert!(!summary.contains("PARTIAL"), "{summary}");
    let cpu = table_rows(&summary)
        .into_iter()
        .find(|r| r.contains("CPU all-reduce"))
        .unwrap_or_else(|| panic!("{summary}"));
    assert!(
        cpu.contains("SKIPPED") && cpu.contains("time budget spent"),
        "{cpu}"
    );
    assert_eq!(progress(&lines).len(), table_rows(&summary).len());
}
