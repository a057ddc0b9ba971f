//! In-process tests: threads act as ranks over loopback (TCP and shared memory).

use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::mesh::{MeshConfig, PeerInfo};
use super::peer_stream::PeerStream;
use super::*;
use crate::env::EnvSource;
use crate::store::{PrefixStore, Store, keys};

use ddp_testkit::free_port;

fn env(rank: usize, world: usize, port: u16, token: &str) -> LaunchEnv {
    LaunchEnv {
        rank,
        world_size: world,
        local_rank: rank,
        local_world_size: world,
        group_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        job_token: Some(token.into()),
        rank_keys: false,
        source: EnvSource::Torchrun,
    }
}

pub(crate) fn opts(shm: bool) -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(20),
        connect_timeout: Duration::from_secs(10),
        shared_memory: shm,
        listen_ports: None,
    }
}

/// Runs `f(pg)` on `world` threads that form a group; returns each rank's result.
pub(crate) fn run_ranks<R: Send + 'static>(
    world: usize,
    o: GroupOptions,
    f: impl Fn(&mut ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    run_ranks_on(&vec![String::new(); world], o, f)
}

/// [`run_ranks`] with rank `r` on the emulated host `hosts[r]` (empty: this machine's).
fn run_ranks_on<R: Send + 'static>(
    hosts: &[String],
    o: GroupOptions,
    f: impl Fn(&mut ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let world = hosts.len();
    static N: AtomicU64 = AtomicU64::new(0);
    let token = format!("test-token-{}", N.fetch_add(1, Ordering::Relaxed));
    let port = free_port();
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let (f, o, token) = (f.clone(), o.clone(), token.clone());
            let host = Some(hosts[r].clone()).filter(|h| !h.is_empty());
            std::thread::spawn(move || {
                mesh::TEST_HOST_ID.with(|h| *h.borrow_mut() = host);
                let mut pg = ProcessGroup::init(&env(r, world, port, &token), o)
                    .unwrap_or_else(|e| panic!("rank {r}: init: {e}"));
                f(&mut pg)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn value(rank: usize, i: usize) -> f32 {
    ((rank * 31 + i * 7) % 101) as f32 - 50.0
}

fn check_all_reduce(world: usize, shm: bool, len: usize) {
    let res = run_ranks(world, opts(shm), move |pg| {
        let r = pg.rank();
        let mut sum: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
        pg.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
        let mut max: Vec<i64> = (0..len).map(|i| value(r, i) as i64).collect();
        pg.all_reduce(&mut max, ReduceOp::Max).unwrap();
        let mut mean: Vec<f64> = (0..len).map(|i| value(r, i) as f64).collect();
        pg.all_reduce(&mut mean, ReduceOp::Mean).unwrap();
        (sum, max, mean)
    });
    for (sum, max, mean) in &res {
        for i in 0..len {
            let vals: Vec<f32> = (0..world).map(|r| value(r, i)).collect();
            let s: f32 = vals.iter().sum();
            assert_eq!(sum[i], s, "sum at {i}");
            assert_eq!(max[i], vals.iter().cloned().fold(f32::MIN, f32::max) as i64);
            assert!((mean[i] - s as f64 / world as f64).abs() < 1e-9);
        }
    }
}

#[test]
fn all_reduce_small_and_large_tcp_and_shm() {
    for shm in [true, false] {
        for world in [2, 3] {
            for len in [0, 1, 7, 1000, 40_000, 300_001] {
                check_all_reduce(world, shm, len);
            }
        }
    }
}

/// Ranks of one host share memory, or without it meet over the Unix socket; ranks of two
/// hosts over TCP.
#[test]
fn transports_follow_the_option_and_the_hosts() {
    let t = run_ranks(2, opts(true), |pg| pg.transports());
    assert_eq!(t[0], vec![Transport::SelfRank, Transport::SharedMemory]);
    let t = run_ranks(2, opts(false), |pg| pg.transports());
    assert_eq!(t[1], vec![Transport::LocalSocket, Transport::SelfRank]);
    let hosts = ["host-a", "host-a", "host-b"].map(String::from);
    let t = run_ranks_on(&hosts, opts(false), |pg| pg.transports());
    assert_eq!(
        t[0],
        vec![Transport::SelfRank, Transport::LocalSocket, Transport::Tcp]
    );
    let t = run_ranks_on(&hosts, opts(true), |pg| pg.transports());
    assert_eq!(
        t[2],
        vec![Transport::Tcp, Transport::Tcp, Transport::SelfRank]
    );
}

/// A rank's socket directory (private to the user) is gone once the group stands: nothing
/// is left to connect to or to clean up, and the group works on.
#[test]
fn the_local_socket_is_removed_once_the_mesh_stands() {
    let paths = run_ranks(2, opts(false), |pg| {
        let r = pg.rank();
        let home = pg.home.as_mut().expect("a group of two");
        let mut ns = PrefixStore::new(&mut home.store, keys::PROCESS_GROUP);
        let me = ns.get(&keys::peer_addr(r), Duration::from_secs(5)).unwrap();
        let socket = PeerInfo::decode(&me).unwrap().socket;
        pg.barrier().unwrap();
        let mut x = [1.0f32];
        pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x[0], 2.0);
        std::path::PathBuf::from(socket)
    });
    for p in &paths {
        let dir = p.parent().expect("a socket in a directory");
        assert!(
            dir.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("ddp-comm-")),
            "{}",
            p.display()
        );
        assert!(!dir.exists(), "{} left behind", dir.display());
    }
}

#[test]
fn broadcast_gather_barrier() {
    for shm in [true, false] {
        for len in [0usize, 5, 100_003] {
            let res = run_ranks(3, opts(shm), move |pg| {
                let r = pg.rank();
                let mut b: Vec<i32> = (0..len)
                    .map(|i| if r == 1 { i as i32 } else { -1 })
                    .collect();
                pg.broadcast(&mut b, 1).unwrap();
                let input: Vec<u8> = (0..len).map(|i| (i + r) as u8).collect();
                let mut out = vec![0u8; len * 3];
                pg.all_gather(&input, &mut out).unwrap();
                let mine: Vec<f64> = (0..len + r * 3).map(|i| (i * 10 + r) as f64).collect();
                let var = pg.all_gather_varlen(&mine).unwrap();
                let mut bytes = if r == 2 {
                    vec![7u8; len * 2 + 1]
                } else {
                    vec![1, 2, 3]
                };
                pg.broadcast_bytes(&mut bytes, 2).unwrap();
                pg.barrier().unwrap();
                (b, out, var, bytes)
            });
            for (b, out, var, bytes) in res {
                assert_eq!(b, (0..len).map(|i| i as i32).collect::<Vec<_>>());
                for r in 0..3 {
                    let want: Vec<u8> = (0..len).map(|i| (i + r) as u8).collect();
                    assert_eq!(&out[r * len..(r + 1) * len], &want[..]);
                    let w: Vec<f64> = (0..len + r * 3).map(|i| (i * 10 + r) as f64).collect();
                    assert_eq!(var[r], w);
                }
                assert_eq!(bytes, vec![7u8; len * 2 + 1]);
            }
        }
    }
}

#[test]
fn mismatched_lengths_fail_on_every_rank() {
    let res = run_ranks(3, opts(true), |pg| {
        let mut v = vec![1.0f32; 100 + (pg.rank() == 2) as usize];
        let e = pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
        let later = pg.barrier().unwrap_err();
        (e, later)
    });
    for (e, later) in res {
        assert!(matches!(e, CommError::Mismatch(_)), "{e}");
        assert!(matches!(later, CommError::Poisoned(_)), "{later}");
    }
}

#[test]
fn mismatched_types_and_ops_fail() {
    let res = run_ranks(2, opts(false), |pg| {
        let e1 = if pg.rank() == 0 {
            pg.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum)
        } else {
            pg.all_reduce(&mut [1i32; 4], ReduceOp::Sum)
        };
        e1.unwrap_err()
    });
    for e in res {
        let msg = e.to_string();
        assert!(matches!(e, CommError::Mismatch(_)), "{msg}");
        assert!(msg.contains("f32") && msg.contains("i32"), "{msg}");
    }
}

