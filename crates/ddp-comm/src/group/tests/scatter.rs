//! [`ProcessGroup::reduce_scatter`], [`ProcessGroup::reduce_scatter_compressed`] and
//! [`ProcessGroup::all_gather_into`] over shared memory and TCP: every element summed in rank
//! order, so a shard is bitwise the all-reduce's values whatever the shard sizes; uneven and
//! empty shards; mismatched sizes and a departed peer fail on every rank.

use super::compressed::sample;
use super::*;

/// Shard sizes of `len` elements for `world` ranks: uneven, with an empty shard.
fn uneven(len: usize, world: usize) -> Vec<usize> {
    let mut counts = vec![0usize; world];
    // Rank 1 owns nothing; the others split the rest 1 : 2 : 3 …
    let weights: Vec<usize> = (0..world).map(|p| if p == 1 { 0 } else { p + 1 }).collect();
    let total: usize = weights.iter().sum();
    let mut given = 0;
    for p in 0..world {
        counts[p] = len * weights[p] / total;
        given += counts[p];
    }
    counts[0] += len - given;
    counts
}

fn start(counts: &[usize], p: usize) -> usize {
    counts[..p].iter().sum()
}

/// The lengths: inline, one round and several rounds of the direct path (a shard over 4 MiB).
const LENS: [usize; 5] = [0, 5, 3000, 100_000, 2_300_007];

#[test]
fn every_reduction_sums_in_rank_order_and_shards_are_the_all_reduce_bitwise() {
    for shm in [true, false] {
        for world in [2, 3, 4] {
            let res = run_ranks(world, opts(shm), move |pg| {
                let r = pg.rank();
                let mut out = Vec::new();
                for len in LENS {
                    let input: Vec<f32> = (0..len).map(|i| sample(r, i, false)).collect();
                    for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
                        let mut all = input.clone();
                        pg.all_reduce(&mut all, op).unwrap();
                        let mut layouts = Vec::new();
                        for counts in [uneven(len, world), {
                            let mut c = vec![len / world; world];
                            c[world - 1] += len % world;
                            c
                        }] {
                            let mut buf = input.clone();
                            pg.reduce_scatter(&mut buf, &counts, op).unwrap();
                            let at = start(&counts, r);
                            let mine = at..at + counts[r];
                            assert_eq!(
                                buf[..mine.start],
                                input[..mine.start],
                                "the rest is untouched"
                            );
                            layouts.push((mine.clone(), buf[mine].to_vec()));
                        }
                        out.push((len, op, all, layouts));
                    }
                }
                out
            });
            for rank_out in &res {
                for (len, op, all, layouts) in rank_out {
                    let want: Vec<f32> = (0..*len)
                        .map(|i| {
                            let mut acc = sample(0, i, false);
                            for p in 1..world {
                                let x = sample(p, i, false);
                                acc = match op {
                                    ReduceOp::Max => acc.max(x),
                                    _ => acc + x,
                                };
                            }
                            if *op == ReduceOp::Mean {
                                acc / world as f32
                            } else {
                                acc
                            }
                        })
                        .collect();
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(all),
                        bits(&want),
                        "all_reduce {op:?} of {len} on {world} ranks (shm={shm}) is the rank-order sum"
                    );
                    for (range, shard) in layouts {
                        assert_eq!(bits(shard), bits(&want[range.clone()]), "{op:?} {len}");
                    }
                }
            }
        }
    }
}

#[test]
fn compressed_shards_are_the_compressed_all_reduce_bitwise() {
    for shm in [true, false] {
        let world = 3;
        let res = run_ranks(world, opts(shm), move |pg| {
            let r = pg.rank();
            let mut out = Vec::new();
            for len in [7usize, 20_000, 2_100_003] {
                let input: Vec<f32> = (0..len).map(|i| sample(r, i, false)).collect();
                for c in [Compression::Bf16, Compression::Fp16] {
                    let mut all = input.clone();
                    pg.all_reduce_compressed(&mut all, ReduceOp::Mean, c)
                        .unwrap();
                    let counts = uneven(len, world);
                    let mut buf = input.clone();
                    pg.reduce_scatter_compressed(&mut buf, &counts, ReduceOp::Mean, c)
                        .unwrap();
                    let at = start(&counts, r);
                    let mine = at..at + counts[r];
                    let same = all[mine.clone()]
                        .iter()
                        .zip(&buf[mine])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    out.push((len, c, same));
                }
            }
            out
        });
        for rank_out in res {
            for (len, c, same) in rank_out {
                assert!(same, "{c} reduce-scatter of {len} (shm={shm})");
            }
        }
    }
}

