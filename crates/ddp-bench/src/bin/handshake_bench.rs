//! Cost of authentication: connections per second to the rendezvous store with the job's key
//! (a password-authenticated key exchange, SPAKE2, then both sides confirming the session key)
//! against the same store without a key (the same two round trips without the exchange),
//! measured in the same run; and the time to set up a whole process group (store, `set_once` of
//! each rank's address, the mesh's signed hellos) with one token for every rank, with per-rank
//! keys (as `ddprun` gives them) and without a token.
//!
//! ```text
//! cargo xtask bench handshake [-- --seconds 2 --clients 1,4]
//! ```

use std::time::{Duration, Instant};

use clap::Parser;
use ddp_comm::auth::Key;
use ddp_comm::env::LaunchEnv;
use ddp_comm::{GroupOptions, ProcessGroup, StoreClient, StoreServer};

#[derive(Parser, Debug)]
#[command(about = "Connections per second to the store, with and without the job's key")]
struct Args {
    /// Seconds each measurement runs.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Concurrent connecting clients (threads); several values run each.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    clients: Vec<usize>,
    /// Process groups set up per world size.
    #[arg(long, default_value_t = 20)]
    groups: usize,
}

/// Connections per second `clients` threads make with `connect` for `seconds`.
fn rate(seconds: f64, clients: usize, connect: impl Fn() + Sync) -> f64 {
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let total: usize = std::thread::scope(|s| {
        let threads: Vec<_> = (0..clients)
            .map(|_| {
                s.spawn(|| {
                    let mut n = 0;
                    while Instant::now() < until {
                        connect();
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).sum()
    });
    total as f64 / started.elapsed().as_secs_f64()
}

/// How the ranks of a measured group authenticate.
#[derive(Clone, Copy)]
enum Tokens {
    /// One token for every rank (torchrun's way).
    Shared,
    /// Rank 0 the round's token, every other rank its own key (`ddprun`'s way).
    PerRank,
    /// None: a single-host job's secret file.
    None,
}

/// Median milliseconds to set up a group of `world` ranks (threads of this process) on
/// loopback, with `tokens`.
fn group_setup_ms(world: usize, tokens: Tokens, groups: usize) -> f64 {
    let round = "bench-token";
    let mut times: Vec<f64> = (0..groups)
        .map(|_| {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let started = Instant::now();
            std::thread::scope(|s| {
                let ranks: Vec<_> = (0..world)
                    .map(|rank| {
                        s.spawn(move || {
                            let (token, per_rank) = match tokens {
                                Tokens::Shared => (round.to_string(), "0"),
                                Tokens::PerRank if rank == 0 => (round.to_string(), "1"),
                                Tokens::PerRank => {
                                    (Key::from_token(round).rank_key(rank as u32).to_token(), "1")
                                }
                                Tokens::None => (String::new(), "0"),
                            };
                            let vars = [
                                ("RANK", rank.to_string()),
                                ("WORLD_SIZE", world.to_string()),
                                ("MASTER_ADDR", "127.0.0.1".to_string()),
                                ("MASTER_PORT", port.to_string()),
                                ("DDP_JOB_TOKEN", token),
                                ("DDP_RANK_KEYS", per_rank.to_string()),
                            ];
                            let env = LaunchEnv::from_lookup(|k| {
                                vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
                            })
                            .expect("launch variables");
                            ProcessGroup::init(&env, GroupOptions::default()).expect("group setup")
                        })
                    })
                    .collect();
                // Every rank holds its group until all are set up.
                let _groups: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
            });
            started.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    let args = Args::parse();
    let keyed = StoreServer::bind("127.0.0.1:0", Some("bench-token".into())).expect("bind");
    let open = StoreServer::bind("127.0.0.1:0", None).expect("bind");
    for s in [&keyed, &open] {
        s.limit_clients(4096);
    }
    let (keyed_ep, open_ep) = (
        keyed.local_addr().to_string(),
        open.local_addr().to_string(),
    );
    let t = Duration::from_secs(10);
    println!("\n## Store connections per second (loopback, connect + handshake + close)\n");
    println!("| clients | store, no key (the baseline) | store, job key | key vs no key |");
    println!("|---:|---:|---:|---:|");
    for &clients in &args.clients {
        let none = rate(args.seconds, clients, || {
            drop(StoreClient::connect(&open_ep, None, t).expect("connect"));
        });
        let key = rate(args.seconds, clients, || {
            drop(StoreClient::connect(&keyed_ep, Some("bench-token"), t).expect("connect"));
        });
        println!(
            "| {clients} | {none:.0}/s | {key:.0}/s | {:.2}× |",
            key / none
        );
    }
    println!(
        "\n## Process group set-up (threads as ranks, loopback; median of {})\n",
        args.groups
    );
    println!(
        "| ranks | one DDP_JOB_TOKEN | per-rank keys (ddprun) | no token (single-host secret file) |"
    );
    println!("|---:|---:|---:|---:|");
    for world in [2, 4] {
        let shared = group_setup_ms(world, Tokens::Shared, args.groups);
        let per_rank = group_setup_ms(world, Tokens::PerRank, args.groups);
        let without = group_setup_ms(world, Tokens::None, args.groups);
        println!("| {world} | {shared:.1} ms | {per_rank:.1} ms | {without:.1} ms |");
    }
}