#[test]
fn a_departed_peer_is_reported_not_waited_for() {
    for shm in [true, false] {
        let res = run_ranks(2, opts(shm), |pg| {
            if pg.rank() == 1 {
                return None;
            }
            // Give rank 1 time to drop its group.
            std::thread::sleep(Duration::from_millis(100));
            let t = Instant::now();
            let e = pg.all_reduce(&mut vec![1.0f32; 1 << 20], ReduceOp::Sum);
            Some((e.unwrap_err(), t.elapsed()))
        });
        let (e, _) = res[0].as_ref().unwrap();
        assert!(
            matches!(e, CommError::PeerClosed { peer: 1, .. }),
            "shm={shm}: {e}"
        );
    }
}

#[test]
fn a_stalled_peer_times_out_naming_it() {
    let mut o = opts(true);
    o.timeout = Duration::from_millis(300);
    let res = run_ranks(2, o, |pg| {
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_millis(800));
            return None;
        }
        Some(pg.barrier().unwrap_err())
    });
    let e = res[0].as_ref().unwrap();
    assert!(matches!(e, CommError::Timeout { peer: Some(1), .. }), "{e}");
}

#[test]
fn missing_rank_times_out_naming_it() {
    let port = free_port();
    let mut o = opts(true);
    o.connect_timeout = Duration::from_millis(500);
    let hs: Vec<_> = (0..2)
        .map(|r| {
            let o = o.clone();
            std::thread::spawn(move || ProcessGroup::init(&env(r, 3, port, "t"), o).unwrap_err())
        })
        .collect();
    for h in hs {
        let e = h.join().unwrap();
        assert!(matches!(e, CommError::Timeout { peer: Some(2), .. }), "{e}");
        assert!(e.to_string().contains("rank(s) 2"), "{e}");
    }
}

