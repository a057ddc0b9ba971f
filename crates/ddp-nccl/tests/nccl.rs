//! NCCL transport tests.
//!
//! The first test runs everywhere: without CUDA/NCCL every constructor must return the clear
//! library error (never panic). The `#[ignore]`d ones need an NVIDIA GPU with libcuda and
//! libnccl; `cargo xtask gpu-check run` runs them on such a machine (it also makes the
//! `libnccl.so` link cudarc needs). Multi-process tests spawn this test binary as rank
//! processes, with a deadline after which the children are killed.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ddp_comm::{CommError, LaunchEnv, ReduceOp, StoreClient, StoreServer};
use ddp_nccl::cudarc::driver::DevicePtr;
use ddp_nccl::{NcclGroup, NcclOptions, check_libraries};

const CHILD_VAR: &str = "DDP_NCCL_TEST_CHILD";
const TOKEN: &str = "nccl-test-token-0123456789abcdef0123456789abcdef";

fn opts() -> NcclOptions {
    NcclOptions {
        timeout: Duration::from_secs(60),
        init_timeout: Duration::from_secs(60),
        device: Some(0),
        ..NcclOptions::default()
    }
}

fn env_for(rank: usize, world: usize, port: u16) -> LaunchEnv {
    let vars = [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("DDP_JOB_TOKEN", TOKEN.to_string()),
    ];
    LaunchEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())).unwrap()
}

#[test]
fn missing_libraries_are_a_clear_error_not_a_panic() {
    let single = NcclGroup::single(&opts());
    match check_libraries() {
        Err(lib_err) => {
            let want = lib_err.to_string();
            assert!(
                want.contains("libcuda not found")
                    || want.contains("libnccl not found")
                    || want.contains("too old"),
                "{want}"
            );
            assert_eq!(single.unwrap_err().to_string(), want);
            // Through the store path too: the library check comes before any store traffic.
            let server = StoreServer::bind("127.0.0.1:0", Some(TOKEN.into())).unwrap();
            let env = env_for(0, 2, server.local_addr().port());
            let mut store =
                StoreClient::connect(&env.master_endpoint(), Some(TOKEN), Duration::from_secs(5))
                    .unwrap();
            let err = NcclGroup::init(&env, &mut store, &opts()).unwrap_err();
            assert_eq!(err.to_string(), want);
            assert_eq!(store.try_get("nccl/generation/0").unwrap(), None);
        }
        Ok(_) => {
            // CUDA and NCCL are here: the constructor must work.
            let g = single.expect("libraries present but a single-rank group failed");
            assert_eq!((g.rank(), g.world_size()), (0, 1));
        }
    }
}

fn ramp<T: Copy>(n: usize, f: impl Fn(usize) -> T) -> Vec<T> {
    (0..n).map(f).collect()
}

/// Every op on device buffers with world size 1, for one element type. Outputs are pre-filled
/// with a sentinel so a collective that does not write is caught.
fn device_collectives_world1<T>(g: &mut NcclGroup, data: Vec<T>, sentinel: T)
where
    T: ddp_nccl::NcclElement + PartialEq,
{
    let stream = g.stream().clone();
    for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
        let mut buf = stream.clone_htod(&data).unwrap();
        g.all_reduce(&mut buf, op).unwrap();
        assert_eq!(stream.clone_dtoh(&buf).unwrap(), data, "all_reduce {op:?}");

        let input = stream.clone_htod(&data).unwrap();
        let mut out = stream.clone_htod(&vec![sentinel; data.len()]).unwrap();
        g.all_reduce_into(&input, &mut out, op).unwrap();
        assert_eq!(
            stream.clone_dtoh(&out).unwrap(),
            data,
            "all_reduce_into {op:?}"
        );
        assert_eq!(stream.clone_dtoh(&input).unwrap(), data, "input kept");
    }
    let mut buf = stream.clone_htod(&data).unwrap();
    g.broadcast(&mut buf, 0).unwrap();
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), data);

    let input = stream.clone_htod(&data).unwrap();
    let mut out = stream.clone_htod(&vec![sentinel; data.len()]).unwrap();
    g.all_gather(&input, &mut out).unwrap();
    assert_eq!(stream.clone_dtoh(&out).unwrap(), data);

    // A sub-view: all-reduce the middle third only.
    let mut buf = stream.clone_htod(&data).unwrap();
    let (a, b) = (data.len() / 3, 2 * data.len() / 3);
    let mut view = buf.slice_mut(a..b);
    g.all_reduce(&mut view, ReduceOp::Sum).unwrap();
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), data);
}