#[test]
fn all_gather_into_fills_every_shard_of_any_size() {
    for shm in [true, false] {
        for world in [2, 3] {
            let res = run_ranks(world, opts(shm), move |pg| {
                let r = pg.rank();
                let mut out = Vec::new();
                for len in LENS {
                    let counts = uneven(len, world);
                    let at = start(&counts, r);
                    let mut buf = vec![-1i64; len];
                    for (i, v) in buf[at..at + counts[r]].iter_mut().enumerate() {
                        *v = (r * 1_000_000_000 + at + i) as i64;
                    }
                    pg.all_gather_into(&mut buf, &counts).unwrap();
                    out.push((counts, buf));
                }
                out
            });
            for rank_out in res {
                for (counts, buf) in rank_out {
                    for p in 0..world {
                        let at = start(&counts, p);
                        for (i, &v) in buf.iter().enumerate().skip(at).take(counts[p]) {
                            assert_eq!(v, (p * 1_000_000_000 + i) as i64);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn different_shard_sizes_fail_on_every_rank() {
    for len in [12usize, 400_000] {
        let res = run_ranks(3, opts(true), move |pg| {
            let counts = if pg.rank() == 2 {
                vec![len - 2, 1, 1]
            } else {
                vec![len - 3, 2, 1]
            };
            let e = pg
                .reduce_scatter(&mut vec![1.0f32; len], &counts, ReduceOp::Sum)
                .unwrap_err();
            let later = pg.barrier().unwrap_err();
            (e, later)
        });
        for (e, later) in res {
            let msg = e.to_string();
            assert!(matches!(e, CommError::Mismatch(_)), "{msg}");
            assert!(
                msg.contains("reduce_scatter(") && msg.contains("shard sizes #"),
                "{msg}"
            );
            assert!(matches!(later, CommError::Poisoned(_)), "{later}");
        }
    }
    let res = run_ranks(2, opts(false), |pg| {
        let counts = [[3, 5], [4, 4]][pg.rank()];
        pg.all_gather_into(&mut [0u8; 8], &counts).unwrap_err()
    });
    for e in res {
        assert!(matches!(e, CommError::Mismatch(_)), "{e}");
        assert!(e.to_string().contains("all_gather_into("), "{e}");
    }
}

#[test]
fn sizes_that_do_not_fit_are_refused() {
    let res = run_ranks(2, opts(true), |pg| {
        let e = pg
            .reduce_scatter(&mut [1.0f32; 8], &[3, 4], ReduceOp::Sum)
            .unwrap_err();
        (e, pg.barrier().unwrap_err())
    });
    for (e, later) in res {
        assert!(matches!(e, CommError::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains("add up to 7"), "{e}");
        // A refused call breaks the group, like every failed collective.
        assert!(matches!(later, CommError::Poisoned(_)), "{later}");
    }
    let mut pg = ProcessGroup::single();
    let e = pg.all_gather_into(&mut [1.0f32; 4], &[2, 2]).unwrap_err();
    assert!(
        e.to_string()
            .contains("2 shard sizes given for a world of 1"),
        "{e}"
    );
    let mut pg = ProcessGroup::single();
    let mut v = [1.5f32, 2.5];
    pg.reduce_scatter(&mut v, &[2], ReduceOp::Mean).unwrap();
    pg.reduce_scatter_compressed(&mut v, &[2], ReduceOp::Mean, Compression::Bf16)
        .unwrap();
    pg.all_gather_into(&mut v, &[2]).unwrap();
    assert_eq!(v, [1.5, 2.5], "a group of one leaves the buffer untouched");
}

#[test]
fn a_departed_peer_fails_a_reduce_scatter() {
    for shm in [true, false] {
        let res = run_ranks(3, opts(shm), |pg| {
            if pg.rank() == 2 {
                return None;
            }
            std::thread::sleep(Duration::from_millis(100));
            let mut v = vec![1.0f32; 1 << 20];
            Some(
                pg.reduce_scatter(&mut v, &[1 << 19, 1 << 19, 0], ReduceOp::Sum)
                    .unwrap_err(),
            )
        });
        for (rank, e) in res.into_iter().enumerate() {
            let Some(e) = e else { continue };
            // Over shared memory the ring a failing rank closes names the culprit; over TCP a
            // rank may only see its neighbour give up first.
            let named = match e {
                CommError::PeerClosed { peer, .. } => peer,
                _ => panic!("shm={shm}: {e}"),
            };
            assert!(
                named == 2 || (!shm && named == 1 - rank),
                "shm={shm}: rank {rank}: {e}"
            );
        }
    }
}
