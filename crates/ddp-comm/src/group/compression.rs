//! [`Compression`]: the 16-bit wire formats of [`ProcessGroup::all_reduce_compressed`], and the
//! pure conversion kernels behind it (f32 ↔ bf16 / fp16, little-endian on the wire).
//!
//! The reduction itself stays in f32: a rank adds the 16-bit values it receives into an f32
//! accumulator, and only the fully reduced value is rounded to 16 bits, once.
//!
//! [`ProcessGroup::all_reduce_compressed`]: super::ProcessGroup::all_reduce_compressed

#[cfg(test)]
use half::bf16;
use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use crate::error::CommError;

/// How [`ProcessGroup::all_reduce_compressed`] encodes f32 values on the wire.
///
/// The 16-bit formats halve the bytes sent. Values travel rounded (to nearest, ties to even)
/// to the format, but each rank accumulates in f32 and the reduced value is rounded once; see
/// [`ProcessGroup::all_reduce_compressed`] for the error bound. Names for [`FromStr`] and
/// [`Display`]: `none`, `bf16`, `fp16`.
///
/// ```
/// use ddp_comm::Compression;
/// let c: Compression = "bf16".parse().unwrap();
/// assert_eq!(c, Compression::Bf16);
/// assert_eq!(c.to_string(), "bf16");
/// assert_eq!(Compression::default(), Compression::None);
/// ```
///
/// [`ProcessGroup::all_reduce_compressed`]: super::ProcessGroup::all_reduce_compressed
/// [`FromStr`]: std::str::FromStr
/// [`Display`]: std::fmt::Display
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Compression {
    /// Full f32 values: exactly [`ProcessGroup::all_reduce`](super::ProcessGroup::all_reduce).
    #[default]
    None,
    /// bfloat16: f32's exponent range, 8 significant bits (relative rounding error ≤ 2^-8).
    Bf16,
    /// IEEE half precision: 11 significant bits (relative rounding error ≤ 2^-11), but a range
    /// of only ±65504 (larger magnitudes become ±∞) and subnormals below 2^-14.
    Fp16,
}

impl Compression {
    /// The name used by [`FromStr`](std::str::FromStr) and [`Display`](std::fmt::Display):
    /// `"none"`, `"bf16"` or `"fp16"`.
    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Bf16 => "bf16",
            Compression::Fp16 => "fp16",
        }
    }

    /// Bytes one f32 element occupies on the wire (4, or 2 for the 16-bit formats).
    pub fn bytes_per_element(self) -> usize {
        match self.half() {
            Some(_) => 2,
            None => 4,
        }
    }

    /// The 16-bit format, if any.
    pub(crate) fn half(self) -> Option<Half> {
        match self {
            Compression::None => None,
            Compression::Bf16 => Some(Half::Bf16),
            Compression::Fp16 => Some(Half::Fp16),
        }
    }
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Compression {
    type Err = CommError;

    /// Parses `none`, `bf16` or `fp16` (ASCII case and surrounding blanks ignored).
    fn from_str(s: &str) -> Result<Self, CommError> {
        let t = s.trim();
        [Compression::None, Compression::Bf16, Compression::Fp16]
            .into_iter()
            .find(|c| c.name().eq_ignore_ascii_case(t))
            .ok_or_else(|| {
                CommError::InvalidArgument(format!(
                    "unknown compression {s:?} (expected none, bf16 or fp16)"
                ))
            })
    }
}

/// A 16-bit wire format: the kernels below are monomorphic per format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Half {
    Bf16,
    Fp16,
}