/// Rank 0's side of a two-rank rendezvous on `listener`, run on a thread until `within`:
/// the infos both ranks published, rank 1's identity, and the thread's outcome.
fn rank0_accepting(
    within: Duration,
) -> (
    Vec<PeerInfo>,
    crate::auth::Identity,
    std::thread::JoinHandle<Result<usize>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (zero, one) = (
        crate::auth::Identity::generate(),
        crate::auth::Identity::generate(),
    );
    let infos = vec![
        PeerInfo {
            addr,
            host: "a".into(),
            socket: String::new(),
            nonce: crate::auth::nonce(),
            identity: zero.public(),
        },
        PeerInfo {
            addr,
            host: "b".into(),
            socket: String::new(),
            nonce: crate::auth::nonce(),
            identity: one.public(),
        },
    ];
    let published = infos.clone();
    let t = std::thread::spawn(move || {
        let started = Instant::now();
        let cfg = MeshConfig {
            rank: 0,
            world: 2,
            identity: &zero,
            nonce: infos[0].nonce,
            shared_memory: true,
            deadline: started + within,
            started,
        };
        mesh::establish(&cfg, listener, None, &infos, &|| false)
            .map(|links| links.iter().flatten().count())
    });
    (published, one, t)
}

/// Sends `hello` to `addr` and returns the reply.
fn exchange(addr: std::net::SocketAddr, hello: &mesh::Hello) -> Option<mesh::Reply> {
    let mut s = PeerStream::Tcp(std::net::TcpStream::connect(addr).unwrap());
    mesh::write_handshake(&mut s, &hello.encode()).unwrap();
    mesh::decode_reply(&mesh::read_handshake(&mut &s).unwrap())
}

