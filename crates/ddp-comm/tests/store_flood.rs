//! The rendezvous store under abuse: a flood of 500 connections that never present the job
//! token. Alone in its test binary, so the process's thread count is the store's.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use ddp_comm::{StoreClient, StoreServer};

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
    let during = threads();
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