impl Half {
    /// Name of the wire element type (headers, messages).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Half::Bf16 => "bf16",
            Half::Fp16 => "fp16",
        }
    }

    /// Unit roundoff: the largest relative error of rounding a normal value (2^-8, 2^-11).
    #[cfg(test)]
    pub(crate) fn unit_roundoff(self) -> f64 {
        match self {
            Half::Bf16 => 2f64.powi(-8),
            Half::Fp16 => 2f64.powi(-11),
        }
    }

    /// The smallest positive (subnormal) value: the spacing of values near zero.
    #[cfg(test)]
    pub(crate) fn min_subnormal(self) -> f64 {
        match self {
            Half::Bf16 => 2f64.powi(-133),
            Half::Fp16 => 2f64.powi(-24),
        }
    }

    /// `x` rounded to the format and back.
    #[cfg(test)]
    pub(crate) fn round(self, x: f32) -> f32 {
        self.widen(self.narrow(x))
    }

    #[cfg(test)]
    fn narrow(self, x: f32) -> u16 {
        match self {
            Half::Bf16 => bf16::from_f32(x).to_bits(),
            Half::Fp16 => f16::from_f32(x).to_bits(),
        }
    }

    #[cfg(test)]
    fn widen(self, b: u16) -> f32 {
        match self {
            Half::Bf16 => bf16::from_bits(b).to_f32(),
            Half::Fp16 => f16::from_bits(b).to_f32(),
        }
    }

    /// Rounds `src` into the 16-bit values `dst` (same length).
    fn narrow_block(self, src: &[f32], dst: &mut [u16]) {
        match self {
            Half::Bf16 => narrow_bf16(src, dst),
            // half converts slices with F16C where the CPU has it (detected at run time).
            Half::Fp16 => dst
                .reinterpret_cast_mut::<f16>()
                .convert_from_f32_slice(src),
        }
    }

    /// Widens the 16-bit values `src` into `dst` (same length).
    fn widen_block(self, src: &[u16], dst: &mut [f32]) {
        match self {
            Half::Bf16 => widen_bf16(src, dst),
            Half::Fp16 => src.reinterpret_cast::<f16>().convert_to_f32_slice(dst),
        }
    }
}

/// Defines `fn NAME(ARGS) BODY` with the body compiled twice, for AVX2 (taken when the CPU
/// has it, detected at run time) and for the baseline, so that its loop vectorises as wide as
/// the CPU allows. The bodies here use integer operations only: both give the same bits.
macro_rules! with_avx2 {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) $body:block) => {
        $(#[$doc])*
        fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn baseline($($arg: $ty),*) $body

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            fn avx2($($arg: $ty),*) {
                baseline($($arg),*)
            }

            #[cfg(target_arch = "x86_64")]
            if super::copy::has_avx2() {
                // SAFETY: the CPU has AVX2 (checked at run time).
                return unsafe { avx2($($arg),*) };
            }
            baseline($($arg),*)
        }
    };
}

with_avx2! {
    /// [`bf16_bits`] over a slice.
    fn narrow_bf16(src: &[f32], dst: &mut [u16]) {
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, &x)| *d = bf16_bits(x));
    }
}

with_avx2! {
    /// [`bf16_value`] over a slice.
    fn widen_bf16(src: &[u16], dst: &mut [f32]) {
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, &b)| *d = bf16_value(b));
    }
}

/// `x` rounded to bfloat16 (to nearest, ties to even; a NaN stays a quiet NaN), as bits.
///
/// Bit for bit what `half::bf16::from_f32` gives, written without branches so that the block
/// loops vectorise: adding `0x7fff` plus the lowest kept bit rounds the 16 dropped bits to
/// nearest-even, and a carry out of the significand bumps the exponent (to ∞ past the largest
/// finite value), as rounding must.
#[inline(always)]
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let quiet_nan = (b >> 16) | 0x40;
    let is_nan = b & 0x7fff_ffff > 0x7f80_0000;
    (if is_nan { quiet_nan } else { rounded }) as u16
}

/// The bfloat16 bits `b` as an f32 (exact; a NaN is quieted, as `half::bf16::to_f32` does).
#[inline(always)]
fn bf16_value(b: u16) -> f32 {
    let b = b as u32;
    let quiet = if b & 0x7fff > 0x7f80 { b | 0x40 } else { b };
    f32::from_bits(quiet << 16)
}

/// Elements per block of the kernels below when the wire bytes are not 2-byte aligned (or the
/// machine is big-endian): they then convert through a typed 16-bit block on the stack.
const BLOCK: usize = 1024;

/// The wire bytes as native 16-bit values, when their alignment and the byte order allow.
fn as_u16(bytes: &[u8]) -> Option<&[u16]> {
    cfg!(target_endian = "little")
        .then(|| bytemuck::try_cast_slice(bytes).ok())
        .flatten()
}

/// [`as_u16`], mutably.
fn as_u16_mut(bytes: &mut [u8]) -> Option<&mut [u16]> {
    cfg!(target_endian = "little")
        .then(|| bytemuck::try_cast_slice_mut(bytes).ok())
        .flatten()
}

