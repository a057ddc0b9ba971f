//! All-reduce benchmark: a rank program (launch it with `ddprun`, or `cargo xtask bench
//! allreduce`). Rank 0 prints a table of size, median/min/max time, algbw and busbw
//! (busbw = algbw · 2(n−1)/n for an all-reduce, (n−1)/n for a reduce-scatter or an all-gather,
//! the nccl-tests convention). Each timed call is preceded by a
//! barrier; its time is the slowest rank's.
//!
//! ```text
//! ddprun --nproc-per-node 2 -- target/release/examples/allreduce_bench --sizes 8K,1M,25M
//! ```
//!
//! `--compression none,bf16` times every size in each wire format (`ProcessGroup::
//! all_reduce_compressed`; `none` is the plain all-reduce), one after the other in the same run,
//! and the `vs first` column is the first format's median over this one's. The bandwidths are
//! of the f32 data, whatever travels.
//!
//! The `cpu(us)` column is the CPU time (user + system) one call costs the busiest rank; on a
//! machine where ranks share cores with other work, the wall-clock time can be much longer.
//!
//! When the ranks span several hosts (or emulated ones, `DDP_HOST_ID`), each size and wire
//! format is timed with the node-aware all-reduce and with the flat one (`algo` column, the
//! flat one the `vs first` baseline), and two more columns give the bytes the busiest node and
//! the average node sent to other hosts per call, over the buffer's bytes `S` (the
//! transport's own counters), next to `2(k−1)/k`, the bound of any all-reduce on `k` nodes.
//!
//! `--collectives all-reduce,reduce-scatter,all-gather` times the two halves of an all-reduce
//! too, as the sharded optimizer runs them (`ProcessGroup::reduce_scatter_compressed` and
//! `all_gather_into`, even shards), one table each; their bound across hosts is `(k−1)/k`. The
//! all-gather has no compressed form: it runs once per size, as `none`.
//!
//! If `DDP_BENCH_LAUNCH_NS` holds the launch time (Unix nanoseconds), rank 0 also reports the
//! time from launch to the end of the first barrier.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use ddp_comm::{Compression, GroupOptions, LaunchEnv, ProcessGroup, ReduceOp};

#[derive(Parser, Debug)]
#[command(about = "All-reduce benchmark (run one process per rank)")]
struct Args {
    /// Message sizes in bytes of f32 data (suffixes K, M, G = KiB, MiB, GiB).
    #[arg(long, value_delimiter = ',', default_value = "8K,1M,25M,100M")]
    sizes: Vec<String>,
    /// shm (shared memory between same-host ranks) or tcp.
    #[arg(long, default_value = "shm")]
    transport: String,
    /// Timed iterations per size (default: scaled to the size).
    #[arg(long)]
    iters: Option<usize>,
    /// Do not run a barrier before each timed call (times then include rank skew).
    #[arg(long)]
    no_barrier: bool,
    /// Wire formats to compare (none, bf16, fp16); the first is the `vs first` baseline.
    #[arg(long, value_delimiter = ',', default_value = "none")]
    compression: Vec<Compression>,
    /// Collectives to time, one table each: all-reduce, reduce-scatter, all-gather.
    #[arg(long, value_delimiter = ',', default_value = "all-reduce")]
    collectives: Vec<Collective>,
    /// Pin rank r to CPU core `LOCAL_RANK % cores` (as `numactl`/`taskset` would).
    #[arg(long)]
    pin: bool,
}

/// A collective the benchmark times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Collective {
    /// `all_reduce_compressed` (the plain all-reduce for `none`).
    AllReduce,
    /// `reduce_scatter_compressed` into even shards.
    ReduceScatter,
    /// `all_gather_into` of even shards.
    AllGather,
}

impl Collective {
    fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllGather => "all_gather_into",
        }
    }

    /// What any algorithm must send across per node, over the buffer, on `k` nodes.
    fn bound(self, k: usize) -> f64 {
        let share = (k - 1) as f64 / k as f64;
        match self {
            Collective::AllReduce => 2.0 * share,
            Collective::ReduceScatter | Collective::AllGather => share,
        }
    }

    /// Runs it once on `buf` (`counts`: even shards).
    fn call(
        self,
        pg: &mut ProcessGroup,
        buf: &mut [f32],
        counts: &[usize],
        wire: Compression,
    ) -> ddp_comm::Result<()> {
        match self {
            Collective::AllReduce => pg.all_reduce_compressed(buf, ReduceOp::Sum, wire),
            Collective::ReduceScatter => {
                pg.reduce_scatter_compressed(buf, counts, ReduceOp::Sum, wire)
            }
            Collective::AllGather => pg.all_gather_into(buf, counts),
        }
    }

    /// Whether this call takes the node-aware path.
    fn node_aware(self, pg: &ProcessGroup, wire: Compression) -> bool {
        match (self, wire) {
            (Collective::AllReduce, Compression::None) | (Collective::AllGather, _) => {
                pg.node_aware()
            }
            (Collective::AllReduce, _) => pg.compressed_node_aware(),
            (Collective::ReduceScatter, Compression::None) => pg.reduce_scatter_node_aware(),
            // The compressed reduce-scatter has no node-aware path.
            (Collective::ReduceScatter, _) => false,
        }
    }
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .map(|n| n * mul)
        .map_err(|_| format!("bad size {s:?} (expected e.g. 8K, 1M, 25M)"))
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes.is_multiple_of(1 << 10) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

