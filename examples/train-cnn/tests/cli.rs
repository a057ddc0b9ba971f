//! Runs the `train-cnn` binary single-process with tiny settings and checks its outputs.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use train_cnn::metrics::read_json;

/// Runs the binary with a deadline; kills it if it overruns.
fn run(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_train-cnn"))
        .args(args)
        .env_remove("WORLD_SIZE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn train-cnn");
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "train-cnn overran its deadline; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn tiny_args(out: &Path, epochs: &str) -> Vec<String> {
    [
        "--train-size",
        "480",
        "--eval-size",
        "120",
        "--batch-size",
        "16",
        "--channels",
        "4,8,8",
        "--lr",
        "0.05",
        "--epochs",
        epochs,
        "--seed",
        "3",
        "--no-progress",
        "--out",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([out.display().to_string()])
    .collect()
}

#[test]
fn trains_writes_metrics_plot_checkpoint_and_loss_falls() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let args = tiny_args(&out, "3");
    let o = run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for f in [
        "metrics.csv",
        "metrics.json",
        "curves.svg",
        "checkpoint.bin",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let history = read_json(&out.join("metrics.json")).unwrap();
    assert_eq!(history.len(), 3);
    assert!(
        history[2].train_loss < history[0].train_loss,
        "loss did not fall: {history:?}"
    );
    assert!(
        history
            .iter()
            .all(|m| (0.0..=1.0).contains(&m.eval_accuracy))
    );
    let csv = std::fs::read_to_string(out.join("metrics.csv")).unwrap();
    assert_eq!(csv.lines().count(), 4);
    // The table and the final line saying where everything is.
    assert!(stdout.contains("eval acc"), "{stdout}");
    let last = stdout.lines().last().unwrap();
    assert!(last.starts_with("done: 3 epochs"), "{last}");
    assert!(
        last.contains(&out.join("curves.svg").display().to_string()),
        "{last}"
    );

    // Resume to 4 epochs: one more row, the first three unchanged.
    let args = tiny_args(&out, "4");
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.push("--resume");
    let o = run(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let resumed = read_json(&out.join("metrics.json")).unwrap();
    assert_eq!(resumed.len(), 4);
    assert_eq!(&resumed[..3], &history[..]);
}

#[test]
fn bad_arguments_fail_with_one_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().display().to_string();
    let cases: [(&[&str], &str); 4] = [
        (&["--data", "cifar", "--out", &out], "unknown data source"),
        (
            &["--data", "mnist:/nonexistent", "--out", &out],
            "/nonexistent/train-images-idx3-ubyte",
        ),
        (
            &[
                "--resume",
                "--out",
                &out,
                "--train-size",
                "64",
                "--eval-size",
                "16",
            ],
            "checkpoint.bin",
        ),
        (&["--batch-size", "0", "--out", &out], "--batch-size"),
    ];
    for (args, needle) in cases {
        let o = run(args);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn trains_on_mnist_format_files() {
    use train_cnn::data::ImageSet;
    use train_cnn::data::mnist::write_idx;
    use train_cnn::data::synthetic::{Split, SyntheticImages};
    // Write a small IDX dataset (synthetic images quantised to bytes).
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("mnist");
    std::fs::create_dir(&data).unwrap();
    for (split, n, names) in [
        (
            Split::Train,
            160,
            ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        ),
        (
            Split::Eval,
            40,
            ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
        ),
    ] {
        let ds = SyntheticImages::new(1, split, n);
        let mut px = Vec::new();
        let mut lb = Vec::new();
        for i in 0..n {
            let it = ds.item(i);
            px.extend(
                it.pixels
                    .iter()
                    .map(|&p| ((p + 1.5) * 60.0).clamp(0.0, 255.0) as u8),
            );
            lb.push(it.label as u8);
        }
        write_idx(&data.join(names.0), &[n, 28, 28], &px).unwrap();
        write_idx(&data.join(names.1), &[n], &lb).unwrap();
    }
    let out = dir.path().join("out");
    let spec = format!("mnist:{}", data.display());
    let o = run(&[
        "--data",
        &spec,
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--channels",
        "4,8",
        "--no-progress",
        "--out",
        &out.display().to_string(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("160 train / 40 eval images of 28×28"),
        "{stdout}"
    );
    assert_eq!(read_json(&out.join("metrics.json")).unwrap().len(), 1);
}