#[test]
#[ignore = "needs CUDA and NCCL (cargo xtask gpu-check)"]
fn world1_device_collectives_f32_f64_i64() {
    let mut g = NcclGroup::single(&opts()).unwrap();
    println!(
        "OUTCOME NCCL {} on CUDA device {} ({})",
        g.nccl_version(),
        g.device_ordinal(),
        g.context().name().unwrap_or_default()
    );
    device_collectives_world1(&mut g, ramp(1001, |i| i as f32 * 0.5 - 100.0), f32::NAN);
    device_collectives_world1(&mut g, ramp(4099, |i| (i as f64).sin() * 1e6), -7.0);
    device_collectives_world1(
        &mut g,
        ramp(777, |i| i as i64 * 1_000_000_007 - (1 << 40)),
        i64::MIN,
    );
    device_collectives_world1(&mut g, ramp(64, |i| i as i32 - 32), 99);
    device_collectives_world1(&mut g, ramp(300, |i| (i % 256) as u8), 7u8);
    for _ in 0..100 {
        g.barrier().unwrap();
    }
    assert!(g.broken_reason().is_none());
}

#[test]
#[ignore = "needs CUDA and NCCL (cargo xtask gpu-check)"]
fn world1_host_helpers_and_argument_errors() {
    let mut g = NcclGroup::single(&opts()).unwrap();
    let data = ramp(12345, |i| i as f64 - 6000.5);
    let mut buf = data.clone();
    g.all_reduce_host(&mut buf, ReduceOp::Mean).unwrap();
    assert_eq!(buf, data);
    let mut ints = ramp(10, |i| -(i as i64));
    g.broadcast_host(&mut ints, 0).unwrap();
    assert_eq!(ints, ramp(10, |i| -(i as i64)));
    let mut out = vec![0f32; 5];
    g.all_gather_host(&[1.0, 2.0, 3.0, 4.0, 5.0], &mut out)
        .unwrap();
    assert_eq!(out, [1.0, 2.0, 3.0, 4.0, 5.0]);
    let mut empty: Vec<f32> = Vec::new();
    g.all_reduce_host(&mut empty, ReduceOp::Sum).unwrap();

    // Argument errors are caught before NCCL and leave the group usable.
    let err = g.broadcast_host(&mut [1.0f32], 1).unwrap_err();
    assert!(matches!(err, CommError::InvalidArgument(_)), "{err}");
    let err = g
        .all_gather_host(&[1.0f32, 2.0], &mut [0.0; 3])
        .unwrap_err();
    assert!(matches!(err, CommError::InvalidArgument(_)), "{err}");
    let stream = g.stream().clone();
    let input = stream.clone_htod(&[1i64, 2, 3]).unwrap();
    let mut wrong = stream.alloc_zeros::<i64>(4).unwrap();
    let err = g.all_gather(&input, &mut wrong).unwrap_err();
    assert!(matches!(err, CommError::InvalidArgument(_)), "{err}");
    assert!(g.broken_reason().is_none());
    g.barrier().unwrap();

    // A world of one through the launcher-facing constructor: no store needed. Two
    // single-rank communicators may share the device.
    let mut solo = NcclGroup::connect(&LaunchEnv::single_process(), &opts()).unwrap();
    let mut v = vec![3i64, -4, 5];
    solo.all_reduce_host(&mut v, ReduceOp::Max).unwrap();
    assert_eq!(v, [3, -4, 5]);
    drop(solo);

    // After an explicit abort every call reports the broken group.
    g.abort();
    let err = g.barrier().unwrap_err();
    assert!(matches!(err, CommError::Poisoned(_)), "{err}");
    let err = g.all_reduce_host(&mut [1.0f32], ReduceOp::Sum).unwrap_err();
    assert!(matches!(err, CommError::Poisoned(_)), "{err}");
}