/// CPU time (user + system) this process has used.
fn cpu_time() -> f64 {
    // SAFETY: getrusage fills the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("allreduce_bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let sizes = args
        .sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<Vec<_>, _>>()?;
    let shm = match args.transport.as_str() {
        "shm" => true,
        "tcp" => false,
        t => return Err(format!("unknown transport {t:?} (shm or tcp)").into()),
    };
    let env = LaunchEnv::from_env()?;
    if args.pin {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // SAFETY: a zeroed cpu_set_t is valid; CPU_SET writes inside it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(env.local_rank % cores, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(format!("pinning: {}", std::io::Error::last_os_error()).into());
            }
        }
    }
    let opts = GroupOptions {
        shared_memory: shm,
        ..GroupOptions::default()
    };
    let mut pg = ProcessGroup::init(&env, opts)?;
    pg.barrier()?;
    let first_barrier = SystemTime::now();
    let n = pg.world_size();
    let rank = pg.rank();

    // Launch → first barrier, the slowest rank's view.
    if let Some(launch) = std::env::var("DDP_BENCH_LAUNCH_NS")
        .ok()
        .and_then(|v| v.parse::<u128>().ok())
    {
        let done = first_barrier.duration_since(UNIX_EPOCH)?.as_nanos();
        let mut t = [done.saturating_sub(launch) as f64 / 1e6];
        pg.all_reduce(&mut t, ReduceOp::Max)?;
        if rank == 0 {
            println!("launch -> first barrier done ({n} ranks): {:.1} ms", t[0]);
        }
    }

    // A correctness check before timing.
    let mut check = vec![(rank + 1) as f32; 1000];
    pg.all_reduce(&mut check, ReduceOp::Sum)?;
    let want = (n * (n + 1) / 2) as f32;
    if check.iter().any(|&v| v != want) {
        return Err(format!("wrong all_reduce result: {} != {want}", check[0]).into());
    }

    for &collective in &args.collectives {
        time_collective(&mut pg, collective, &sizes, &args)?;
    }
    pg.barrier()?;
    Ok(())
}

/// One table: `collective` at every size and wire format (every rank calls it).
fn time_collective(
    pg: &mut ProcessGroup,
    collective: Collective,
    sizes: &[usize],
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    let (n, rank) = (pg.world_size(), pg.rank());
    if rank == 0 {
        let kinds = pg.transports();
        let shm_peers = kinds
            .iter()
            .filter(|k| **k == ddp_comm::group::Transport::SharedMemory)
            .count();
        println!(
            "\n{}(f32{}): {n} ranks, transport {} ({} shared-memory peers of rank 0)",
            collective.name(),
            if collective == Collective::AllGather {
                ""
            } else {
                ", sum"
            },
            args.transport,
            shm_peers
        );
        if let Some(h) = pg.hosts().filter(|h| h.len() > 1) {
            let layout: Vec<String> = h.iter().map(|r| r.len().to_string()).collect();
            println!(
                "{} hosts ({} ranks each); across/S: bytes sent to other hosts per call over \
                 the buffer's, busiest node and mean; bound {} = {:.3}",
                h.len(),
                layout.join(" + "),
                if collective == Collective::AllReduce {
                    "2(k-1)/k"
                } else {
                    "(k-1)/k"
                },
                collective.bound(h.len())
            );
        }
        println!(
            "{:>10} {:>10} {:>5} {:>10} {:>12} {:>12} {:>12} {:>12} {:>12} {:>10} {:>9} {:>10} {:>10}",
            "size",
            "count",
            "wire",
            "algo",
            "median(us)",
            "min(us)",
            "max(us)",
            "algbw(GB/s)",
            "busbw(GB/s)",
            "cpu(us)",
            "vs first",
            "across/S",
            "mean/S"
        );
    }
    // Across hosts, the node-aware path and the flat one (the baseline, timed first).
    let algos: &[bool] = if pg.node_aware() {
        &[false, true]
    } else {
        &[false]
    };
    // The all-gather has no compressed form.
    let wires: &[Compression] = if collective == Collective::AllGather {
        &[Compression::None]
    } else {
        &args.compression
    };
    for &bytes in sizes {
        let mut first = None;
        for &wire in wires {
            for &aware in algos {
                pg.set_node_aware(aware);
                let t = time_size(pg, collective, bytes, wire, args)?;
                if rank == 0 {
                    let base = *first.get_or_insert(t.median);
                    t.print(collective, bytes, n, wire, base);
                }
            }
        }
    }
    pg.set_node_aware(algos.contains(&true));
    Ok(())
}

