//! A rank program for the integration tests: joins the process group from the launch
//! environment, runs one named scenario and checks every result against values it computes
//! itself (rank `r` contributes `f(r, i)` at index `i`).
//!
//! Exit codes: 0 success, 1 a wrong result, 2 bad usage, 3 a communication error (the
//! expected outcome of the fault scenarios, printed as `comm error: …`).
//!
//! Scenarios:
//! - `matrix`: every collective × element type × reduce op × length (0, 1, primes, not
//!   divisible by the world size, above the inline threshold).
//! - `big`: a 25M-element f32 all-reduce (100 MB) with sum and max.
//! - `loop-big`: 25M-element f32 all-reduces until an error, printing `iter k` after each.
//! - `mismatch-len`: rank 1 passes one element more; every rank must get `Mismatch`.
//! - `stall`: rank 1 sleeps `--stall-ms` before the barrier the others wait in.
//! - `barrier`: joins and runs one barrier.
//! - `forge-addr`: an attack by a rank-key holder (finding 1 of the v4 attack suite): before
//!   joining, rank 1 connects to rank 0's store with its own key and tries to publish rank
//!   2's address (rank 2 starts a second late, so the forgery would come first), printing
//!   `rank 1: forging rank 2's address: refused (…)` or `… accepted`; then every rank joins
//!   and runs one barrier.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use ddp_comm::{CommError, Element, GroupOptions, LaunchEnv, ProcessGroup, ReduceOp};

#[derive(Parser, Debug)]
#[command(about = "Rank program for the ddp-comm integration tests")]
struct Args {
    /// The scenario to run.
    scenario: String,
    /// No shared memory: the data travels over the streams (a Unix socket between ranks of
    /// one host, TCP between hosts).
    #[arg(long)]
    no_shm: bool,
    /// Collective timeout in seconds.
    #[arg(long, default_value_t = 60.0)]
    timeout_secs: f64,
    /// Rendezvous timeout in seconds.
    #[arg(long, default_value_t = 30.0)]
    connect_timeout_secs: f64,
    /// For `stall`: how long rank 1 sleeps.
    #[arg(long, default_value_t = 5000)]
    stall_ms: u64,
    /// How long rank 1 waits before it joins the group (the others join at once).
    #[arg(long, default_value_t = 0)]
    rank1_join_delay_ms: u64,
    /// Join a running group in place of a lost process of this rank
    /// (`ProcessGroup::rejoin`).
    #[arg(long)]
    rejoin: bool,
    /// For `reform`: how many all-reduces in all.
    #[arg(long, default_value_t = 300)]
    iterations: u64,
    /// For `reform`: the last rank SIGKILLs itself before this all-reduce (unless it is a
    /// replacement, `--rejoin` or `DDP_REJOIN=1`, or a restarted group's).
    #[arg(long)]
    die_at: Option<u64>,
}

/// A scenario failure: a wrong result (exit 1) or a communication error (exit 3).
enum Failure {
    Wrong(String),
    Comm(CommError),
}

impl From<CommError> for Failure {
    fn from(e: CommError) -> Self {
        Failure::Comm(e)
    }
}

type Res<T = ()> = Result<T, Failure>;

fn wrong(msg: String) -> Failure {
    Failure::Wrong(msg)
}

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let env = match LaunchEnv::from_env() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("comm error: {e}");
            return ExitCode::from(3);
        }
    };
    let opts = GroupOptions {
        timeout: Duration::from_secs_f64(args.timeout_secs),
        connect_timeout: Duration::from_secs_f64(args.connect_timeout_secs),
        shared_memory: !args.no_shm,
        listen_ports: None,
    };
    let rank = env.rank;
    if args.scenario == "forge-addr" {
        forge_addr(&env);
    }
    if rank == 1 {
        std::thread::sleep(Duration::from_millis(args.rank1_join_delay_ms));
    }
    let t0 = Instant::now();
    let joined = if args.rejoin || ddp_comm::env::rejoining() {
        ProcessGroup::rejoin(&env, opts)
    } else {
        ProcessGroup::init(&env, opts)
    };
    let result = joined.map_err(Failure::from).and_then(|mut pg| {
        println!(
            "rank {rank}: joined in {:?} (node-aware all-reduce {})",
            t0.elapsed(),
            if pg.node_aware() { "on" } else { "off" }
        );
        run(&args, &mut pg)
    });
    match result {
        Ok(()) => {
            println!("rank {rank}: {} ok", args.scenario);
            ExitCode::SUCCESS
        }
        Err(Failure::Wrong(m)) => {
            eprintln!("rank {rank}: WRONG RESULT in {}: {m}", args.scenario);
            ExitCode::from(1)
        }
        Err(Failure::Comm(e)) => {
            eprintln!("rank {rank}: comm error: {e}");
            ExitCode::from(3)
        }
    }
}