#[test]
#[ignore = "needs CUDA and NCCL (cargo xtask gpu-check)"]
fn world1_sharded_collectives_and_their_argument_errors() {
    let mut g = NcclGroup::single(&opts()).unwrap();
    let stream = g.stream().clone();
    let data = ramp(1000, |i| i as f32 - 500.25);
    let mut buf = stream.clone_htod(&data).unwrap();
    g.reduce_scatter(&mut buf, &[1000], ReduceOp::Mean).unwrap();
    g.all_gather_into(&mut buf, &[1000]).unwrap();
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), data);
    let mut empty = stream.alloc_zeros::<f32>(0).unwrap();
    g.reduce_scatter(&mut empty, &[0], ReduceOp::Sum).unwrap();
    // Sizes that do not fit are refused before NCCL and leave the group usable.
    let err = g
        .reduce_scatter(&mut buf, &[999], ReduceOp::Sum)
        .unwrap_err();
    assert!(err.to_string().contains("add up to 999"), "{err}");
    let err = g.all_gather_into(&mut buf, &[500, 500]).unwrap_err();
    assert!(err.to_string().contains("2 shard sizes"), "{err}");
    assert!(g.broken_reason().is_none());
    g.barrier().unwrap();
}

#[test]
#[ignore = "needs CUDA and NCCL (cargo xtask gpu-check)"]
fn world1_raw_pointer_collectives() {
    let mut g = NcclGroup::single(&opts()).unwrap();
    let stream = g.stream().clone();
    let data = ramp(2048, |i| i as f32);
    let buf = stream.clone_htod(&data).unwrap();
    let out = stream.clone_htod(&vec![-1.0f32; 2048]).unwrap();
    stream.synchronize().unwrap();
    {
        let (ptr, _r) = buf.device_ptr(&stream);
        let (optr, _w) = out.device_ptr(&stream);
        // SAFETY: both buffers are live on the group's device and idle (synchronised above).
        unsafe {
            g.wait_for_stream(stream.cu_stream()).unwrap();
            g.all_reduce_raw::<f32>(ptr, 2048, ReduceOp::Max).unwrap();
            g.broadcast_raw::<f32>(ptr, 2048, 0).unwrap();
            g.all_gather_raw::<f32>(ptr, 2048, optr).unwrap();
        }
    }
    assert_eq!(stream.clone_dtoh(&out).unwrap(), data);
}

#[test]
#[ignore = "needs CUDA and NCCL (cargo xtask gpu-check)"]
fn world1_grouped_raw_all_reduce_of_several_buffers() {
    let mut g = NcclGroup::single(&opts()).unwrap();
    let stream = g.stream().clone();
    let a = ramp(3000, |i| i as f32 * 0.5);
    let b = ramp(17, |i| -(i as f32));
    let buf_a = stream.clone_htod(&a).unwrap();
    let buf_b = stream.clone_htod(&b).unwrap();
    let empty = stream.clone_htod(&[0.0f32]).unwrap();
    stream.synchronize().unwrap();
    {
        let (pa, _ra) = buf_a.device_ptr(&stream);
        let (pb, _rb) = buf_b.device_ptr(&stream);
        let (pe, _re) = empty.device_ptr(&stream);
        // SAFETY: three live, disjoint, idle buffers on the group's device.
        unsafe {
            g.all_reduce_many_raw::<f32>(&[(pa, 3000), (pe, 0), (pb, 17)], ReduceOp::Mean)
                .unwrap();
            g.all_reduce_many_raw::<f32>(&[], ReduceOp::Sum).unwrap();
        }
    }
    assert_eq!(stream.clone_dtoh(&buf_a).unwrap(), a);
    assert_eq!(stream.clone_dtoh(&buf_b).unwrap(), b);
    // The group is still usable afterwards.
    let mut one = stream.clone_htod(&[2.0f32]).unwrap();
    g.all_reduce(&mut one, ReduceOp::Sum).unwrap();
    assert_eq!(stream.clone_dtoh(&one).unwrap(), vec![2.0]);
}

