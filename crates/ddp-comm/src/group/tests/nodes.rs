//! The node-aware all-reduce on emulated hosts (threads with host identities of their own):
//! bitwise the flat all-reduce at every layout, even and uneven, for every reduce op; the
//! bytes each node sends across hosts next to the bound; ranks that disagree fail.

use super::compressed::sample;
use super::*;

/// Host identities for `layout[j]` ranks on node `j`.
fn hosts(layout: &[usize]) -> Vec<String> {
    layout
        .iter()
        .enumerate()
        .flat_map(|(j, &l)| std::iter::repeat_n(format!("emulated-node-{j}"), l))
        .collect()
}

/// What one rank saw: node-aware on, then the results of the node-aware and the flat path.
struct Seen {
    node_aware: bool,
    sum: (Vec<f32>, Vec<f32>),
    mean: (Vec<f64>, Vec<f64>),
    max: (Vec<i64>, Vec<i64>),
}

/// `f(pg, node_aware)` once on the node-aware path, once on the flat one.
fn both<T: Element>(pg: &mut ProcessGroup, input: &[T], op: ReduceOp) -> (Vec<T>, Vec<T>) {
    let mut out = [input.to_vec(), input.to_vec()];
    for (on, buf) in [true, false].into_iter().zip(&mut out) {
        pg.set_node_aware(on);
        pg.all_reduce(buf, op).unwrap();
    }
    pg.set_node_aware(true);
    let [a, b] = out;
    (a, b)
}

fn check_layout(layout: &[usize], len: usize, shm: bool) {
    let world: usize = layout.iter().sum();
    let seen = run_ranks_on(&hosts(layout), opts(shm), move |pg| {
        let r = pg.rank();
        let f32s: Vec<f32> = (0..len).map(|i| sample(r, i, false)).collect();
        let f64s: Vec<f64> = (0..len).map(|i| sample(r, i, false) as f64 / 3.0).collect();
        let i64s: Vec<i64> = (0..len)
            .map(|i| (sample(r, i, true) * 64.0) as i64)
            .collect();
        Seen {
            node_aware: pg.node_aware(),
            sum: both(pg, &f32s, ReduceOp::Sum),
            mean: both(pg, &f64s, ReduceOp::Mean),
            max: both(pg, &i64s, ReduceOp::Max),
        }
    });
    let expect_on = layout.len() >= 2 && layout.iter().any(|&l| l >= 2);
    for (r, s) in seen.iter().enumerate() {
        assert_eq!(s.node_aware, expect_on, "{layout:?} rank {r}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&s.sum.0) == bits(&s.sum.1),
            "{layout:?} len {len}: rank {r}'s node-aware sum differs from the flat one"
        );
        let bits64 = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(
            bits64(&s.mean.0) == bits64(&s.mean.1),
            "{layout:?} rank {r} mean"
        );
        assert_eq!(s.max.0, s.max.1, "{layout:?} rank {r} max");
        assert!(
            bits(&s.sum.0) == bits(&seen[0].sum.0),
            "rank {r} differs from rank 0"
        );
    }
    // Spot checks against the rank-order sum computed here.
    for i in [0, len / 3, len - 1] {
        let want = (1..world).fold(sample(0, i, false), |acc, p| acc + sample(p, i, false));
        assert_eq!(
            seen[0].sum.0[i].to_bits(),
            want.to_bits(),
            "{layout:?} element {i}"
        );
    }
}

/// Above the one-message path, in one round.
const LEN: usize = 40_003;

#[test]
fn node_aware_equals_flat_on_even_layouts() {
    for layout in [&[2, 2][..], &[2, 2, 2], &[4, 4]] {
        check_layout(layout, LEN, true);
    }
    check_layout(&[4, 4], 257, true);
    // One rank per host: the flat path either way.
    check_layout(&[1, 1, 1], LEN, true);
}

