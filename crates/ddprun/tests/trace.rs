//! `ddprun --trace DIR`: two real ranks run collectives with tracing on, and ddprun merges
//! their timelines into `DIR/trace.json`.
//!
//! The ranks are this test executable itself, started by ddprun as
//! `<this exe> --exact trace_rank_program --ignored`: the `#[ignore]`d test below is the rank
//! program when `TRACE_TEST_ROLE` is set (it does nothing otherwise). Every run has a
//! deadline; past it ddprun is SIGKILLed and its ranks die with it (PDEATHSIG).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ddp_comm::{ProcessGroup, ReduceOp, trace};
use serde_json::Value;

const DDPRUN: &str = env!("CARGO_BIN_EXE_ddprun");
const DEADLINE: Duration = Duration::from_secs(90);
const ROLE: &str = "TRACE_TEST_ROLE";

/// The rank program. `ok`: a few collectives, then a normal exit (the trace is written when
/// the group is dropped and at exit). `abort1`: the same, but rank 1 then aborts (SIGABRT:
/// no exit hook runs, so it leaves no trace file) once rank 0 has written its trace (so that
/// the launcher stopping rank 0 cannot race with it). `fail-once`: on the first attempt rank 1
/// exits with code 3 after the collectives while rank 0 waits, to be stopped by the launcher's
/// SIGTERM; a restarted attempt is `ok`.
#[test]
#[ignore = "the rank program of the tests below, started by ddprun"]
fn trace_rank_program() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    assert!(trace::enabled(), "ddprun --trace sets DDP_TRACE");
    let mut pg = ProcessGroup::from_env().unwrap();
    let rank = pg.rank();
    {
        let _step = trace::span("step", "test").arg("rank", rank);
        for n in [16usize, 100_000] {
            let mut v = vec![rank as f32 + 1.0; n];
            pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            assert_eq!(v[0], 3.0);
        }
        let mut b = vec![rank as i64; 8];
        pg.broadcast(&mut b, 0).unwrap();
        let mut msg = if rank == 0 {
            b"hello".to_vec()
        } else {
            Vec::new()
        };
        pg.broadcast_bytes(&mut msg, 0).unwrap();
        let mut out = vec![0i32; 4];
        pg.all_gather(&[rank as i32; 2], &mut out).unwrap();
        pg.all_gather_varlen(&vec![1u8; rank + 1]).unwrap();
        pg.barrier().unwrap();
    }
    let first_attempt = std::env::var("DDP_RESTART_COUNT").as_deref() == Ok("0");
    if role == "fail-once" && first_attempt {
        // Rank 1 fails only once rank 0 is past its collectives and waiting (a marker file),
        // so that rank 0 is stopped by the launcher, not by a collective that lost its peer.
        let waiting = Path::new(&std::env::var("DDP_TRACE").unwrap()).join("rank0-waiting");
        if rank == 1 {
            let deadline = Instant::now() + Duration::from_secs(30);
            while !waiting.exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            std::process::exit(3);
        }
        std::fs::write(&waiting, b"").unwrap();
        // Rank 0: wait for the launcher's SIGTERM (the deadline only bounds a broken launcher).
        std::thread::sleep(Duration::from_secs(60));
        panic!("rank 0 was not stopped after rank 1 failed");
    }
    if role == "own-handler" {
        // A program with a SIGTERM handler of its own (installed after tracing turned on),
        // which saves its work and exits 0: the trace's watcher must not end it first.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone()).unwrap();
        trace::leave_sigterm_to_the_program();
        let dir = PathBuf::from(std::env::var("DDP_TRACE").unwrap());
        std::fs::write(dir.join(format!("ready-{rank}")), b"").unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !stop.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        // "Saving" takes a while: long after the watcher has written the trace.
        std::thread::sleep(Duration::from_millis(500));
        std::fs::write(dir.join(format!("saved-{rank}")), b"").unwrap();
        std::process::exit(0);
    }
    if role == "abort1" && rank == 1 {
        let rank0 = Path::new(&std::env::var("DDP_TRACE").unwrap()).join("rank-0.trace.json");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !rank0.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        std::process::abort();
    }
    drop(pg);
}

struct Run {
    code: Option<i32>,
    stderr: String,
}