fn run(args: &Args, pg: &mut ProcessGroup) -> Res {
    match args.scenario.as_str() {
        "matrix" => matrix(pg),
        "big" => big(pg),
        "loop-big" => loop_big(pg),
        "reform" => reform(
            pg,
            args.iterations,
            // Only the first process of the first attempt dies (not a replacement, nor a
            // restarted group).
            args.die_at.filter(|_| {
                !args.rejoin
                    && !ddp_comm::env::rejoining()
                    && std::env::var("DDP_RESTART_COUNT")
                        .ok()
                        .is_none_or(|c| c == "0")
            }),
        ),
        "mismatch-len" => mismatch_len(pg),
        "stall" => stall(pg, Duration::from_millis(args.stall_ms)),
        "barrier" | "forge-addr" => Ok(pg.barrier()?),
        s => Err(wrong(format!("unknown scenario {s:?}"))),
    }
}

/// `forge-addr`'s attack (see the module doc): rank 1 tries to publish rank 2's address.
fn forge_addr(env: &LaunchEnv) {
    use ddp_comm::store::{CompareSet, PrefixStore, Store, keys};
    match env.rank {
        1 => {
            let tried = ddp_comm::job_auth::JobAuth::for_client(env)
                .and_then(|mut auth| auth.connect(Duration::from_secs(30)))
                .and_then(|mut store| {
                    PrefixStore::new(&mut store, keys::PROCESS_GROUP)
                        .set_once(&keys::peer_addr(2), b"127.0.0.1:9 forged")
                });
            match tried {
                Ok(CompareSet::Swapped) => println!("rank 1: forging rank 2's address: accepted"),
                Ok(other) => println!("rank 1: forging rank 2's address: too late ({other:?})"),
                Err(e) => println!("rank 1: forging rank 2's address: refused ({e})"),
            }
        }
        2 => std::thread::sleep(Duration::from_secs(1)),
        _ => {}
    }
}

/// Element types the matrix runs, with conversions from small integers.
trait TestElem: Element + Copy + PartialEq {
    fn of(v: i64) -> Self;
}
impl TestElem for f32 {
    fn of(v: i64) -> Self {
        v as f32
    }
}
impl TestElem for f64 {
    fn of(v: i64) -> Self {
        v as f64
    }
}
impl TestElem for i64 {
    fn of(v: i64) -> Self {
        v
    }
}
impl TestElem for i32 {
    fn of(v: i64) -> Self {
        v as i32
    }
}
impl TestElem for u8 {
    fn of(v: i64) -> Self {
        v as u8
    }
}

/// Rank `r`'s value at index `i`: small integers (exact in every type; non-negative for u8,
/// and small enough that a sum over 4 ranks fits a u8).
fn f<T: TestElem>(r: usize, i: usize) -> T {
    let v = ((r * 7 + i * 13 + 3) % 23) as i64;
    if T::NAME == "u8" {
        T::of(v % 60)
    } else {
        T::of(v - 11)
    }
}

fn expected<T: TestElem>(n: usize, i: usize, op: ReduceOp) -> T {
    let vals: Vec<T> = (0..n).map(|r| f::<T>(r, i)).collect();
    let mut acc = vals[0];
    for &v in &vals[1..] {
        acc = match op {
            ReduceOp::Sum | ReduceOp::Mean => T::add(acc, v),
            ReduceOp::Max => {
                if v > acc {
                    v
                } else {
                    acc
                }
            }
            ReduceOp::Min => {
                if v < acc {
                    v
                } else {
                    acc
                }
            }
        };
    }
    if op == ReduceOp::Mean {
        acc = T::div_count(acc, n);
    }
    acc
}