/// The slowest rank's times of one size in one wire format.
struct Timing {
    count: usize,
    median: f64,
    min: f64,
    max: f64,
    /// CPU seconds per call of the busiest rank.
    cpu: f64,
    /// `node-aware`, `flat` (several hosts) or `-`.
    algo: &'static str,
    /// Bytes sent to other hosts per call by the busiest node and by the average node.
    across: (f64, f64),
}

impl Timing {
    fn print(
        &self,
        collective: Collective,
        bytes: usize,
        n: usize,
        wire: Compression,
        first_median: f64,
    ) {
        let algbw = (self.count * 4) as f64 / self.median / 1e9;
        // nccl-tests' factors: 2(n−1)/n for an all-reduce, (n−1)/n for its halves.
        let share = (n - 1) as f64 / n as f64;
        let busbw = algbw
            * match collective {
                Collective::AllReduce => 2.0 * share,
                Collective::ReduceScatter | Collective::AllGather => share,
            };
        let of_s = |b: f64| {
            if self.algo == "-" {
                "-".to_string()
            } else {
                format!("{:.3}", b / bytes as f64)
            }
        };
        println!(
            "{:>10} {:>10} {:>5} {:>10} {:>12.1} {:>12.1} {:>12.1} {:>12.3} {:>12.3} {:>10.1} {:>8.2}x {:>10} {:>10}",
            human(bytes),
            self.count,
            wire.name(),
            self.algo,
            self.median * 1e6,
            self.min * 1e6,
            self.max * 1e6,
            algbw,
            busbw,
            self.cpu * 1e6,
            first_median / self.median,
            of_s(self.across.0),
            of_s(self.across.1)
        );
    }
}

/// Times `collective` on `bytes` of f32 data in the `wire` format (every rank calls it).
fn time_size(
    pg: &mut ProcessGroup,
    collective: Collective,
    bytes: usize,
    wire: Compression,
    args: &Args,
) -> Result<Timing, Box<dyn std::error::Error>> {
    let count = bytes / 4;
    let mut buf = vec![0.0f32; count];
    let n = pg.world_size();
    let mut counts = vec![count / n; n];
    counts[0] += count % n;
    let iters = args
        .iters
        .unwrap_or_else(|| ((256usize << 20) / bytes.max(1)).clamp(10, 1000));
    let warmup = (iters / 10).max(2);
    let mut times = Vec::with_capacity(iters);
    let mut cpu0 = 0.0;
    let mut across0 = 0;
    for i in 0..warmup + iters {
        if i == warmup {
            cpu0 = cpu_time();
            across0 = pg.bytes_sent_across_hosts();
        }
        if !args.no_barrier {
            pg.barrier()?;
        }
        let t = Instant::now();
        collective.call(pg, &mut buf, &counts, wire)?;
        let dt = t.elapsed();
        if i >= warmup {
            times.push(dt.as_secs_f64());
        }
    }
    // CPU per call, barriers included (they cost little next to the transfer).
    let mut cpu = [(cpu_time() - cpu0) / iters as f64];
    // Bytes to other hosts per call, the barriers' few included, summed per node.
    let hosts = pg.hosts().unwrap_or_default();
    let mut per_node = vec![0.0f64; hosts.len()];
    if let Some(j) = hosts.iter().position(|h| h.contains(&pg.rank())) {
        per_node[j] = (pg.bytes_sent_across_hosts() - across0) as f64 / iters as f64;
    }
    pg.all_reduce(&mut per_node, ReduceOp::Sum)?;
    pg.all_reduce(&mut times, ReduceOp::Max)?;
    pg.all_reduce(&mut cpu, ReduceOp::Max)?;
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(Timing {
        count,
        median: times[times.len() / 2],
        min: times[0],
        max: times[times.len() - 1],
        cpu: cpu[0],
        algo: match (hosts.len() > 1, collective.node_aware(pg, wire)) {
            (false, _) => "-",
            (true, true) => "node-aware",
            (true, false) => "flat",
        },
        across: (
            per_node.iter().cloned().fold(0.0, f64::max),
            per_node.iter().sum::<f64>() / per_node.len().max(1) as f64,
        ),
    })
}