#[test]
#[ignore = "needs CUDA and NCCL (cargo xtask gpu-check)"]
fn world1_large_all_reduce_and_timings() {
    let mut g = NcclGroup::single(&opts()).unwrap();
    let stream = g.stream().clone();
    println!("BENCH | all_reduce f32, world 1 | bytes | median us | algbw GB/s |");
    for &n in &[2048usize, 256 << 10, 25 << 18, 100 << 18] {
        let data = ramp(n, |i| (i % 1000) as f32);
        let mut buf = stream.clone_htod(&data).unwrap();
        let mut times = Vec::new();
        for _ in 0..11 {
            let t = Instant::now();
            g.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            times.push(t.elapsed());
        }
        times.sort();
        let med = times[times.len() / 2];
        let bytes = n * 4;
        println!(
            "BENCH | all_reduce f32, world 1 | {bytes} | {:.1} | {:.1} |",
            med.as_secs_f64() * 1e6,
            bytes as f64 / med.as_secs_f64() / 1e9
        );
        assert_eq!(stream.clone_dtoh(&buf).unwrap(), data);
    }
}

#[test]
#[ignore = "needs CUDA and NCCL (cargo xtask gpu-check)"]
fn init_times_out_and_names_the_rank_that_never_came() {
    let server = StoreServer::bind("127.0.0.1:0", Some(TOKEN.into())).unwrap();
    let env = env_for(0, 2, server.local_addr().port());
    let mut store =
        StoreClient::connect(&env.master_endpoint(), Some(TOKEN), Duration::from_secs(5)).unwrap();
    let o = NcclOptions {
        init_timeout: Duration::from_secs(3),
        ..opts()
    };
    let err = NcclGroup::init(&env, &mut store, &o).unwrap_err();
    eprintln!("error as reported: {err}");
    assert!(matches!(err, CommError::Timeout { .. }), "{err}");
    assert_eq!(err.peer(), Some(1), "{err}");
    assert!(err.to_string().contains("[1] never reached"), "{err}");
    // The aborted communicator left the device usable.
    let mut g = NcclGroup::single(&opts()).unwrap();
    g.barrier().unwrap();
}

/// A child rank's NCCL group from its launch variables (10 s collective timeout); on a failed
/// creation it prints `init-error` and exits 3.
fn child_group(init_timeout: Duration) -> (LaunchEnv, NcclGroup) {
    let env = LaunchEnv::from_env().unwrap();
    let mut store = StoreClient::connect(
        &env.master_endpoint(),
        env.job_token.as_deref(),
        Duration::from_secs(30),
    )
    .unwrap();
    let o = NcclOptions {
        init_timeout,
        timeout: Duration::from_secs(10),
        ..opts()
    };
    match NcclGroup::init(&env, &mut store, &o) {
        Ok(g) => (env, g),
        Err(e) => {
            println!("CHILD rank={} init-error {e}", env.rank);
            std::process::exit(3);
        }
    }
}

