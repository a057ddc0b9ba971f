//! The rendezvous store under abuse: floods of connections that never present the job token.
//! In a test binary of their own and run one at a time, so the process's thread count is the
//! store's.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use ddp_store::{StoreClient, StoreServer};

/// The tests count this process's threads: one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Threads of this process (`Threads:` in /proc/self/status).
fn threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap()
}

#[test]
fn a_flood_without_the_token_is_bounded_and_clients_go_on_being_served() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let server = StoreServer::bind("127.0.0.1:0", Some("secret".into())).unwrap();
    let addr = server.local_addr();
    let endpoint = addr.to_string();
    let mut client =
        StoreClient::connect(&endpoint, Some("secret"), Duration::from_secs(10)).unwrap();
    client.set("before", b"1").unwrap();
    let before = threads();

    // 500 connections that send nothing and stay open.
    let flood: Vec<TcpStream> = (0..500)
        .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    while server.refused_connections() + 64 < flood.len() as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    // Threads of handshakes that newcomers closed exit on their own; on a loaded machine some
    // are still exiting just after the burst (79 once on 2 busy cores). What must hold is
    // that, with all 500 connections still open, the count settles near the 16 handshakes
    // one address may hold, not near 500: the fewest seen within 5 s.
    let settle_until = Instant::now() + Duration::from_secs(5);
    let mut during = threads();
    while during > before + 64 && Instant::now() < settle_until {
        std::thread::sleep(Duration::from_millis(50));
        during = during.min(threads());
    }
    // A client connected before the flood is served during it, without delay.
    let t = Instant::now();
    client.set("during", b"2").unwrap();
    assert_eq!(client.get("before", Duration::MAX).unwrap(), b"1");
    let served_in = t.elapsed();
    eprintln!(
        "store flood: {} connections opened, {} refused at accept; threads {before} before, \
         {during} during; an accepted client served in {served_in:?}",
        flood.len(),
        server.refused_connections()
    );
    assert!(
        during <= before + 64,
        "{during} threads during the flood, {before} before"
    );
    assert!(server.refused_connections() >= flood.len() as u64 - 64);
    assert!(served_in < Duration::from_secs(1), "{served_in:?}");

    // Once the flood is gone, new clients get in again.
    drop(flood);
    let mut late =
        StoreClient::connect(&endpoint, Some("secret"), Duration::from_secs(30)).unwrap();
    assert_eq!(late.get("during", Duration::from_secs(1)).unwrap(), b"2");
}

/// Resident memory of this process, in MiB (`VmRSS:` in /proc/self/status).
fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap()
        / 1024.0
}

/// A sustained flood from one address without the token — silent connections, half frames
/// and garbage, several hundred a second, each kept open a while — holds a share of the
/// handshake slots only: a valid client from another address connects in well under a second
/// every time, and threads and memory stay bounded.
#[test]
fn a_sustained_flood_from_one_address_delays_a_valid_client_by_under_a_second() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let server = StoreServer::bind("127.0.0.1:0", Some("secret".into())).unwrap();
    let addr = server.local_addr();
    let endpoint = addr.to_string();
    let (threads_before, rss_before) = (threads(), rss_mib());
    let flood = ddp_testkit::Flood::start("127.0.0.2".parse().unwrap(), addr);
    std::thread::sleep(Duration::from_millis(500));
    let flood_started = Instant::now();
    let (mut slowest, mut threads_most, mut rss_most) = (Duration::ZERO, 0, 0.0f64);
    for i in 0..20 {
        let t = Instant::now();
        let mut c = StoreClient::connect(&endpoint, Some("secret"), Duration::from_secs(10))
            .expect("a valid client connects during the flood");
        c.set(&format!("k{i}"), b"v").unwrap();
        slowest = slowest.max(t.elapsed());
        threads_most = threads_most.max(threads());
        rss_most = rss_most.max(rss_mib());
        std::thread::sleep(Duration::from_millis(200));
    }
    let (opened, rate) = (flood.opened(), flood.rate());
    let flood_for = flood_started.elapsed() + Duration::from_millis(500);
    drop(flood);
    eprintln!(
        "flood from one address: {} connections in {:.1} s ({rate:.0}/s), {} refused; a valid \
         client's connect at most {slowest:?}; threads {threads_before} -> at most \
         {threads_most}; RSS {rss_before:.0} -> at most {rss_most:.0} MiB",
        opened,
        flood_for.as_secs_f64(),
        server.refused_connections()
    );
    assert!(
        rate > 100.0,
        "the flood was too slow to mean anything: {rate:.0}/s"
    );
    assert!(slowest < Duration::from_secs(1), "{slowest:?}");
    // 16 handshakes of the flooding address, the flood's own thread, one client's.
    assert!(
        threads_most <= threads_before + 24,
        "{threads_most} threads, {threads_before} before"
    );
}

/// Silent connections from many addresses fill the 128 handshake slots: a newcomer from yet
/// another address closes the oldest of them (counted), so a valid client gets in at once.
#[test]
fn past_128_handshakes_from_many_addresses_the_oldest_makes_room() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let server = StoreServer::bind("127.0.0.1:0", Some("secret".into())).unwrap();
    let addr = server.local_addr();
    let silent: Vec<TcpStream> = (10..18u8)
        .flat_map(|host| (0..16).map(move |_| host))
        .map(|host| ddp_testkit::connect_from([127, 0, 0, host].into(), addr).unwrap())
        .collect();
    assert_eq!(silent.len(), 128);
    // Let the accept loop take them all in before the valid client comes.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(server.refused_connections(), 0, "16 per address fit");
    let t = Instant::now();
    let mut c = StoreClient::connect(&addr.to_string(), Some("secret"), Duration::from_secs(10))
        .expect("a valid client gets in");
    c.set("k", b"v").unwrap();
    let took = t.elapsed();
    eprintln!("128 silent handshakes from 8 addresses: a valid client connected in {took:?}");
    assert!(server.refused_connections() >= 1, "the oldest was closed");
    assert!(took < Duration::from_secs(1), "{took:?}");
    drop(silent);
}