#[test]
fn node_aware_equals_flat_on_uneven_layouts() {
    for layout in [&[3, 1][..], &[1, 3], &[2, 1, 3]] {
        check_layout(layout, LEN, true);
    }
    // Several rounds: one channel of 4.4 MB, two 4 MiB pieces.
    check_layout(&[3, 1], 1_100_000, true);
    // Inside a host over TCP too (no shared memory).
    check_layout(&[3, 1], LEN, false);
}

/// Bytes each node sends to other nodes in one all-reduce of `len` f32 values, node-aware and
/// flat.
fn bytes_across(layout: &[usize], len: usize) -> (Vec<u64>, Vec<u64>) {
    bytes_across_in(layout, len, |pg, buf| {
        pg.all_reduce(buf, ReduceOp::Sum).unwrap()
    })
}

/// Bytes each node sends to other nodes in one `call` on a buffer of `len` ones, node-aware
/// and flat.
fn bytes_across_in(
    layout: &[usize],
    len: usize,
    call: impl Fn(&mut ProcessGroup, &mut [f32]) + Send + Sync + 'static,
) -> (Vec<u64>, Vec<u64>) {
    let per_rank = run_ranks_on(&hosts(layout), opts(true), move |pg| {
        let mut sent = [0u64; 2];
        for (on, s) in [true, false].into_iter().zip(&mut sent) {
            let mut buf = vec![1.0f32; len];
            pg.set_node_aware(on);
            let before = pg.bytes_sent_across_hosts();
            call(pg, &mut buf);
            *s = pg.bytes_sent_across_hosts() - before;
        }
        sent
    });
    let mut per_node = (vec![0; layout.len()], vec![0; layout.len()]);
    let mut rank = 0;
    for (j, &l) in layout.iter().enumerate() {
        for s in &per_rank[rank..rank + l] {
            per_node.0[j] += s[0];
            per_node.1[j] += s[1];
        }
        rank += l;
    }
    per_node
}

#[test]
fn each_node_sends_at_most_the_chains_bound_across() {
    let len = 1 << 18;
    let s = (4 * len) as f64;
    for layout in [&[2, 2][..], &[4, 4], &[2, 2, 2], &[3, 1]] {
        let k = layout.len() as f64;
        let (aware, flat) = bytes_across(layout, len);
        // The last node sends the result once; the others their partial sums and their share
        // of forwarding the result: S·(2k−3)/(k−1). Headers add a few hundred bytes.
        let busiest = s * (2.0 * k - 3.0) / (k - 1.0);
        for (j, &b) in aware.iter().enumerate() {
            assert!(
                b as f64 <= busiest * 1.001 + 4096.0,
                "{layout:?} node {j} sent {b} bytes across, over {busiest}"
            );
        }
        let total: u64 = aware.iter().sum();
        let bound_total = 2.0 * s * (k - 1.0);
        assert!(
            (total as f64 - bound_total).abs() <= bound_total * 0.001 + 4096.0 * k,
            "{layout:?}: {total} bytes across in all, the bound is {bound_total}"
        );
        // With several ranks on a node, the flat all-reduce sends more (why this path exists).
        if layout.iter().any(|&l| l >= 2) {
            let flat_max = *flat.iter().max().unwrap();
            let aware_max = *aware.iter().max().unwrap();
            assert!(
                flat_max as f64 > 1.3 * aware_max as f64,
                "{layout:?}: flat {flat:?}, node-aware {aware:?}"
            );
        }
    }
}

/// Every rank fails. A rank that has not read the odd header yet may first see a peer that
/// already failed close its links (the cascade that ends a broken group fast): that, or the
/// mismatch itself, and at least one rank names the disagreement.
fn fail_together<T: std::fmt::Debug>(res: Vec<Result<T>>) {
    let errors: Vec<CommError> = res
        .into_iter()
        .enumerate()
        .map(|(r, e)| e.expect_err(&format!("rank {r} must fail")))
        .collect();
    for (r, e) in errors.iter().enumerate() {
        assert!(
            matches!(e, CommError::Mismatch(_) | CommError::PeerClosed { .. }),
            "rank {r}: {e}"
        );
    }
    assert!(
        errors
            .iter()
            .any(|e| matches!(e, CommError::Mismatch(m) if m.contains("node-aware"))),
        "{errors:?}"
    );
}