/// Runs `ddprun --nproc-per-node 2 --trace DIR -- <this exe> …` with `role`, under the deadline.
fn ddprun_trace(dir: &Path, role: &str) -> Run {
    ddprun_trace_with(dir, role, &[])
}

/// [`ddprun_trace`] with more ddprun options.
fn ddprun_trace_with(dir: &Path, role: &str, options: &[&str]) -> Run {
    start_ddprun(dir, role, options).wait()
}

/// A ddprun started by [`start_ddprun`]: its stderr is read on a thread. Dropped before
/// [`Running::wait`] returned (a test failing elsewhere), it kills ddprun, whose ranks die
/// with it.
struct Running {
    child: std::process::Child,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Starts `ddprun [--nproc-per-node 2] [options] --trace DIR -- <this exe> …` with `role`
/// (two ranks unless `options` say how many).
fn start_ddprun(dir: &Path, role: &str, options: &[&str]) -> Running {
    let me = std::env::current_exe().unwrap();
    let mut cmd = Command::new(DDPRUN);
    if !options.contains(&"--nproc-per-node") {
        cmd.args(["--nproc-per-node", "2"]);
    }
    let mut child = cmd
        .args(["--grace-secs", "5"])
        .args(options)
        .arg("--trace")
        .arg(dir)
        .arg("--")
        .arg(me)
        .args([
            "--exact",
            "trace_rank_program",
            "--ignored",
            "--test-threads=1",
        ])
        .env(ROLE, role)
        .env("DDP_TIMEOUT_SECS", "30")
        .env(
            "DDP_JOB_TOKEN",
            "trace-test-0123456789abcdef0123456789abcdef",
        )
        .env_remove("DDP_TRACE")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ddprun");
    let mut err = child.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    Running {
        child,
        stderr: Some(stderr),
    }
}

impl Running {
    /// Waits for ddprun under the deadline (past it ddprun is killed and the test fails).
    fn wait(mut self) -> Run {
        let deadline = Instant::now() + DEADLINE;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("ddprun ran past the {DEADLINE:?} deadline");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let stderr = self.stderr.take().expect("waited once");
        Run {
            code: status.code(),
            stderr: stderr.join().unwrap(),
        }
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ddprun-trace-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn read(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap()
}

fn events(doc: &Value) -> &Vec<Value> {
    doc["traceEvents"].as_array().expect("a traceEvents array")
}

fn collective_spans<'a>(doc: &'a Value, name: &str, pid: u64) -> Vec<&'a Value> {
    events(doc)
        .iter()
        .filter(|e| e["name"] == name && e["ph"] == "X" && e["pid"] == pid)
        .collect()
}

#[test]
fn trace_merges_the_timelines_of_both_ranks() {
    let dir = scratch("ok");
    let run = ddprun_trace(&dir, "ok");
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let merged = dir.join("trace.json");
    assert!(
        run.stderr.contains(&merged.display().to_string()),
        "ddprun says where the merged trace is: {}",
        run.stderr
    );
    assert!(dir.join("rank-0.trace.json").exists());
    assert!(dir.join("rank-1.trace.json").exists());

    let doc = read(&merged);
    assert_eq!(doc["displayTimeUnit"], "ms");
    assert_eq!(doc["otherData"]["merged_ranks"], serde_json::json!([0, 1]));
    assert_eq!(doc["otherData"]["missing_ranks"], serde_json::json!([]));
    for pid in [0u64, 1] {
        let name = events(&doc)
            .iter()
            .find(|e| e["ph"] == "M" && e["name"] == "process_name" && e["pid"] == pid)
            .unwrap_or_else(|| panic!("no process_name for rank {pid}"));
        assert_eq!(name["args"]["name"], format!("rank {pid}"));

        let ar = collective_spans(&doc, "all_reduce", pid);
        assert_eq!(ar.len(), 2, "rank {pid}: {ar:?}");
        let big = &ar[1]["args"];
        assert_eq!(big["op"], "all_reduce");
        assert_eq!(big["reduce"], "sum");
        assert_eq!(big["dtype"], "f32");
        assert_eq!(big["bytes"], 400_000);
        assert_eq!(big["world"], 2);
        assert_eq!(big["transport"], "shm");
        assert_eq!(ar[0]["args"]["seq"], 1);
        assert_eq!(big["seq"], 2);
        for op in [
            "broadcast",
            "broadcast_bytes",
            "all_gather",
            "all_gather_varlen",
            "barrier",
            "rendezvous",
            "clock_sync",
            "step",
        ] {
            assert_eq!(
                events(&doc)
                    .iter()
                    .filter(|e| e["name"] == op && e["pid"] == pid)
                    .count(),
                1,
                "rank {pid}: one {op} span"
            );
        }
        // Rank 1's offset to rank 0 was measured (same host: about zero).
        let other = &doc["otherData"]["ranks_other_data"][pid.to_string()];
        assert!(other["clock_rtt_us"].is_i64(), "{other}");
        assert!(
            other["clock_offset_us"].as_i64().unwrap().abs() < 50_000,
            "{other}"
        );
    }
    // One clock: the last collective (the barrier) ends at about the same time on both ranks.
    let end = |pid: u64| {
        let b = collective_spans(&doc, "barrier", pid)[0];
        b["ts"].as_f64().unwrap() + b["dur"].as_f64().unwrap()
    };
    assert!((end(0) - end(1)).abs() < 1e6, "{} vs {}", end(0), end(1));
    let ts: Vec<f64> = events(&doc)
        .iter()
        .filter(|e| e["ph"] != "M")
        .map(|e| e["ts"].as_f64().unwrap())
        .collect();
    assert!(ts.windows(2).all(|w| w[0] <= w[1]), "events sorted by ts");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn trace_of_a_failed_job_merges_what_exists_and_names_the_missing_rank() {
    let dir = scratch("abort");
    // A stale file of an earlier run must not pass for rank 1's trace.
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("rank-1.trace.json"), b"{\"traceEvents\":[]}").unwrap();
    let run = ddprun_trace(&dir, "abort1");
    assert_ne!(run.code, Some(0), "{}", run.stderr);
    assert!(
        run.stderr.contains("no trace from rank(s) 1"),
        "ddprun names the missing rank: {}",
        run.stderr
    );
    let doc = read(&dir.join("trace.json"));
    assert_eq!(doc["otherData"]["merged_ranks"], serde_json::json!([0]));
    assert_eq!(doc["otherData"]["missing_ranks"], serde_json::json!([1]));
    assert_eq!(collective_spans(&doc, "all_reduce", 0).len(), 2);
    assert!(events(&doc).iter().all(|e| e["pid"] == 0));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank stopped by the launcher (SIGTERM after rank 1 failed) still leaves its trace, and
/// the restarted attempt's ranks get tracks of their own beside the first attempt's.
#[test]
fn trace_keeps_a_stopped_rank_and_every_restart_attempt() {
    let dir = scratch("restart");
    let run = ddprun_trace_with(&dir, "fail-once", &["--max-restarts", "1"]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(
        run.stderr.contains("and of the 1 earlier attempt(s)"),
        "{}",
        run.stderr
    );
    assert!(dir.join("rank-0.trace.json").exists(), "{}", run.stderr);
    assert!(dir.join("attempt-1").join("rank-1.trace.json").exists());
    let doc = read(&dir.join("trace.json"));
    let data = &doc["otherData"];
    assert_eq!(data["merged_ranks"], serde_json::json!([0, 1]));
    assert_eq!(data["attempts"].as_array().unwrap().len(), 2, "{data}");
    assert_eq!(data["attempts"][0]["ranks"], serde_json::json!([0, 1]));
    // Attempt 0: rank 0 was SIGTERMed while waiting; its file was written then.
    let sigterm: Vec<&Value> = events(&doc)
        .iter()
        .filter(|e| e["name"] == "sigterm")
        .collect();
    assert_eq!(sigterm.len(), 1, "one sigterm mark: {sigterm:?}");
    assert_eq!(sigterm[0]["pid"], 0);
    for pid in [0u64, 1] {
        assert_eq!(
            collective_spans(&doc, "all_reduce", pid).len(),
            2,
            "pid {pid}"
        );
    }
    // Attempt 1: its own tracks, named after the rank and the attempt.
    for rank in [0u64, 1] {
        let pid = trace::track_pid(rank as usize, 1);
        assert_eq!(
            collective_spans(&doc, "all_reduce", pid).len(),
            2,
            "pid {pid}"
        );
        let name = events(&doc)
            .iter()
            .find(|e| e["ph"] == "M" && e["name"] == "process_name" && e["pid"] == pid)
            .unwrap_or_else(|| panic!("no process_name for pid {pid}"));
        assert_eq!(name["args"]["name"], format!("rank {rank} (attempt 1)"));
    }
    // The restart comes after the failure on the one timeline.
    let first_end = collective_spans(&doc, "barrier", 0)[0]["ts"]
        .as_f64()
        .unwrap();
    let second = collective_spans(&doc, "barrier", trace::track_pid(0, 1))[0]["ts"]
        .as_f64()
        .unwrap();
    assert!(second > first_end, "{second} after {first_end}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two "nodes" (two ddprun on one host, one rank each, node-local trace directories) write
/// their own per-node merge; `ddprun --merge-trace` joins the gathered rank files into one
/// timeline of both, on rank 0's clock.
#[test]
fn merge_trace_joins_the_rank_files_of_several_nodes() {
    let root = scratch("nodes");
    let port = ddp_testkit::free_port().to_string();
    let node = |n: &str| {
        let opts = [
            "--nnodes",
            "2",
            "--node-rank",
            n,
            "--master-port",
            &port,
            "--nproc-per-node",
            "1",
        ];
        start_ddprun(&root.join(format!("node{n}")), "ok", &opts)
    };
    let (node0, node1) = (node("0"), node("1"));
    let (run0, run1) = (node0.wait(), node1.wait());
    assert_eq!(run0.code, Some(0), "{}", run0.stderr);
    assert_eq!(run1.code, Some(0), "{}", run1.stderr);
    assert!(run1.stderr.contains("--merge-trace"), "{}", run1.stderr);
    assert!(root.join("node1").join("trace-node1.json").exists());

    let all = root.join("all");
    std::fs::create_dir_all(&all).unwrap();
    for (n, r) in [(0, 0), (1, 1)] {
        let name = trace::rank_file_name(r);
        std::fs::copy(root.join(format!("node{n}")).join(&name), all.join(&name)).unwrap();
    }
    let merge = |extra: &[&str]| {
        let out = Command::new(DDPRUN)
            .arg("--merge-trace")
            .arg(&all)
            .args(extra)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stderr) = merge(&["--nnodes", "2"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("trace of rank(s) 0, 1 merged"), "{stderr}");
    let doc = read(&all.join("trace.json"));
    assert_eq!(doc["otherData"]["merged_ranks"], serde_json::json!([0, 1]));
    for pid in [0u64, 1] {
        assert_eq!(
            collective_spans(&doc, "all_reduce", pid).len(),
            2,
            "pid {pid}"
        );
    }
    let rank1 = &doc["otherData"]["ranks_other_data"]["1"];
    assert!(
        rank1["clock_rtt_us"].is_i64(),
        "rank 1 measured its offset: {rank1}"
    );

    // Three ranks expected, two files: the merge names the missing one.
    let (code, stderr) = merge(&["--nnodes", "3"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("no trace from rank(s) 2"), "{stderr}");
    // Nothing to merge: one error, exit 1.
    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = Command::new(DDPRUN)
        .arg("--merge-trace")
        .arg(&empty)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("no readable rank-<R>.trace.json"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// A rank program with a SIGTERM handler of its own (signal-hook, installed after tracing
/// turned on) that calls `trace::leave_sigterm_to_the_program`: a SIGTERM writes its trace and
/// the program still finishes its "save and exit". Before, the watcher re-raised SIGTERM and
/// killed it half-way.
#[test]
fn a_program_with_its_own_sigterm_handler_finishes_it() {
    let dir = scratch("own-handler");
    let running = start_ddprun(&dir, "own-handler", &[]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(dir.join("ready-0").exists() && dir.join("ready-1").exists()) {
        assert!(Instant::now() < deadline, "the ranks never got ready");
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(
        unsafe { libc::kill(running.child.id() as i32, libc::SIGTERM) },
        0
    );
    let run = running.wait();
    for rank in 0..2 {
        assert!(
            dir.join(format!("saved-{rank}")).exists(),
            "rank {rank} was ended before its own handler finished: {}",
            run.stderr
        );
        assert!(
            dir.join(format!("rank-{rank}.trace.json")).exists(),
            "{}",
            run.stderr
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
