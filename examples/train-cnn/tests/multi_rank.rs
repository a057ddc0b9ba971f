//! Real multi-process runs: two `train-cnn` rank processes on loopback (torchrun-style launch
//! variables set by the test), each with a deadline after which it is killed.

use std::path::Path;
use std::time::{Duration, Instant};

use ddp_testkit::{JobResult, RankJob};

use train_cnn::checkpoint::{Checkpoint, parameter_values};
use train_cnn::metrics::read_json;

const DEADLINE: Duration = Duration::from_secs(300);

/// `world` ranks of train-cnn with `args` (ddp-testkit's runner: torchrun's variables, a free
/// port and a fresh token, one deadline, every rank killed and reaped past it).
fn job(world: usize, args: &[String]) -> RankJob {
    RankJob::new(env!("CARGO_BIN_EXE_train-cnn"), world)
        .args(args)
        .envs(&[("RAYON_NUM_THREADS", "1"), ("OMP_NUM_THREADS", "1")])
        .deadline(DEADLINE)
}

/// Runs `job` to the end.
fn run(job: RankJob) -> JobResult {
    job.run().expect("spawn the ranks")
}

fn args(out: &Path, epochs: usize) -> Vec<String> {
    let s = format!(
        "--train-size 640 --eval-size 160 --batch-size 16 --channels 4,8,8 --lr 0.05 --seed 5 \
         --no-progress --epochs {epochs} --out {}",
        out.display()
    );
    s.split(' ').map(String::from).collect()
}

#[test]
fn two_ranks_train_and_only_rank_zero_reports() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let results = run(job(2, &args(&out, 2)));
    for r in &results.ranks {
        assert!(r.success(), "rank {} failed: {}", r.rank, r.stderr);
    }
    let out0 = &results.rank(0).stdout;
    let out1 = &results.rank(1).stdout;
    assert!(out0.contains("2 ranks × batch 16"), "{out0}");
    assert!(
        out0.lines().last().unwrap().starts_with("done: 2 epochs"),
        "{out0}"
    );
    assert!(out1.trim().is_empty(), "rank 1 printed: {out1}");
    let h = read_json(&out.join("metrics.json")).unwrap();
    assert_eq!(h.len(), 2);
    assert!(h[1].train_loss < h[0].train_loss, "{h:?}");
    let ck = Checkpoint::read(&out.join("checkpoint.bin")).unwrap();
    assert_eq!(ck.world_size, 2);
    assert_eq!(ck.progress.epochs_done, 2);
}

/// `--shard-optimizer` (ZeRO stage 1): two ranks with the optimizer state sharded end with
/// bitwise the parameters of the unsharded run, and their timelines (`DDP_TRACE`) show the
/// sharded step: the gradient sync to the owners (on one host an all-reduce, each rank keeping
/// its own) and the updated parameters all-gathered from them (the CNN's parameters are all
/// small, so they travel in buckets).
#[test]
fn two_ranks_with_the_optimizer_state_sharded_train_as_unsharded() {
    let dir = tempfile::tempdir().unwrap();
    let (plain, sharded, trace) = (
        dir.path().join("plain"),
        dir.path().join("sharded"),
        dir.path().join("trace"),
    );
    run(job(2, &args(&plain, 2))).assert_success();
    let mut sharded_args = args(&sharded, 2);
    sharded_args.push("--shard-optimizer".into());
    run(job(2, &sharded_args).env("DDP_TRACE", trace.display().to_string())).assert_success();
    let values = |out: &Path| {
        parameter_values(&Checkpoint::read(&out.join("checkpoint.bin")).unwrap()).unwrap()
    };
    let (p, s) = (values(&plain), values(&sharded));
    assert_eq!(p.len(), s.len());
    assert!(
        p.iter().zip(&s).all(|(a, b)| a.to_bits() == b.to_bits()),
        "the sharded run's parameters differ from the unsharded run's"
    );
    for r in 0..2 {
        let file = trace.join(format!("rank-{r}.trace.json"));
        let text =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for span in ["all_reduce", "all_gather_into"] {
            assert!(
                text.contains(&format!("\"name\":\"{span}\"")),
                "rank {r}'s timeline has no {span} span"
            );
        }
        assert!(
            text.contains("\"to_owners\":true"),
            "rank {r}'s timeline has no gradient sync to the owners"
        );
    }
}

/// Rank 0 cannot write its checkpoint (the path is a directory): both ranks stop with an error
/// that names the file (rank 1 gets rank 0's error), instead of rank 1 training on alone or
/// waiting for a peer that has left.
#[test]
fn a_checkpoint_rank_zero_cannot_write_stops_every_rank_with_its_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    std::fs::create_dir_all(out.join("checkpoint.bin/in-the-way")).unwrap();
    let results = run(job(2, &args(&out, 1)));
    for res in &results.ranks {
        let (r, err) = (res.rank, &res.stderr);
        assert!(!res.success(), "rank {r} succeeded");
        assert!(err.contains("train-cnn: error: "), "rank {r}: {err}");
        assert!(err.contains("checkpoint.bin"), "rank {r}: {err}");
        assert!(!err.contains("panicked"), "rank {r}: {err}");
    }
    let err1 = &results.rank(1).stderr;
    assert!(err1.contains("on rank 0:"), "{err1}");
}