#[test]
fn ranks_that_disagree_on_the_algorithm_fail_together() {
    let res = run_ranks_on(&hosts(&[2, 2]), opts(true), |pg| {
        pg.set_node_aware(pg.rank() != 3);
        let mut buf = vec![1.0f32; 100_000];
        pg.all_reduce(&mut buf, ReduceOp::Sum)
    });
    fail_together(res);
}

/// The compressed all-reduce, node-aware (taken from three ranks per node on) and flat:
/// bitwise the same result at even and uneven layouts, bf16 and fp16, sum and mean, and the
/// same on every rank.
#[test]
fn the_compressed_node_aware_path_equals_the_flat_one() {
    for layout in [&[4, 4][..], &[5, 3], &[2, 2]] {
        let chain = layout != [2, 2];
        let seen = run_ranks_on(&hosts(layout), opts(true), move |pg| {
            let r = pg.rank();
            let input: Vec<f32> = (0..LEN).map(|i| sample(r, i, false)).collect();
            let mut out = Vec::new();
            for c in [Compression::Bf16, Compression::Fp16] {
                for op in [ReduceOp::Sum, ReduceOp::Mean] {
                    let mut pair = [input.clone(), input.clone()];
                    for (on, buf) in [true, false].into_iter().zip(&mut pair) {
                        pg.set_node_aware(on);
                        pg.all_reduce_compressed(buf, op, c).unwrap();
                    }
                    pg.set_node_aware(true);
                    out.push(pair);
                }
            }
            out
        });
        same_on_both_paths_and_ranks(&format!("{layout:?} (chain {chain})"), &seen);
    }
}

/// Every rank's runs (`seen[rank][run]`, the node-aware result and the flat one): the two
/// bitwise equal, and equal to rank 0's.
fn same_on_both_paths_and_ranks(what: &str, seen: &[Vec<[Vec<f32>; 2]>]) {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (r, runs) in seen.iter().enumerate() {
        for (i, [aware, flat]) in runs.iter().enumerate() {
            assert!(
                bits(aware) == bits(flat),
                "{what} run {i}: rank {r}'s node-aware result differs from the flat one"
            );
            assert!(
                bits(aware) == bits(&seen[0][i][0]),
                "{what}: rank {r} run {i}"
            );
        }
    }
}

/// Bytes each node sends across in one compressed all-reduce on 2 × 4 ranks: the node-aware
/// path's partial sums cross in f32 (twice the 16-bit buffer) and its result in 16 bits, so
/// the busiest node sends about twice the 16-bit buffer, where the flat one sends about
/// `4·4/8 + 7/8 = 2.875` times it.
#[test]
fn the_compressed_node_aware_path_sends_fewer_bytes_across_at_two_by_four() {
    let len = 1 << 18;
    let s16 = (2 * len) as f64;
    let (aware, flat) = bytes_across_in(&[4, 4], len, |pg, buf| {
        pg.all_reduce_compressed(buf, ReduceOp::Sum, Compression::Bf16)
            .unwrap()
    });
    let aware = *aware.iter().max().unwrap() as f64;
    let flat = *flat.iter().max().unwrap() as f64;
    assert!(
        aware <= 2.0 * s16 * 1.001 + 8192.0,
        "node-aware busiest {aware}, S16 {s16}"
    );
    assert!(flat > 1.3 * aware, "flat {flat}, node-aware {aware}");
}

