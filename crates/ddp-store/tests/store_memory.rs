//! The store's quota bounds its memory: filled with small entries over real connections, the
//! server's process grows by no more than the quota charged for them (each entry is charged
//! its overhead, not only its bytes), and past the cap on keys it refuses.
//!
//! One test in its own process, so that its resident memory is the store's.

use std::time::Duration;

use ddp_store::{StoreClient, StoreServer};

/// The process's resident memory, in bytes (`VmRSS` of /proc/self/status).
fn resident() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib * 1024
}

#[test]
fn a_store_filled_with_small_entries_holds_no_more_memory_than_it_charges() {
    let server = StoreServer::bind("127.0.0.1:0", Some("memory".into())).unwrap();
    let endpoint = server.local_addr().to_string();
    let before = resident();
    // 8 connections × 12500 keys of 8 bytes with 8-byte counters.
    let writers: Vec<_> = (0..8)
        .map(|c| {
            let endpoint = endpoint.clone();
            std::thread::spawn(move || {
                let mut client =
                    StoreClient::connect(&endpoint, Some("memory"), Duration::from_secs(10))
                        .unwrap();
                for i in 0..12_500 {
                    client.add(&format!("{c}/{i:06}"), 1).unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    let grown = resident().saturating_sub(before);
    let (keys, charged) = server.usage();
    eprintln!(
        "{keys} keys: the store charged {:.1} MiB, the process grew {:.1} MiB",
        charged as f64 / (1 << 20) as f64,
        grown as f64 / (1 << 20) as f64
    );
    assert_eq!(keys, 100_000);
    assert!(grown <= charged, "grew {grown} bytes, charged {charged}");
}
