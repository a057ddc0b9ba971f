//! [`ProcessGroup::shift_bytes`] over shared memory and TCP: each rank receives exactly its
//! predecessor's message, of any length (empty, inline, several MiB, different on every rank),
//! into a buffer it hands back; a rank that calls something else fails every rank.

use super::*;

/// Rank `r`'s message in the tests: `len + r · 1001` bytes, each depending on `r` and its index.
fn message(r: usize, len: usize) -> Vec<u8> {
    (0..len + r * 1001)
        .map(|i| (i * 7 + r * 13) as u8)
        .collect()
}

#[test]
fn every_rank_receives_its_predecessors_message() {
    for shm in [true, false] {
        for world in [2usize, 3] {
            for len in [0usize, 5, 70_000, 9_000_011] {
                let res = run_ranks(world, opts(shm), move |pg| {
                    let r = pg.rank();
                    let mut out = vec![0xAAu8; 17];
                    pg.shift_bytes(&message(r, len), &mut out).unwrap();
                    let first = out.clone();
                    // A second call into the same buffer (its allocation reused).
                    let again = message(r, len).iter().map(|b| !b).collect::<Vec<u8>>();
                    pg.shift_bytes(&again, &mut out).unwrap();
                    pg.barrier().unwrap();
                    (r, first, out)
                });
                for (r, first, second) in res {
                    let prev = (r + world - 1) % world;
                    assert_eq!(
                        first,
                        message(prev, len),
                        "rank {r}, {world} ranks, {len} B"
                    );
                    let inverted: Vec<u8> = message(prev, len).iter().map(|b| !b).collect();
                    assert_eq!(second, inverted, "rank {r}, second call");
                }
            }
        }
    }
}

#[test]
fn a_rank_calling_something_else_fails_every_rank() {
    let res = run_ranks(2, opts(true), |pg| {
        let e = if pg.rank() == 0 {
            pg.shift_bytes(&[1, 2, 3], &mut Vec::new()).unwrap_err()
        } else {
            pg.all_gather_varlen(&[1u8, 2, 3]).unwrap_err()
        };
        e.to_string()
    });
    for msg in res {
        assert!(
            msg.contains("shift_bytes") && msg.contains("all_gather_varlen"),
            "{msg}"
        );
    }
}

#[test]
fn a_world_of_one_keeps_its_own_message() {
    let mut pg = crate::ProcessGroup::single();
    let mut out = vec![9u8; 3];
    pg.shift_bytes(&[4, 5], &mut out).unwrap();
    assert_eq!(out, vec![4, 5]);
}