/// The reduce-scatter, node-aware (where the chain sends fewer bytes: 3 + 3, 3 + 2, 2 + 2 + 2,
/// 4 + 4) and flat: every rank's shard bitwise the same, for even and uneven shards (one of
/// them empty), sum, mean and max; at 3 + 1 the flat path runs either way.
#[test]
fn the_node_aware_reduce_scatter_equals_the_flat_one() {
    for layout in [&[3, 3][..], &[3, 2], &[2, 2, 2], &[4, 4], &[3, 1]] {
        let world: usize = layout.iter().sum();
        let seen = run_ranks_on(&hosts(layout), opts(true), move |pg| {
            let r = pg.rank();
            let input: Vec<f32> = (0..LEN).map(|i| sample(r, i, false)).collect();
            let mut counts = vec![LEN / world; world];
            counts[0] += LEN % world;
            let mut skewed: Vec<usize> =
                (0..world).map(|p| if p == 1 { 0 } else { p + 1 }).collect();
            let total: usize = skewed.iter().sum();
            let mut given = 0;
            for c in &mut skewed {
                *c = LEN * *c / total;
                given += *c;
            }
            skewed[0] += LEN - given;
            let mut out = Vec::new();
            for counts in [counts, skewed] {
                let at: usize = counts[..r].iter().sum();
                let mine = at..at + counts[r];
                for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
                    let mut pair = [input.clone(), input.clone()];
                    for (on, buf) in [true, false].into_iter().zip(&mut pair) {
                        pg.set_node_aware(on);
                        pg.reduce_scatter(buf, &counts, op).unwrap();
                    }
                    pg.set_node_aware(true);
                    let [aware, flat] = pair;
                    out.push((aware[mine.clone()].to_vec(), flat[mine.clone()].to_vec()));
                }
            }
            out
        });
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (r, runs) in seen.iter().enumerate() {
            for (i, (aware, flat)) in runs.iter().enumerate() {
                assert!(
                    bits(aware) == bits(flat),
                    "{layout:?} run {i}: rank {r}'s node-aware shard differs from the flat one"
                );
            }
        }
    }
}

/// Bytes each node sends across in one reduce-scatter of even shards on 2 × 4 ranks: the
/// chain's busiest node one buffer `S` (partial sums, or the last node's shards for the other
/// node: S/2), the flat one `4·4/8 = 2` S.
#[test]
fn the_node_aware_reduce_scatter_sends_fewer_bytes_across() {
    let len = 1 << 18;
    let s = (4 * len) as f64;
    let (aware, flat) = bytes_across_in(&[4, 4], len, move |pg, buf| {
        pg.reduce_scatter(buf, &[len / 8; 8], ReduceOp::Sum)
            .unwrap()
    });
    let aware = *aware.iter().max().unwrap() as f64;
    let flat = *flat.iter().max().unwrap() as f64;
    assert!(
        aware <= s * 1.001 + 8192.0,
        "node-aware busiest {aware}, S {s}"
    );
    assert!(flat >= 1.9 * s, "flat busiest {flat}, S {s}");
}

/// A rank that takes the flat reduce-scatter against node-aware peers: every rank fails, and
/// one names the disagreement.
#[test]
fn ranks_that_disagree_on_the_reduce_scatter_fail_together() {
    let res = run_ranks_on(&hosts(&[3, 3]), opts(true), |pg| {
        pg.set_node_aware(pg.rank() != 4);
        let mut buf = vec![1.0f32; 100_000];
        pg.reduce_scatter(
            &mut buf,
            &[20_000, 20_000, 20_000, 20_000, 10_000, 10_000],
            ReduceOp::Sum,
        )
    });
    fail_together(res);
}