fn lengths(n: usize) -> Vec<usize> {
    // 0, 1, small primes, not divisible by n, and primes above the 64 KiB inline threshold.
    vec![0, 1, 2, 3, 13, 4 * n + 1, 997, 16_411, 100_003]
}

fn check<T: TestElem>(what: &str, got: &[T], want: impl Fn(usize) -> T) -> Res {
    for (i, g) in got.iter().enumerate() {
        let w = want(i);
        if *g != w {
            return Err(wrong(format!(
                "{what}: element {i} of {} is {g:?}, expected {w:?}",
                got.len()
            )));
        }
    }
    Ok(())
}

fn matrix_for<T: TestElem>(pg: &mut ProcessGroup) -> Res {
    let n = pg.world_size();
    let r = pg.rank();
    for len in lengths(n) {
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
            let mut buf: Vec<T> = (0..len).map(|i| f(r, i)).collect();
            pg.all_reduce(&mut buf, op)?;
            check(
                &format!("all_reduce<{}>({op:?}, len {len})", T::NAME),
                &buf,
                |i| expected::<T>(n, i, op),
            )?;
        }
        for root in 0..n {
            let mut buf: Vec<T> = (0..len)
                .map(|i| if r == root { f(root, i) } else { T::of(1) })
                .collect();
            pg.broadcast(&mut buf, root)?;
            check(
                &format!("broadcast<{}>(root {root}, len {len})", T::NAME),
                &buf,
                |i| f(root, i),
            )?;
        }
        let input: Vec<T> = (0..len).map(|i| f(r, i)).collect();
        let mut out = vec![T::of(0); len * n];
        pg.all_gather(&input, &mut out)?;
        check(&format!("all_gather<{}>(len {len})", T::NAME), &out, |j| {
            f(j / len.max(1), j % len.max(1))
        })?;
        // Variable lengths: rank q contributes len + 3q elements (rank 0 maybe none).
        let mine: Vec<T> = (0..len + 3 * r).map(|i| f(r, i)).collect();
        let all = pg.all_gather_varlen(&mine)?;
        if all.len() != n {
            return Err(wrong(format!("all_gather_varlen: {} parts", all.len())));
        }
        for (q, part) in all.iter().enumerate() {
            if part.len() != len + 3 * q {
                return Err(wrong(format!(
                    "all_gather_varlen: rank {q}'s part has {} elements, expected {}",
                    part.len(),
                    len + 3 * q
                )));
            }
            check(
                &format!("all_gather_varlen<{}>(rank {q}, len {len})", T::NAME),
                part,
                |i| f(q, i),
            )?;
        }
    }
    Ok(())
}

fn matrix(pg: &mut ProcessGroup) -> Res {
    matrix_for::<f32>(pg)?;
    matrix_for::<f64>(pg)?;
    matrix_for::<i64>(pg)?;
    matrix_for::<i32>(pg)?;
    matrix_for::<u8>(pg)?;
    let n = pg.world_size();
    for root in 0..n {
        for len in [0usize, 1, 7, 70_001] {
            let msg: Vec<u8> = (0..len).map(|i| (i * 31 + root) as u8).collect();
            let mut bytes = if pg.rank() == root {
                msg.clone()
            } else {
                vec![9; 5]
            };
            pg.broadcast_bytes(&mut bytes, root)?;
            if bytes != msg {
                return Err(wrong(format!(
                    "broadcast_bytes(root {root}, len {len}): got {} bytes, wrong content",
                    bytes.len()
                )));
            }
        }
    }
    pg.barrier()?;
    Ok(())
}

fn big_value(r: usize, i: usize) -> f32 {
    ((r * 5 + i) % 17) as f32
}