/// One rank of the two-process test (runs only when spawned by it).
#[test]
#[ignore = "child process of two_processes_on_one_gpu (not a test by itself)"]
fn child_entry_two_process_rank() {
    if std::env::var(CHILD_VAR).is_err() {
        return;
    }
    let (env, mut g) = child_group(Duration::from_secs(30));
    let r = env.rank;
    let mut v = vec![(r + 1) as f32; 1000];
    g.all_reduce_host(&mut v, ReduceOp::Sum).unwrap();
    assert!(v.iter().all(|&x| x == 3.0), "sum {:?}", &v[..3]);
    let mut m = vec![(r as i64) * 10 + 1; 7];
    g.all_reduce_host(&mut m, ReduceOp::Mean).unwrap();
    assert_eq!(m, vec![6; 7]); // (1 + 11) / 2
    let mut b = vec![r as f64; 5];
    g.broadcast_host(&mut b, 1).unwrap();
    assert_eq!(b, vec![1.0; 5]);
    let mut gathered = vec![0i32; 4];
    g.all_gather_host(&[r as i32, -(r as i32)], &mut gathered)
        .unwrap();
    assert_eq!(gathered, vec![0, 0, 1, -1]);
    // Uneven shards: rank 0 owns 3 values, rank 1 owns 5.
    let stream = g.stream().clone();
    let mut shards = stream
        .clone_htod(&ramp(8, |i| (i + 10 * r) as f32))
        .unwrap();
    g.reduce_scatter(&mut shards, &[3, 5], ReduceOp::Sum)
        .unwrap();
    let reduced = stream.clone_dtoh(&shards).unwrap();
    let mine = if r == 0 { 0..3 } else { 3..8 };
    for i in mine {
        assert_eq!(reduced[i], (2 * i + 10) as f32, "reduce_scatter at {i}");
    }
    g.all_gather_into(&mut shards, &[3, 5]).unwrap();
    let gathered = stream.clone_dtoh(&shards).unwrap();
    assert_eq!(gathered, ramp(8, |i| (2 * i + 10) as f32));
    g.barrier().unwrap();
    println!("CHILD rank={r} collectives-ok");
    if r == 1 {
        // Die without joining the next collective: rank 0 must get an error, not hang.
        std::process::exit(0);
    }
    let t = Instant::now();
    let err = g
        .all_reduce_host(&mut [1.0f32; 16], ReduceOp::Sum)
        .unwrap_err();
    println!(
        "CHILD rank={r} dead-peer-error after {:.1}s: {err}",
        t.elapsed().as_secs_f64()
    );
    std::process::exit(0);
}