/// The all-gather of shards, node-aware and flat: every rank ends with the same bytes at
/// even and uneven layouts, for even shards and skewed ones (one empty, one small enough to
/// travel in the header), over shared memory and TCP.
#[test]
fn the_node_aware_all_gather_equals_the_flat_one() {
    for (layout, shm) in [
        (&[2, 2][..], true),
        (&[4, 4], true),
        (&[3, 1], true),
        (&[2, 1, 3], true),
        (&[2, 2, 2], true),
        (&[3, 1], false),
    ] {
        let world: usize = layout.iter().sum();
        let seen = run_ranks_on(&hosts(layout), opts(shm), move |pg| {
            let r = pg.rank();
            // Shards above the header's inline size, but for two in the skewed split.
            let even = vec![200_003 / world; world];
            let skewed: Vec<usize> = (0..world)
                .map(|p| match p {
                    1 => 0,
                    2 => 5,
                    _ => 20_000 + 3_000 * p,
                })
                .collect();
            let mut out = Vec::new();
            for counts in [even, skewed] {
                let len: usize = counts.iter().sum();
                let at: usize = counts[..r].iter().sum();
                let mut pair = [vec![f32::NAN; len], vec![f32::NAN; len]];
                for (on, buf) in [true, false].into_iter().zip(&mut pair) {
                    for (i, v) in buf[at..at + counts[r]].iter_mut().enumerate() {
                        *v = sample(r, i, false);
                    }
                    pg.set_node_aware(on);
                    pg.all_gather_into(buf, &counts).unwrap();
                }
                pg.set_node_aware(true);
                out.push(pair);
            }
            out
        });
        for (r, runs) in seen.iter().enumerate() {
            for (i, [aware, _]) in runs.iter().enumerate() {
                assert!(
                    aware.iter().all(|v| !v.is_nan()),
                    "{layout:?} run {i}: rank {r} misses values"
                );
            }
        }
        same_on_both_paths_and_ranks(&format!("{layout:?}"), &seen);
    }
}

/// Bytes each node sends across in one all-gather of even shards on 2 × 4 ranks: node-aware,
/// its block once to the other node (S/2, the bound); flat, the ring's edge (7/8 S).
#[test]
fn the_node_aware_all_gather_sends_the_bound_across() {
    let len = 1 << 18;
    let s = (4 * len) as f64;
    let (aware, flat) = bytes_across_in(&[4, 4], len, move |pg, buf| {
        pg.all_gather_into(buf, &[len / 8; 8]).unwrap()
    });
    let aware = *aware.iter().max().unwrap() as f64;
    let flat = *flat.iter().max().unwrap() as f64;
    assert!(
        aware <= s / 2.0 * 1.001 + 8192.0,
        "node-aware busiest {aware}, S {s}"
    );
    assert!(flat >= 0.85 * s, "flat busiest {flat}, S {s}");
}

/// A rank that takes the flat all-gather against node-aware peers: every rank fails, and one
/// names the disagreement.
#[test]
fn ranks_that_disagree_on_the_all_gather_fail_together() {
    let res = run_ranks_on(&hosts(&[2, 2]), opts(true), |pg| {
        pg.set_node_aware(pg.rank() != 2);
        let mut buf = vec![1.0f32; 100_000];
        pg.all_gather_into(&mut buf, &[25_000; 4])
    });
    fail_together(res);
}

/// A rank that leaves (drops its group) before a node-aware collective: every other rank's
/// call fails with a dead connection well within the collective timeout, for the all-reduce,
/// the reduce-scatter and the all-gather, whether the rank that left owns a channel or not.
#[test]
fn a_departed_rank_fails_every_node_aware_collective_at_once() {
    for call in 0..3 {
        for leaver in [1, 5] {
            let res = run_ranks_on(&hosts(&[3, 3]), opts(true), move |pg| {
                assert!(pg.node_aware());
                if pg.rank() == leaver {
                    return None;
                }
                // Give the leaver time to drop its group.
                std::thread::sleep(Duration::from_millis(100));
                let mut buf = vec![1.0f32; 300_000];
                let counts = [50_000; 6];
                let t = Instant::now();
                let result = match call {
                    0 => pg.all_reduce(&mut buf, ReduceOp::Sum),
                    1 => pg.reduce_scatter(&mut buf, &counts, ReduceOp::Sum),
                    _ => pg.all_gather_into(&mut buf, &counts),
                };
                Some((result.expect_err("a rank left"), t.elapsed()))
            });
            for (r, seen) in res.iter().enumerate().filter(|&(r, _)| r != leaver) {
                let (e, took) = seen.as_ref().expect("a rank that stayed");
                assert!(
                    matches!(e, CommError::PeerClosed { .. }),
                    "rank {r}, call {call}, rank {leaver} left: {e}"
                );
                assert!(
                    *took < Duration::from_secs(10),
                    "rank {r}, call {call}: {took:?}"
                );
            }
        }
    }
}