fn big(pg: &mut ProcessGroup) -> Res {
    let n = pg.world_size();
    let r = pg.rank();
    let len = 25_000_000;
    let mut buf: Vec<f32> = (0..len).map(|i| big_value(r, i)).collect();
    pg.all_reduce(&mut buf, ReduceOp::Sum)?;
    check("all_reduce<f32>(Sum, 25M)", &buf, |i| {
        (0..n).map(|q| big_value(q, i)).sum()
    })?;
    for (i, x) in buf.iter_mut().enumerate() {
        *x = big_value(r, i);
    }
    pg.all_reduce(&mut buf, ReduceOp::Max)?;
    check("all_reduce<f32>(Max, 25M)", &buf, |i| {
        (0..n).map(|q| big_value(q, i)).fold(f32::MIN, f32::max)
    })?;
    Ok(())
}

fn loop_big(pg: &mut ProcessGroup) -> Res {
    let mut buf = vec![1.0f32; 25_000_000];
    for k in 1.. {
        pg.all_reduce(&mut buf, ReduceOp::Max)?;
        println!("rank {}: iter {k}", pg.rank());
    }
    Ok(())
}

/// All-reduces of 1 M floats, `iterations` in all, each checked; when one fails (a lost
/// peer), the group is re-formed and the ranks go on from the furthest any of them got (a
/// rank that finished an all-reduce holds its whole result). A replacement started with
/// `--rejoin` joins at that point.
fn reform(pg: &mut ProcessGroup, iterations: u64, die_at: Option<u64>) -> Res {
    let rank = pg.rank();
    let pid = std::process::id();
    let world = pg.world_size() as f32;
    let mut next = agree_on_next(pg, 0)?;
    println!(
        "rank {rank} (pid {pid}): generation {} from iteration {next} at {} ms",
        pg.generation(),
        unix_ms()
    );
    while next < iterations {
        if die_at == Some(next) && rank + 1 == pg.world_size() {
            println!("rank {rank}: dying at {} ms", unix_ms());
            // SAFETY: raise has no preconditions; SIGKILL ends this process here.
            unsafe { libc::raise(libc::SIGKILL) };
        }
        let k = (next % 7 + 1) as f32;
        let mut x = vec![(rank + 1) as f32 * k; 1 << 20];
        match pg.all_reduce(&mut x, ReduceOp::Sum) {
            Ok(()) => {
                let want = k * world * (world + 1.0) / 2.0;
                if let Some(i) = x.iter().position(|&v| v != want) {
                    return Err(wrong(format!(
                        "iteration {next}: [{i}] = {} != {want}",
                        x[i]
                    )));
                }
                next += 1;
                if next % 10 == 0 {
                    println!("rank {rank}: iter {next}");
                }
            }
            Err(e) => {
                println!("rank {rank}: lost a peer in iteration {next}: {e}");
                pg.reform()?;
                next = agree_on_next(pg, next)?;
                println!(
                    "rank {rank} (pid {pid}): re-formed as generation {} from iteration {next} at {} ms",
                    pg.generation(),
                    unix_ms()
                );
            }
        }
    }
    Ok(())
}

/// Milliseconds since the Unix epoch (the recovery's timeline across processes).
fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// The furthest iteration any rank got to.
fn agree_on_next(pg: &mut ProcessGroup, mine: u64) -> Res<u64> {
    let mut n = [mine as i64];
    pg.all_reduce(&mut n, ReduceOp::Max)?;
    Ok(n[0] as u64)
}

fn mismatch_len(pg: &mut ProcessGroup) -> Res {
    let len = 1000 + usize::from(pg.rank() == 1);
    let mut buf = vec![1.0f32; len];
    match pg.all_reduce(&mut buf, ReduceOp::Sum) {
        Err(CommError::Mismatch(m)) => {
            println!("rank {}: got the expected mismatch: {m}", pg.rank());
            Ok(())
        }
        Err(e) => Err(wrong(format!("expected a Mismatch error, got: {e}"))),
        Ok(()) => Err(wrong(
            "expected a Mismatch error, the call succeeded".into(),
        )),
    }
}

fn stall(pg: &mut ProcessGroup, nap: Duration) -> Res {
    if pg.rank() == 1 {
        std::thread::sleep(nap);
    }
    pg.barrier()?;
    Ok(())
}