/// Starts rank `rank` of the two-process test; `emulated`: as an emulated GPU host of its own
/// (`ddprun --emulate-gpu-hosts`'s variables).
fn spawn_rank(rank: usize, port: u16, emulated: bool) -> Child {
    let hosts = emulated
        .then(|| ddp_comm::gpu_hosts::rank_vars(rank))
        .into_iter()
        .flatten();
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_entry_two_process_rank",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_VAR, "1")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("DDP_JOB_TOKEN", TOKEN)
        .envs(hosts)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// Kills the children when the test ends, however it ends.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What the two rank processes of a two-process test printed, and their exit codes.
struct TwoRanks {
    codes: [Option<i32>; 2],
    outs: Vec<String>,
}

/// Runs the two rank processes (`emulated`: as emulated GPU hosts) to their end, within 120 s.
fn run_two_ranks(emulated: bool) -> TwoRanks {
    check_libraries().expect("this test needs CUDA and NCCL");
    let server = StoreServer::bind("127.0.0.1:0", Some(TOKEN.into())).unwrap();
    let port = server.local_addr().port();
    let children = Children(vec![
        spawn_rank(0, port, emulated),
        spawn_rank(1, port, emulated),
    ]);
    let (codes, outs) = finish(children, Duration::from_secs(120));
    for (i, o) in outs.iter().enumerate() {
        // libtest may print "test NAME ... " on the same line before the child's output.
        for line in o
            .lines()
            .filter_map(|l| l.find("CHILD rank=").map(|at| &l[at..]))
        {
            println!("rank {i} (exit {:?}): {line}", codes[i]);
        }
    }
    TwoRanks {
        codes: [codes[0], codes[1]],
        outs,
    }
}

#[test]
#[ignore = "needs CUDA and NCCL (cargo xtask gpu-check)"]
fn two_processes_on_one_gpu_work_or_fail_cleanly() {
    // NCCL normally refuses two ranks on one GPU ("Duplicate GPU detected"). Either outcome is
    // acceptable here; a hang, a panic or a wrong result is not. When NCCL accepts, rank 1
    // then dies and rank 0 must report the dead peer within its 10 s timeout.
    let TwoRanks { codes, outs } = run_two_ranks(false);
    let init_failed = outs.iter().all(|o| o.contains("init-error"));
    let worked = outs.iter().all(|o| o.contains("collectives-ok"));
    assert!(
        init_failed || worked,
        "neither a clean error on every rank nor success: {codes:?}\n{outs:?}"
    );
    if init_failed {
        assert_eq!(codes, [Some(3), Some(3)]);
        println!("OUTCOME two ranks on one GPU: refused by NCCL, clean error on both ranks");
    } else {
        assert_eq!(codes, [Some(0), Some(0)], "{outs:?}");
        assert!(outs[0].contains("dead-peer-error"), "{}", outs[0]);
        println!("OUTCOME two ranks on one GPU: collectives correct; dead peer reported");
    }
}

/// Two processes as emulated GPU hosts (each its own `NCCL_HOSTID`, NCCL's socket transport):
/// NCCL must accept them on one GPU (or on two), every collective is checked, and when rank 1
/// leaves, rank 0 reports the dead peer within its 10 s timeout.
#[test]
#[ignore = "needs CUDA and NCCL (cargo xtask gpu-check)"]
fn two_emulated_gpu_hosts_run_every_collective_and_report_a_dead_peer() {
    let TwoRanks { codes, outs } = run_two_ranks(true);
    assert!(
        outs.iter().all(|o| o.contains("collectives-ok")),
        "NCCL did not run the collectives between emulated hosts: {codes:?}\n{outs:?}"
    );
    assert_eq!(codes, [Some(0), Some(0)], "{outs:?}");
    assert!(outs[0].contains("dead-peer-error"), "{}", outs[0]);
    println!("OUTCOME two emulated GPU hosts: collectives correct; dead peer reported");
}

/// The variable that runs [`child_entry_emulated_rank`]: `collectives` or `killed`.
const SCENARIO_VAR: &str = "DDP_NCCL_TEST_SCENARIO";

/// Values of rank `r` at index `i`: small integers, so every sum over up to 4 ranks is exact in
/// f32, f64 and bf16 whatever order NCCL adds in, and the result must equal the host's bitwise.
fn small_int(r: usize, i: usize) -> f64 {
    ((r + 1) * (i % 7)) as f64
}

/// `all_reduce_host` (sum and mean) of one element type against the sums computed here.
fn check_all_reduce<T: ddp_nccl::NcclElement + Copy + PartialEq + std::fmt::Debug>(
    g: &mut NcclGroup,
    from: impl Fn(f64) -> T,
    what: &str,
) {
    let (r, world) = (g.rank(), g.world_size());
    let n = 1000;
    let total = |i: usize| (0..world).map(|q| small_int(q, i)).sum::<f64>();
    let mut v: Vec<T> = (0..n).map(|i| from(small_int(r, i))).collect();
    g.all_reduce_host(&mut v, ReduceOp::Sum).unwrap();
    let want: Vec<T> = (0..n).map(|i| from(total(i))).collect();
    assert_eq!(v, want, "{what} sum on rank {r}");
    // A mean over 2 or 4 ranks divides by a power of two: exact too.
    let mut v: Vec<T> = (0..n).map(|i| from(small_int(r, i))).collect();
    g.all_reduce_host(&mut v, ReduceOp::Mean).unwrap();
    let want: Vec<T> = (0..n).map(|i| from(total(i) / world as f64)).collect();
    assert_eq!(v, want, "{what} mean on rank {r}");
}

/// One rank of the emulated-host tests (runs only when spawned by them).
#[test]
#[ignore = "child process of the emulated GPU host tests (not a test by itself)"]
fn child_entry_emulated_rank() {
    let Ok(scenario) = std::env::var(SCENARIO_VAR) else {
        return;
    };
    let (env, mut g) = child_group(Duration::from_secs(60));
    let (r, world) = (env.rank, env.world_size);
    if scenario == "killed" {
        // Every rank all-reduces 64 MiB in a loop; the test SIGKILLs the last rank mid-loop.
        println!("CHILD rank={r} looping");
        let mut big = vec![1.0f32; 16 << 20];
        let t = Instant::now();
        loop {
            if let Err(e) = g.all_reduce_host(&mut big, ReduceOp::Mean) {
                println!(
                    "CHILD rank={r} dead-peer-error after {:.1}s: {e}",
                    t.elapsed().as_secs_f64()
                );
                std::process::exit(4);
            }
        }
    }
    if scenario == "recreated" {
        // Live recovery's step on every rank: the communicator aborted and created again (the
        // next generation through the store), then collectives on the new one.
        check_all_reduce(&mut g, |x| x as f32, "f32 before");
        let mut store = StoreClient::connect(
            &env.master_endpoint(),
            env.job_token.as_deref(),
            Duration::from_secs(30),
        )
        .unwrap();
        g.recreate(&mut store, &opts()).unwrap();
        assert!(g.broken_reason().is_none(), "{:?}", g.broken_reason());
        check_all_reduce(&mut g, |x| x as f32, "f32 after");
        g.barrier().unwrap();
        println!("CHILD rank={r} recreated-ok world={world}");
        std::process::exit(0);
    }
    check_all_reduce(&mut g, |x| x as f32, "f32");
    check_all_reduce(&mut g, |x| x, "f64");
    check_all_reduce(&mut g, half::bf16::from_f64, "bf16");
    // Values that are not exact: within the rounding of the f32 sums (a stated bound).
    let mut v: Vec<f32> = (0..1000).map(|i| 0.1 * (r + 1) as f32 * i as f32).collect();
    g.all_reduce_host(&mut v, ReduceOp::Sum).unwrap();
    for (i, x) in v.iter().enumerate() {
        let want: f64 = (0..world).map(|q| 0.1 * (q + 1) as f64 * i as f64).sum();
        assert!(
            (f64::from(*x) - want).abs() <= 1e-6 * want.max(1.0),
            "f32 sum at {i}: {x} vs {want}"
        );
    }
    // Broadcast from the last rank, all-gather.
    let mut b = vec![r as f64; 5];
    g.broadcast_host(&mut b, world - 1).unwrap();
    assert_eq!(b, vec![(world - 1) as f64; 5]);
    let mut gathered = vec![0i32; 2 * world];
    g.all_gather_host(&[r as i32, -(r as i32)], &mut gathered)
        .unwrap();
    let want: Vec<i32> = (0..world as i32).flat_map(|q| [q, -q]).collect();
    assert_eq!(gathered, want);
    // Reduce-scatter over uneven shards (rank q owns q + 2 values), then all-gather them back.
    let counts: Vec<usize> = (0..world).map(|q| q + 2).collect();
    let len: usize = counts.iter().sum();
    let stream = g.stream().clone();
    let mut shards = stream
        .clone_htod(&ramp(len, |i| (i + 10 * r) as f32))
        .unwrap();
    g.reduce_scatter(&mut shards, &counts, ReduceOp::Sum)
        .unwrap();
    let reduced = stream.clone_dtoh(&shards).unwrap();
    let start: usize = counts[..r].iter().sum();
    let expect = |i: usize| (world * i + 10 * (0..world).sum::<usize>()) as f32;
    for (i, value) in reduced.iter().enumerate().skip(start).take(counts[r]) {
        assert_eq!(*value, expect(i), "reduce_scatter at {i}");
    }
    g.all_gather_into(&mut shards, &counts).unwrap();
    assert_eq!(stream.clone_dtoh(&shards).unwrap(), ramp(len, expect));
    g.barrier().unwrap();
    println!("CHILD rank={r} collectives-ok world={world}");
    std::process::exit(0);
}

/// Starts `world` rank processes of `scenario`, each an emulated GPU host of its own.
fn spawn_emulated(world: usize, scenario: &str) -> (StoreServer, Children) {
    check_libraries().expect("this test needs CUDA and NCCL");
    let server = StoreServer::bind("127.0.0.1:0", Some(TOKEN.into())).unwrap();
    let port = server.local_addr().port();
    let children = (0..world)
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "child_entry_emulated_rank",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(SCENARIO_VAR, scenario)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("DDP_JOB_TOKEN", TOKEN)
                .envs(ddp_comm::gpu_hosts::rank_vars(rank))
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap()
        })
        .collect();
    (server, Children(children))
}