#[test]
fn a_killed_rank_stops_the_run_and_leaves_a_resumable_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let start = Instant::now();
    let mut running = job(2, &args(&out, 6)).spawn().expect("spawn the ranks");
    // Wait for the first checkpoint, then kill rank 1 during the next epoch.
    let ck_path = out.join("checkpoint.bin");
    while !ck_path.exists() {
        assert!(
            start.elapsed() < DEADLINE,
            "no checkpoint before the deadline"
        );
        let exited = running.exited();
        assert!(exited.is_empty(), "a rank exited early: {exited:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    running.kill(1).unwrap();
    let results = running.wait();
    let r0 = results.rank(0);
    let err0 = &r0.stderr;
    assert!(!r0.success(), "rank 0 succeeded although rank 1 was killed");
    assert!(err0.contains("train-cnn: error"), "{err0}");
    assert!(!err0.contains("panicked"), "{err0}");

    // The checkpoint is intact and a single process resumes from it.
    let ck = Checkpoint::read(&ck_path).unwrap();
    let done = ck.progress.epochs_done as usize;
    assert!(done >= 1);
    let mut a = args(&out, done + 1);
    a.push("--resume".into());
    let results = run(job(1, &a));
    assert!(results.success(), "resume failed: {}", results.report());
    assert_eq!(
        read_json(&out.join("metrics.json")).unwrap().len(),
        done + 1
    );
}

/// Built with CUDA: ranks that can't get a GPU stop with one readable error each, before any
/// work. Without a driver (CI) the error says `libcuda not found`; on a GPU machine
/// `CUDA_VISIBLE_DEVICES=` hides every device, and the error says so.
#[cfg(feature = "cuda")]
#[test]
fn without_a_usable_gpu_every_rank_says_so_and_fails() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut a = args(&out, 1);
    a.extend(["--backend".to_string(), "cuda".to_string()]);
    let start = Instant::now();
    let results = run(job(2, &a).env("CUDA_VISIBLE_DEVICES", ""));
    for res in &results.ranks {
        let (r, err) = (res.rank, &res.stderr);
        assert!(!res.success(), "rank {r} succeeded without a GPU");
        assert_eq!(
            err.matches("train-cnn: error").count(),
            1,
            "rank {r}: {err}"
        );
        assert!(
            err.contains("train-cnn: error: distributed: no usable device for this rank:"),
            "rank {r}: {err}"
        );
        assert!(
            err.contains("libcuda not found") || err.contains("no CUDA device is visible"),
            "rank {r}: {err}"
        );
        assert!(!err.contains("panicked"), "rank {r}: {err}");
    }
    // Before any work: no output was written and no rank waited for the other.
    assert!(!out.join("metrics.json").exists());
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}

/// Threads of process `pid` (`Threads:` in /proc/PID/status).
fn threads(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or(0)
        })
        .unwrap_or(0)
}

/// 500 connections that never present the job token, at rank 0's store during a 2-rank run:
/// the run finishes, rank 0 logs the refusals (a summary, not a line each), and its thread
/// count stays bounded (16 connections from one address at most sit in their handshake).
#[test]
fn a_flood_of_connections_without_the_token_does_not_stop_a_run() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut a = args(&out, 6);
    let at = a.iter().position(|x| x == "--train-size").unwrap();
    a[at + 1] = "8000".into(); // a run of several seconds
    let start = Instant::now();
    let running = job(2, &a).spawn().expect("spawn the ranks");
    let pid0 = running.pid(0).expect("rank 0 started");
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], running.master_port()));
    while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_err() {
        if start.elapsed() > Duration::from_secs(60) {
            panic!("rank 0's store never came up: {}", running.wait().report());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Both ranks joined and train (rank 1 connects within milliseconds of the store).
    std::thread::sleep(Duration::from_millis(500));
    let before = threads(pid0);
    let flood: Vec<std::net::TcpStream> = (0..500)
        .filter_map(|_| std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok())
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let during = threads(pid0);
    // Reap the ranks before any assertion can fail.
    let results = running.wait();
    let opened = flood.len();
    drop(flood);
    for r in &results.ranks {
        assert!(
            r.success(),
            "rank {} failed during the flood: {}",
            r.rank,
            r.stderr
        );
    }
    let err0 = &results.rank(0).stderr;
    assert!(
        err0.contains("refused") && err0.contains("connection(s)"),
        "no refusal logged: {err0}"
    );
    assert!(
        err0.matches("refused").count() <= 10,
        "refusals logged one by one: {err0}"
    );
    eprintln!(
        "flood of {opened} connections at rank 0's store: rank 0 had {before} threads before, \
         {during} during; the run finished in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    // A live rank 0 has its training threads; an exited one has none (or one, a zombie).
    assert!(
        during > 1,
        "rank 0 ended before the flood was in: make the run longer"
    );
    assert!(
        during <= before + 16 + 2,
        "{during} threads during the flood, {before} before"
    );
}