/// Stores the 16-bit values `src` little-endian into `dst` (`2 * src.len()` bytes).
fn store(src: &mut [u16], dst: &mut [u8]) {
    src.iter_mut().for_each(|v| *v = v.to_le());
    dst.copy_from_slice(bytemuck::cast_slice(src));
}

/// Loads the little-endian 16-bit values `src` (`2 * dst.len()` bytes) into `dst`.
fn load(src: &[u8], dst: &mut [u16]) {
    bytemuck::cast_slice_mut(dst).copy_from_slice(src);
    dst.iter_mut().for_each(|v| *v = u16::from_le(*v));
}

/// Writes `src` rounded to `h` into `dst` (`2 * src.len()` bytes, little-endian, any alignment).
pub(crate) fn encode(h: Half, src: &[f32], dst: &mut [u8]) {
    assert_eq!(dst.len(), 2 * src.len(), "encode: length mismatch");
    if let Some(d) = as_u16_mut(dst) {
        return h.narrow_block(src, d);
    }
    let mut bits = [0u16; BLOCK];
    for (s, d) in src.chunks(BLOCK).zip(dst.chunks_mut(2 * BLOCK)) {
        let b = &mut bits[..s.len()];
        h.narrow_block(s, b);
        store(b, d);
    }
}

/// Decodes the 16-bit values `src` (`2 * dst.len()` bytes) into `dst`.
pub(crate) fn decode(h: Half, src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), 2 * dst.len(), "decode: length mismatch");
    if let Some(s) = as_u16(src) {
        return h.widen_block(s, dst);
    }
    let mut bits = [0u16; BLOCK];
    for (s, d) in src.chunks(2 * BLOCK).zip(dst.chunks_mut(BLOCK)) {
        let b = &mut bits[..d.len()];
        load(s, b);
        h.widen_block(b, d);
    }
}

/// Adds the decoded 16-bit values `src` (`2 * acc.len()` bytes) into the f32 accumulator.
pub(crate) fn accumulate(h: Half, acc: &mut [f32], src: &[u8]) {
    assert_eq!(src.len(), 2 * acc.len(), "accumulate: length mismatch");
    let mut values = [0f32; BLOCK];
    match as_u16(src) {
        Some(bits) => {
            for (b, a) in bits.chunks(BLOCK).zip(acc.chunks_mut(BLOCK)) {
                let v = &mut values[..a.len()];
                h.widen_block(b, v);
                a.iter_mut().zip(v.iter()).for_each(|(a, &x)| *a += x);
            }
        }
        None => {
            let mut bits = [0u16; BLOCK];
            for (s, a) in src.chunks(2 * BLOCK).zip(acc.chunks_mut(BLOCK)) {
                let (b, v) = (&mut bits[..a.len()], &mut values[..a.len()]);
                load(s, b);
                h.widen_block(b, v);
                a.iter_mut().zip(v.iter()).for_each(|(a, &x)| *a += x);
            }
        }
    }
}