/// A hello recorded for another nonce (a replay from an earlier rendezvous) is refused, and
/// so is a hello not signed by the identity rank 1 published (another process claiming rank
/// 1); rank 1's own hello is then accepted. Nothing in a hello depends on the token.
#[test]
fn a_hello_without_a_valid_signature_is_refused_by_a_peer() {
    let (infos, one, t) = rank0_accepting(Duration::from_secs(5));
    let (addr, nonce) = (infos[0].addr, infos[0].nonce);
    let stale = crate::auth::nonce();
    let impostor = crate::auth::Identity::generate();
    for hello in [
        mesh::Hello::new(&one, 1, 2, String::new(), &stale),
        mesh::Hello::new(&impostor, 1, 2, String::new(), &nonce),
    ] {
        let reply = exchange(addr, &hello).unwrap();
        assert_eq!(reply.code, 1, "refused with BAD_SIGNATURE");
        assert!(reply.signature.is_empty(), "and no signature");
    }
    let reply = exchange(addr, &mesh::Hello::new(&one, 1, 2, String::new(), &nonce)).unwrap();
    assert_eq!(reply.code, 0, "rank 1's own hello is accepted");
    assert_eq!(t.join().unwrap().unwrap(), 1);
}

/// Silent connections (a port scanner, a squatter holding sockets open) hold nobody up: the
/// hellos are read concurrently, and rank 1's is answered at once.
#[test]
fn silent_connections_do_not_hold_the_rendezvous() {
    let (infos, one, t) = rank0_accepting(Duration::from_secs(20));
    let addr = infos[0].addr;
    let silent: Vec<_> = (0..40)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let asked = Instant::now();
    let reply = exchange(
        addr,
        &mesh::Hello::new(&one, 1, 2, String::new(), &infos[0].nonce),
    )
    .unwrap();
    assert_eq!(reply.code, 0);
    assert!(
        asked.elapsed() < Duration::from_secs(2),
        "answered after {:?}",
        asked.elapsed()
    );
    assert_eq!(t.join().unwrap().unwrap(), 1);
    drop(silent);
}

#[test]
fn single_rank_is_a_no_op() {
    let mut pg = ProcessGroup::single();
    let mut v = vec![3.0f32, 4.0];
    pg.all_reduce(&mut v, ReduceOp::Mean).unwrap();
    assert_eq!(v, [3.0, 4.0]);
    let mut out = vec![0.0f32; 2];
    pg.all_gather(&v, &mut out).unwrap();
    assert_eq!(out, v);
    assert_eq!(pg.all_gather_varlen(&v).unwrap(), vec![v.clone()]);
    assert!(matches!(
        pg.broadcast(&mut v, 1),
        Err(CommError::InvalidArgument(_))
    ));
    assert!(matches!(pg.barrier(), Err(CommError::Poisoned(_))));
}

/// Tests of `all_reduce_compressed`.
mod compressed;

/// Tests of `reduce_scatter`, `reduce_scatter_compressed` and `all_gather_into`.
mod scatter;

/// Tests of the node-aware all-reduce on emulated hosts.
mod nodes;

/// Tests of `shift_bytes`.
mod shift;

/// A process group of one records nothing while `DDP_TRACE` is unset, and leaves no file.
#[test]
fn a_group_of_one_traces_nothing_without_ddp_trace() {
    if std::env::var_os(crate::trace::TRACE_VAR).is_some() {
        eprintln!("DDP_TRACE is set for this test run: the off path is not tested");
        return;
    }
    let mut pg = crate::ProcessGroup::single();
    pg.all_reduce(&mut [1.0f32], crate::ReduceOp::Sum).unwrap();
    drop(pg);
    assert!(!crate::trace::enabled());
    assert_eq!(crate::trace::flush().unwrap(), None);
}

/// Three free adjacent ports of this host.
fn free_ports_from() -> u16 {
    (30000..60000u16)
        .find(|&p| (p..p + 3).all(|q| TcpListener::bind(("127.0.0.1", q)).is_ok()))
        .expect("three free adjacent ports")
}

