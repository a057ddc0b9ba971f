//! `cargo xtask train` end to end: the real xtask binary launches two CPU ranks of the
//! `train-cnn` example through the launcher library (small settings), under a deadline.
//!
//! It runs the debug `train-cnn` that `cargo test --workspace` builds beside the xtask binary
//! (`--program`), and builds it first only when it is missing, so the test does not start a
//! release build of its own.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(420);

/// The `train-cnn` binary next to this test's xtask binary, built if absent.
fn train_cnn() -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_xtask")).parent().unwrap();
    let exe = dir.join(format!("train-cnn{}", std::env::consts::EXE_SUFFIX));
    if !exe.is_file() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "-p", "train-cnn", "--bin", "train-cnn"])
            .status()
            .expect("run cargo build");
        assert!(status.success(), "building train-cnn failed");
    }
    exe
}

#[test]
fn cargo_xtask_train_on_two_cpu_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let program = train_cnn();
    let mut child = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args([
            "train",
            "--cpus",
            "2",
            "--epochs",
            "2",
            "--batch-size",
            "16",
        ])
        .arg("--program")
        .arg(&program)
        .arg("--out")
        .arg(&out)
        .args(["--", "--train-size", "640", "--eval-size", "160"])
        .args(["--channels", "4,8,8", "--no-progress"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn xtask");
    let start = Instant::now();
    // Ranks die with the launcher (parent-death signal), so killing xtask reaps everything.
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("cargo xtask train overran its {DEADLINE:?} deadline");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let res = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&res.stdout);
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "xtask failed:\n{stdout}\n{stderr}");
    assert!(
        stderr.contains("xtask: all 2 ranks exited 0"),
        "both ranks must exit 0:\n{stderr}"
    );
    let text = std::fs::read_to_string(out.join("metrics.json")).expect("metrics.json written");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rows = v
        .as_array()
        .or_else(|| v.get("epochs").and_then(|e| e.as_array()))
        .expect("epoch rows");
    assert_eq!(rows.len(), 2, "{text}");
    let loss = |i: usize| rows[i]["train_loss"].as_f64().unwrap();
    assert!(loss(1) < loss(0), "the loss must fall: {text}");
    for f in ["metrics.csv", "curves.svg", "checkpoint.bin"] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
}
