//! [`ProcessGroup::all_reduce_compressed`] over shared memory and TCP: the error bound stated
//! in its rustdoc, bitwise identical ranks, halved bytes, mismatches and refusals.

use super::*;
use crate::group::compression::Half;

// The last spans three segments of the compressed path (`COMPRESSED_SEGMENT`), the third partial.
const LENS: [usize; 6] = [0, 1, 7, 1000, 40_000, 2_100_003];

/// A deterministic pseudo-random value: about ±4 times a power of two in 2^-4..2^3, with a
/// full f32 significand, or (`representable`) a multiple of 1/64 below 4 in magnitude, which
/// bf16 and fp16 hold exactly.
pub(super) fn sample(rank: usize, i: usize, representable: bool) -> f32 {
    let mut z = ((rank as u64) << 40 ^ i as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    if representable {
        return ((z >> 40) % 511) as f32 / 64.0 - 255.0 / 64.0;
    }
    let unit = (z >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
    unit * 8.0 * 2f32.powi((z & 7) as i32 - 4)
}

/// The bound of `all_reduce_compressed`'s rustdoc:
/// `u·|m| + (1 + u)²·(u + n·2^-23)·A + (n + 1)·σ`, without the inner `u` for representable
/// inputs.
fn bound(h: Half, n: usize, m: f64, a: f64, representable: bool) -> f64 {
    let u = h.unit_roundoff();
    let inputs = if representable { 0.0 } else { u };
    u * m.abs()
        + (1.0 + u).powi(2) * (inputs + n as f64 * 2f64.powi(-23)) * a
        + (n + 1) as f64 * h.min_subnormal()
}

fn compression_of(h: Half) -> Compression {
    match h {
        Half::Bf16 => Compression::Bf16,
        Half::Fp16 => Compression::Fp16,
    }
}

/// Every (length, format, op, data) case one group runs, in call order.
fn cases() -> Vec<(usize, Half, ReduceOp, bool)> {
    let mut v = Vec::new();
    for len in LENS {
        for h in [Half::Bf16, Half::Fp16] {
            for op in [ReduceOp::Sum, ReduceOp::Mean] {
                for representable in [false, true] {
                    v.push((len, h, op, representable));
                }
            }
        }
    }
    v
}

/// Runs every case on `world` ranks; checks the bound and that ranks agree bitwise; returns
/// rank 0's results.
fn check(world: usize, shm: bool) -> Vec<Vec<f32>> {
    let res = run_ranks(world, opts(shm), move |pg| {
        let r = pg.rank();
        let mut out = Vec::new();
        for (len, h, op, rep) in cases() {
            let mut buf: Vec<f32> = (0..len).map(|i| sample(r, i, rep)).collect();
            pg.all_reduce_compressed(&mut buf, op, compression_of(h))
                .unwrap_or_else(|e| panic!("rank {r}, {len} × {h:?} {op:?}: {e}"));
            out.push(buf);
        }
        // The group still works for the uncompressed collectives.
        let mut v = vec![1.0f32; 3];
        pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        pg.barrier().unwrap();
        assert_eq!(v, vec![world as f32; 3]);
        out
    });
    for (k, (len, h, op, rep)) in cases().into_iter().enumerate() {
        let what = format!("world {world}, shm {shm}, {len} × {h:?} {op:?}, representable {rep}");
        let first = &res[0][k];
        assert_eq!(first.len(), len, "{what}");
        for (r, other) in res.iter().enumerate().skip(1) {
            let same = first
                .iter()
                .zip(&other[k])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what}: rank {r} differs from rank 0");
        }
        let div = if op == ReduceOp::Mean {
            world as f64
        } else {
            1.0
        };
        let mut worst = 0f64;
        for (i, &got) in first.iter().enumerate() {
            let xs = (0..world).map(|p| sample(p, i, rep) as f64);
            let m = xs.clone().sum::<f64>() / div;
            let a = xs.map(f64::abs).sum::<f64>() / div;
            let err = (got as f64 - m).abs();
            let b = bound(h, world, m, a, rep);
            assert!(
                err <= b,
                "{what}: element {i}: got {got}, exact {m}, error {err:e} > bound {b:e}"
            );
            worst = worst.max(err / b);
        }
        eprintln!("{what}: worst error / bound = {worst:.3}");
        // The bound is not vacuous: some element comes within a factor 8 of it (inputs with
        // full f32 significands; representable ones may add up exactly).
        if len >= 1000 && !rep {
            assert!(worst > 0.125, "{what}: worst error / bound = {worst}");
        }
    }
    res.into_iter().next().unwrap()
}

#[test]
fn compressed_all_reduce_is_within_the_bound_and_identical_on_every_rank() {
    for world in [2, 3, 4] {
        let over_shm = check(world, true);
        let over_tcp = check(world, false);
        // Transport-independent: the same bits over shared memory and TCP.
        for (a, b) in over_shm.iter().zip(&over_tcp) {
            assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
        }
    }
}

#[test]
fn compression_halves_the_bytes_sent() {
    for shm in [true, false] {
        for world in [2, 3, 4] {
            let res = run_ranks(world, opts(shm), |pg| {
                let r = pg.rank();
                let mut ratios = Vec::new();
                for len in [1000, 1_000_003] {
                    let mut buf: Vec<f32> = (0..len).map(|i| sample(r, i, false)).collect();
                    let before = pg.bytes_sent();
                    pg.all_reduce(&mut buf, ReduceOp::Mean).unwrap();
                    let full = pg.bytes_sent() - before;
                    let before = pg.bytes_sent();
                    pg.all_reduce_compressed(&mut buf, ReduceOp::Mean, Compression::Bf16)
                        .unwrap();
                    let half = pg.bytes_sent() - before;
                    ratios.push((len, full, half));
                }
                ratios
            });
            for (r, ratios) in res.iter().enumerate() {
                for &(len, full, half) in ratios {
                    let ratio = half as f64 / full as f64;
                    eprintln!(
                        "shm {shm}, world {world}, rank {r}, {len} × f32: all_reduce sent \
                         {full} bytes, bf16 {half} ({ratio:.4})"
                    );
                    // Payloads halve exactly; headers (32 bytes per peer) and padding do not.
                    assert!(
                        (0.49..=0.51).contains(&ratio),
                        "shm {shm}, world {world}, rank {r}, len {len}: {half} / {full}"
                    );
                }
            }
        }
    }
}

#[test]
fn compressed_against_uncompressed_fails_clearly_on_every_rank() {
    for shm in [true, false] {
        for len in [100, 100_000] {
            let res = run_ranks(2, opts(shm), move |pg| {
                let mut v = vec![1.0f32; len];
                let e = if pg.rank() == 0 {
                    pg.all_reduce(&mut v, ReduceOp::Sum)
                } else {
                    pg.all_reduce_compressed(&mut v, ReduceOp::Sum, Compression::Bf16)
                }
                .unwrap_err();
                let later = pg.barrier().unwrap_err();
                (e, later)
            });
            for (e, later) in res {
                let msg = e.to_string();
                assert!(matches!(e, CommError::Mismatch(_)), "{msg}");
                assert!(
                    msg.contains("all_reduce_compressed(") && msg.contains("f32 as bf16"),
                    "{msg}"
                );
                assert!(
                    msg.contains(&format!("all_reduce({len} × f32, sum)")),
                    "{msg}"
                );
                assert!(matches!(later, CommError::Poisoned(_)), "{later}");
            }
        }
    }
    let res = run_ranks(2, opts(true), |pg| {
        let c = [Compression::Bf16, Compression::Fp16][pg.rank()];
        pg.all_reduce_compressed(&mut [1.0; 10], ReduceOp::Mean, c)
            .unwrap_err()
    });
    for e in res {
        let msg = e.to_string();
        assert!(matches!(e, CommError::Mismatch(_)), "{msg}");
        assert!(msg.contains("bf16") && msg.contains("fp16"), "{msg}");
    }
}

#[test]
fn only_sum_and_mean_are_compressed() {
    let res = run_ranks(2, opts(true), |pg| {
        pg.all_reduce_compressed(&mut [1.0; 10], ReduceOp::Max, Compression::Fp16)
            .unwrap_err()
    });
    for e in res {
        assert!(matches!(e, CommError::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains("ReduceOp::Max"), "{e}");
    }
    let mut pg = ProcessGroup::single();
    let e = pg
        .all_reduce_compressed(&mut [1.0; 3], ReduceOp::Min, Compression::Bf16)
        .unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument(_)), "{e}");
    // Uncompressed, every op is still there.
    let mut pg = ProcessGroup::single();
    pg.all_reduce_compressed(&mut [1.0; 3], ReduceOp::Max, Compression::None)
        .unwrap();
}

#[test]
fn a_group_of_one_leaves_the_buffer_untouched() {
    let mut pg = ProcessGroup::single();
    let orig: Vec<f32> = (0..1000).map(|i| sample(0, i, false)).collect();
    for c in [Compression::Bf16, Compression::Fp16, Compression::None] {
        for op in [ReduceOp::Sum, ReduceOp::Mean] {
            let mut v = orig.clone();
            pg.all_reduce_compressed(&mut v, op, c).unwrap();
            assert!(v.iter().zip(&orig).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
    assert_eq!(pg.bytes_sent(), 0);
}

#[test]
fn no_compression_is_the_plain_all_reduce() {
    for len in [7, 300_001] {
        let res = run_ranks(3, opts(true), move |pg| {
            let r = pg.rank();
            let orig: Vec<f32> = (0..len).map(|i| sample(r, i, false)).collect();
            let (mut a, mut b) = (orig.clone(), orig);
            pg.all_reduce(&mut a, ReduceOp::Mean).unwrap();
            pg.all_reduce_compressed(&mut b, ReduceOp::Mean, Compression::None)
                .unwrap();
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits())
        });
        assert!(res.into_iter().all(|same| same));
    }
}