/// Reads every child's stdout to its end (in threads, so that a chatty rank never blocks on a
/// full pipe) and waits for each exit, within `limit` (a hang fails the test).
fn finish(mut children: Children, limit: Duration) -> (Vec<Option<i32>>, Vec<String>) {
    let readers: Vec<_> = children
        .0
        .iter_mut()
        .map(|c| {
            let mut out = c.stdout.take().unwrap();
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = out.read_to_string(&mut s);
                s
            })
        })
        .collect();
    let deadline = Instant::now() + limit;
    let mut codes: Vec<Option<Option<i32>>> = vec![None; children.0.len()];
    while codes.iter().any(Option::is_none) {
        assert!(
            Instant::now() < deadline,
            "ranks still running after {limit:?} (hang)"
        );
        for (i, c) in children.0.iter_mut().enumerate() {
            if codes[i].is_none() {
                codes[i] = c.try_wait().unwrap().map(|s| s.code());
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let outs = readers.into_iter().map(|r| r.join().unwrap()).collect();
    (codes.into_iter().map(Option::unwrap).collect(), outs)
}

/// NCCL between 2 and then 4 processes, each an emulated GPU host (one GPU is enough): all-reduce
/// sum and mean in f32, f64 and bf16 bitwise equal to the exact sums, f32 sums of inexact values
/// within 1e-6, broadcast, all-gather, uneven reduce-scatter and all-gather.
#[test]
#[ignore = "needs CUDA and NCCL (cargo xtask gpu-check)"]
fn emulated_gpu_hosts_run_the_collectives_at_2_and_4_ranks() {
    for world in [2, 4] {
        let (_server, children) = spawn_emulated(world, "collectives");
        let (codes, outs) = finish(children, Duration::from_secs(180));
        for (r, (code, out)) in codes.iter().zip(&outs).enumerate() {
            assert!(
                *code == Some(0) && out.contains(&format!("collectives-ok world={world}")),
                "rank {r} of {world}: exit {code:?}\n{out}"
            );
        }
        println!("OUTCOME {world} emulated GPU hosts: every collective correct (f32, f64, bf16)");
    }
}

/// Live recovery's NCCL step between 2 emulated GPU hosts: every rank aborts its communicator
/// and creates the next one through the store ([`NcclGroup::recreate`]); the all-reduces on
/// the new one are exact.
#[test]
#[ignore = "needs CUDA and NCCL (cargo xtask gpu-check)"]
fn a_communicator_recreated_on_every_rank_runs_the_collectives() {
    let (_server, children) = spawn_emulated(2, "recreated");
    let (codes, outs) = finish(children, Duration::from_secs(120));
    for (r, (code, out)) in codes.iter().zip(&outs).enumerate() {
        assert!(
            *code == Some(0) && out.contains("recreated-ok world=2"),
            "rank {r}: exit {code:?}\n{out}"
        );
    }
    println!("OUTCOME 2 emulated GPU hosts: NCCL communicator re-created, collectives exact");
}

/// A rank SIGKILLed in the middle of 64 MiB NCCL all-reduces between 3 emulated GPU hosts: every
/// other rank fails its all-reduce within the 10 s timeout (plus slack) and exits non-zero.
#[test]
#[ignore = "needs CUDA and NCCL (cargo xtask gpu-check)"]
fn a_rank_killed_mid_nccl_all_reduce_fails_the_others_within_the_timeout() {
    let world = 3;
    let (_server, mut children) = spawn_emulated(world, "killed");
    // Let them all-reduce for a while first.
    std::thread::sleep(Duration::from_secs(15));
    let victim = &mut children.0[world - 1];
    assert!(
        victim.try_wait().unwrap().is_none(),
        "the victim ended early"
    );
    victim.kill().unwrap();
    let killed_at = Instant::now();
    let (codes, outs) = finish(children, Duration::from_secs(60));
    for r in 0..world - 1 {
        assert_eq!(codes[r], Some(4), "rank {r}: {}", outs[r]);
        assert!(outs[r].contains("dead-peer-error"), "rank {r}: {}", outs[r]);
    }
    assert!(
        killed_at.elapsed() < Duration::from_secs(40),
        "the survivors took {:?}",
        killed_at.elapsed()
    );
    println!("OUTCOME a rank killed mid NCCL all-reduce: the others failed and exited");
}