/// Reduces one chunk in f32 and rounds the result once.
///
/// `terms` are the contributions in rank order, each `2 * dst.len()` bytes of 16-bit values
/// (every rank's, the caller's own included, rounded alike: the result does not depend on
/// which rank reduces). They are decoded and added in that order into an f32 accumulator,
/// which is divided by `div` (a mean) if given and rounded to `h` once: the 16-bit result goes
/// to `out`, its decoded value to `dst`.
pub(crate) fn reduce_chunk(
    h: Half,
    dst: &mut [f32],
    terms: &[&[u8]],
    div: Option<usize>,
    out: &mut [u8],
) {
    assert_eq!(out.len(), 2 * dst.len(), "reduce_chunk: length mismatch");
    assert!(!terms.is_empty(), "reduce_chunk: no terms");
    let mut acc = [0f32; BLOCK];
    let mut start = 0;
    while start < dst.len() {
        let end = (start + BLOCK).min(dst.len());
        let a = &mut acc[..end - start];
        decode(h, &terms[0][2 * start..2 * end], a);
        for t in &terms[1..] {
            accumulate(h, a, &t[2 * start..2 * end]);
        }
        if let Some(n) = div {
            let n = n as f32;
            a.iter_mut().for_each(|x| *x /= n);
        }
        let o = &mut out[2 * start..2 * end];
        encode(h, a, o);
        decode(h, o, &mut dst[start..end]);
        start = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for c in [Compression::None, Compression::Bf16, Compression::Fp16] {
            assert_eq!(c.to_string().parse::<Compression>().unwrap(), c);
        }
        assert_eq!(" BF16 ".parse::<Compression>().unwrap(), Compression::Bf16);
        let e = "fp8".parse::<Compression>().unwrap_err();
        assert!(matches!(e, CommError::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains("fp8"), "{e}");
        assert_eq!(Compression::default(), Compression::None);
        assert_eq!(Compression::None.bytes_per_element(), 4);
        assert_eq!(Compression::Fp16.bytes_per_element(), 2);
    }

    #[test]
    fn kernels_round_to_nearest() {
        let xs = [
            0.0f32,
            -0.0,
            1.0,
            1.0 + 1.0 / 512.0,
            3.3,
            -65504.0,
            1e-30,
            7e5,
        ];
        for h in [Half::Bf16, Half::Fp16] {
            let mut wire = vec![0u8; 2 * xs.len()];
            encode(h, &xs, &mut wire);
            let mut back = vec![0f32; xs.len()];
            decode(h, &wire, &mut back);
            for (&x, &b) in xs.iter().zip(&back) {
                assert_eq!(b.to_bits(), h.round(x).to_bits(), "{h:?} {x}");
                if x.abs() > 1e-4 && x.abs() <= 65504.0 {
                    let rel = ((b as f64 - x as f64) / x as f64).abs();
                    assert!(rel <= h.unit_roundoff(), "{h:?} {x} -> {b}");
                }
            }
            let mut acc = vec![1.0f32; xs.len()];
            accumulate(h, &mut acc, &wire);
            for (a, b) in acc.iter().zip(&back) {
                assert_eq!(*a, 1.0 + b);
            }
        }
        // Ties go to even: 1 + 2^-8 is halfway between two bf16 values.
        assert_eq!(Half::Bf16.round(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(Half::Fp16.round(7e5), f32::INFINITY);
        assert!(Half::Bf16.round(f32::NAN).is_nan());
    }

    /// The block kernels (vectorised, through a 16-bit block) give bit for bit what the `half`
    /// crate's scalar conversions give: every 16-bit pattern decodes alike, and f32 inputs —
    /// each 16-bit value, the ties and near-ties around it, the range edges and a spread of
    /// arbitrary bit patterns (NaNs and subnormals among them) — encode alike.
    #[test]
    fn block_kernels_match_half_bit_for_bit() {
        let all16: Vec<u16> = (0..=u16::MAX).collect();
        let wire: Vec<u8> = all16.iter().flat_map(|b| b.to_le_bytes()).collect();
        for h in [Half::Bf16, Half::Fp16] {
            let mut back = vec![0f32; all16.len()];
            decode(h, &wire, &mut back);
            for (&b, &v) in all16.iter().zip(&back) {
                assert_eq!(v.to_bits(), h.widen(b).to_bits(), "{h:?} decode {b:#06x}");
            }
            // Half an ulp of the format, in f32 bits (the dropped-bits tie of normal values).
            let tie: u32 = match h {
                Half::Bf16 => 0x8000,
                Half::Fp16 => 0x1000,
            };
            let mut xs: Vec<f32> = vec![
                65504.0,
                65519.996,
                65520.0,
                f32::MAX,
                f32::MIN_POSITIVE,
                2f32.powi(-24),
                2f32.powi(-25),
                2f32.powi(-25) * 1.0001,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                -0.0,
            ];
            for &v in &back {
                let b = v.to_bits();
                for d in [0, tie - 1, tie, tie + 1] {
                    xs.push(f32::from_bits(b.wrapping_add(d)));
                    xs.push(f32::from_bits(b.wrapping_sub(d)));
                }
            }
            xs.extend(
                (0..200_000u64).map(|i| f32::from_bits(sample(i).to_bits() ^ (i as u32) << 9)),
            );
            xs.extend((0..50_000u64).map(|i| f32::from_bits((i as u32).wrapping_mul(0x9e37_79b9))));
            let mut w = vec![0u8; 2 * xs.len()];
            encode(h, &xs, &mut w);
            for (x, e) in xs.iter().zip(w.chunks_exact(2)) {
                let got = u16::from_le_bytes([e[0], e[1]]);
                assert_eq!(got, h.narrow(*x), "{h:?} encode {:#010x}", x.to_bits());
            }
            // Wire bytes at an odd address take the blocked path: the same bits.
            let mut odd = vec![0u8; 2 * xs.len() + 1];
            encode(h, &xs, &mut odd[1..]);
            assert!(odd[1..] == w[..], "{h:?}: unaligned encode differs");
            let mut from_odd = vec![0f32; all16.len()];
            let mut odd_wire = vec![0u8; wire.len() + 1];
            odd_wire[1..].copy_from_slice(&wire);
            decode(h, &odd_wire[1..], &mut from_odd);
            assert!(
                from_odd
                    .iter()
                    .zip(&back)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{h:?}: unaligned decode differs"
            );
            let mut acc = vec![0.5f32; all16.len()];
            accumulate(h, &mut acc, &odd_wire[1..]);
            let mut acc_aligned = vec![0.5f32; all16.len()];
            accumulate(h, &mut acc_aligned, &wire);
            assert!(
                acc.iter().zip(&acc_aligned).zip(&back).all(|((a, b), v)| {
                    a.to_bits() == b.to_bits() && a.to_bits() == (0.5 + v).to_bits()
                }),
                "{h:?}: accumulate differs between the paths"
            );
        }
    }

    /// A deterministic pseudo-random value in about ±4, with a full f32 significand.
    fn sample(seed: u64) -> f32 {
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        ((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
    }

    /// Eight simulated ranks: accumulating in f32 and rounding once (what
    /// `all_reduce_compressed` does) beats summing in 16 bits (round after every add, what a
    /// ring that forwards 16-bit partial sums, or PyTorch's `bf16_compress_hook`, computes).
    #[test]
    fn f32_accumulation_beats_summing_in_16_bits() {
        const RANKS: usize = 8;
        const LEN: usize = 20_000;
        for h in [Half::Bf16, Half::Fp16] {
            let data: Vec<Vec<f32>> = (0..RANKS)
                .map(|r| (0..LEN).map(|i| sample((r * LEN + i) as u64)).collect())
                .collect();
            let wires: Vec<Vec<u8>> = data
                .iter()
                .map(|d| {
                    let mut w = vec![0u8; 2 * LEN];
                    encode(h, d, &mut w);
                    w
                })
                .collect();
            // Ours: decode + add in f32, divide, round once.
            let mut acc = vec![0f32; LEN];
            for w in &wires {
                accumulate(h, &mut acc, w);
            }
            let ours: Vec<f32> = acc.iter().map(|&s| h.round(s / RANKS as f32)).collect();
            // Summing in 16 bits: every partial sum is rounded.
            let mut part = vec![0f32; LEN];
            decode(h, &wires[0], &mut part);
            let mut term = vec![0f32; LEN];
            for w in &wires[1..] {
                decode(h, w, &mut term);
                for (p, t) in part.iter_mut().zip(&term) {
                    *p = h.round(*p + *t);
                }
            }
            let summed16: Vec<f32> = part.iter().map(|&s| h.round(s / RANKS as f32)).collect();
            let (mut max_ours, mut max_16, mut tot_ours, mut tot_16) = (0f64, 0f64, 0f64, 0f64);
            for i in 0..LEN {
                let exact = data.iter().map(|d| d[i] as f64).sum::<f64>() / RANKS as f64;
                let (eo, e16) = (
                    (ours[i] as f64 - exact).abs(),
                    (summed16[i] as f64 - exact).abs(),
                );
                max_ours = max_ours.max(eo);
                max_16 = max_16.max(e16);
                tot_ours += eo;
                tot_16 += e16;
            }
            eprintln!(
                "{h:?}, {RANKS} ranks: max error {max_ours:e} (f32 accumulation) vs {max_16:e} \
                 (16-bit sums)"
            );
            assert!(
                max_ours < max_16 && tot_ours < tot_16,
                "{h:?}: max error {max_ours:e} (f32 accumulation) vs {max_16:e} (16-bit sums), \
                 mean {:e} vs {:e}",
                tot_ours / LEN as f64,
                tot_16 / LEN as f64
            );
        }
    }
}