/// `DDP_PORT_RANGE` (here the option it sets): the ranks' listeners take ports of the range
/// only (seen on the links the higher ranks opened to them), and a range too small for this
/// host's ranks is an error naming the variable.
#[test]
fn listeners_stay_in_the_port_range_and_a_full_range_is_named() {
    let lo = free_ports_from();
    let range = crate::port_range::PortRange { lo, hi: lo + 2 };
    let o = GroupOptions {
        listen_ports: Some(range),
        ..opts(false)
    };
    // Three emulated hosts: their links are TCP (on one host, Unix sockets).
    let hosts = ["a", "b", "c"].map(String::from);
    let ports = run_ranks_on(&hosts, o, move |pg| {
        let r = pg.rank();
        let links = &pg.mesh.as_ref().expect("a group of three").links;
        // The links this rank accepted, from the ranks above it, end at its listener's port.
        let accepted: Vec<u16> = links[r + 1..]
            .iter()
            .flatten()
            .map(|l| match &l.stream {
                PeerStream::Tcp(s) => s.local_addr().unwrap().port(),
                PeerStream::Local(_) => panic!("a Unix socket between emulated hosts"),
            })
            .collect();
        pg.barrier().unwrap();
        accepted
    });
    let seen: Vec<u16> = ports.iter().flatten().copied().collect();
    assert_eq!(seen.len(), 3, "{ports:?}");
    assert!(
        seen.iter().all(|p| (lo..=lo + 2).contains(p)),
        "{ports:?} not in {lo}-{}",
        lo + 2
    );
    // One port for two ranks of one host: the second rank to bind cannot.
    let o = GroupOptions {
        listen_ports: Some(crate::port_range::PortRange { lo, hi: lo }),
        connect_timeout: Duration::from_secs(2),
        ..opts(false)
    };
    let port = free_port();
    let errors: Vec<String> = (0..2)
        .map(|r| {
            let o = o.clone();
            std::thread::spawn(move || {
                ProcessGroup::init(&env(r, 2, port, "range-token"), o)
                    .err()
                    .map(|e| e.to_string())
                    .unwrap_or_default()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("DDP_PORT_RANGE") && e.contains("no port")),
        "{errors:?}"
    );
}

/// A lost rank is replaced without restarting the others: rank 2's process goes away (its
/// links close), the survivors' next collective fails, they re-form the group, a
/// replacement rejoins as rank 2, and the three all-reduce again, in a new generation.
#[test]
fn survivors_re_form_the_group_with_a_replacement() {
    for shm in [true, false] {
        let port = free_port();
        let token = format!("reform-token-{shm}");
        let o = opts(shm);
        let survivors: Vec<_> = (0..2)
            .map(|r| {
                let (o, token) = (o.clone(), token.clone());
                std::thread::spawn(move || {
                    let mut pg = ProcessGroup::init(&env(r, 3, port, &token), o).unwrap();
                    pg.barrier().unwrap();
                    let mut x = [1.0f32; 1000];
                    let lost = pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
                    pg.reform().unwrap();
                    let mut y = [(r + 1) as f32; 1000];
                    pg.all_reduce(&mut y, ReduceOp::Sum).unwrap();
                    (lost.to_string(), y[999], pg.generation())
                })
            })
            .collect();
        let (o2, token2) = (o.clone(), token.clone());
        let replaced = std::thread::spawn(move || {
            let pg = ProcessGroup::init(&env(2, 3, port, &token2), o2.clone()).unwrap();
            let mut pg = pg;
            pg.barrier().unwrap();
            drop(pg); // lost: its links close under the others
            let mut pg = ProcessGroup::rejoin(&env(2, 3, port, &token2), o2).unwrap();
            let mut y = [3.0f32; 1000];
            pg.all_reduce(&mut y, ReduceOp::Sum).unwrap();
            (y[999], pg.generation())
        });
        let mut errors = Vec::new();
        for (r, h) in survivors.into_iter().enumerate() {
            let (lost, sum, generation) = h.join().unwrap();
            assert_eq!((sum, generation), (6.0, 1), "rank {r}");
            errors.push(lost);
        }
        // The first to notice names rank 2; the other may name the survivor that broke off.
        assert!(errors.iter().any(|e| e.contains("rank 2")), "{errors:?}");
        assert_eq!(replaced.join().unwrap(), (6.0, 1));
    }
}

/// Without a replacement the survivors' re-forming ends at its deadline naming the rank that
/// never joined, and leaves the group poisoned; rank 0 cannot rejoin (it served the store).
#[test]
fn re_forming_without_a_replacement_times_out_naming_the_lost_rank() {
    let port = free_port();
    let o = GroupOptions {
        connect_timeout: Duration::from_secs(2),
        ..opts(true)
    };
    let handles: Vec<_> = (0..3)
        .map(|r| {
            let o = o.clone();
            std::thread::spawn(move || {
                let mut pg = ProcessGroup::init(&env(r, 3, port, "lonely"), o).unwrap();
                pg.barrier().unwrap();
                if r == 2 {
                    return None;
                }
                let mut x = [1.0f32; 10];
                pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
                let e = pg.reform().unwrap_err();
                let again = pg.barrier().unwrap_err();
                Some((e.to_string(), again.to_string()))
            })
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate().take(2) {
        let (e, again) = h.join().unwrap().unwrap();
        assert!(e.contains("rank(s) 2"), "rank {r}: {e}");
        assert!(
            again.contains("re-forming the group failed"),
            "rank {r}: {again}"
        );
    }
    let e = ProcessGroup::rejoin(&env(0, 3, port, "lonely"), o).unwrap_err();
    assert!(e.to_string().contains("rank 0 serves"), "{e}");
}

/// A re-forming that failed (no replacement within the deadline) can be tried again: the
/// second try fails the same way (never `Ok` without links, and the group's calls fail
/// instead of panicking), and once a replacement comes, the third try re-forms the group in a
/// generation after the failed ones and the ranks all-reduce again.
#[test]
fn a_failed_re_forming_can_be_tried_again() {
    let port = free_port();
    let o = GroupOptions {
        connect_timeout: Duration::from_secs(2),
        ..opts(true)
    };
    let token = "try-again";
    let gone = std::sync::Arc::new(std::sync::Barrier::new(3));
    let handles: Vec<_> = (0..2)
        .map(|r| {
            let (o, gone) = (o.clone(), gone.clone());
            std::thread::spawn(move || {
                let mut pg = ProcessGroup::init(&env(r, 3, port, token), o).unwrap();
                pg.barrier().unwrap();
                gone.wait();
                let mut x = [1.0f32; 10];
                pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
                let first = pg.reform().unwrap_err().to_string();
                let second = pg.reform().unwrap_err().to_string();
                let meanwhile = pg.barrier().unwrap_err().to_string();
                // The replacement starts once both tries failed.
                gone.wait();
                pg.reform().unwrap();
                let mut y = [(r + 1) as f32; 10];
                pg.all_reduce(&mut y, ReduceOp::Sum).unwrap();
                (first, second, meanwhile, y[9], pg.generation())
            })
        })
        .collect();
    let o2 = o.clone();
    let lost = std::thread::spawn(move || {
        let mut pg = ProcessGroup::init(&env(2, 3, port, token), o2.clone()).unwrap();
        pg.barrier().unwrap();
        drop(pg);
        gone.wait();
        gone.wait();
        let mut pg = ProcessGroup::rejoin(&env(2, 3, port, token), o2).unwrap();
        let mut y = [3.0f32; 10];
        pg.all_reduce(&mut y, ReduceOp::Sum).unwrap();
        (y[9], pg.generation())
    });
    let mut generations = Vec::new();
    for (r, h) in handles.into_iter().enumerate() {
        let (first, second, meanwhile, sum, generation) = h.join().unwrap();
        for e in [&first, &second] {
            assert!(e.contains("rank(s) 2"), "rank {r}: {e}");
        }
        assert!(
            meanwhile.contains("re-forming the group failed"),
            "rank {r}: {meanwhile}"
        );
        assert_eq!(sum, 6.0, "rank {r}");
        generations.push(generation);
    }
    let (sum, generation) = lost.join().unwrap();
    assert_eq!(sum, 6.0);
    generations.push(generation);
    assert!(
        generations.iter().all(|&g| g == generations[0] && g >= 3),
        "{generations:?}"
    );
}
