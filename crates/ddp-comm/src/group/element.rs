//! [`Element`] for the built-in types, and the reduction kernels the collectives run.

use super::{Element, ReduceOp};

macro_rules! float_element {
    ($t:ty, $name:literal) => {
        impl Element for $t {
            const NAME: &'static str = $name;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a + b
            }
            #[inline(always)]
            fn div_count(a: Self, n: usize) -> Self {
                a / n as $t
            }
        }
    };
}

macro_rules! int_element {
    ($t:ty, $name:literal) => {
        impl Element for $t {
            const NAME: &'static str = $name;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn div_count(a: Self, n: usize) -> Self {
                // World sizes are small; a count that does not fit the type leaves `a` alone
                // only for u8 with more than 255 ranks, where every mean is 0 anyway.
                match <$t>::try_from(n) {
                    Ok(n) if n != 0 => a / n,
                    _ => 0,
                }
            }
        }
    };
}

float_element!(f32, "f32");
float_element!(f64, "f64");
int_element!(i64, "i64");
int_element!(i32, "i32");
int_element!(u8, "u8");

/// A stable 32-bit tag for an element type (FNV-1a of its name and size), sent in headers.
pub(crate) fn dtype_tag<T: Element>() -> u32 {
    tag_of(T::NAME, std::mem::size_of::<T>())
}

/// The tag of the element type named `name`, of `size` bytes (also for wire-only types such as
/// the 16-bit formats of the compressed all-reduce).
pub(crate) fn tag_of(name: &str, size: usize) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes().chain([size as u8]) {
        h ^= b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// The name of a built-in element type from its tag (for messages about a peer's call).
pub(crate) fn name_of_tag(tag: u32) -> Option<&'static str> {
    [
        (dtype_tag::<f32>(), f32::NAME),
        (dtype_tag::<f64>(), f64::NAME),
        (dtype_tag::<i64>(), i64::NAME),
        (dtype_tag::<i32>(), i32::NAME),
        (dtype_tag::<u8>(), u8::NAME),
        (tag_of("bf16", 2), "bf16"),
        (tag_of("fp16", 2), "fp16"),
    ]
    .into_iter()
    .find(|(t, _)| *t == tag)
    .map(|(_, n)| n)
}

/// Reduces `src` (raw bytes of `dst.len()` elements, any alignment) into `dst`.
/// `Mean` reduces like `Sum`; the division happens once at the end.
pub(crate) fn reduce_into<T: Element>(dst: &mut [T], src: &[u8], op: ReduceOp) {
    assert_eq!(
        src.len(),
        std::mem::size_of_val(dst),
        "reduce_into: length mismatch"
    );
    #[cfg(target_arch = "x86_64")]
    if super::copy::has_avx2() {
        // SAFETY: AVX2 is available (checked at run time).
        unsafe { reduce_avx2(dst, src, op) };
        return;
    }
    reduce_portable(dst, src, op);
}

/// The same loops compiled for AVX2 (4–8 lanes instead of SSE2's 2–4).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn reduce_avx2<T: Element>(dst: &mut [T], src: &[u8], op: ReduceOp) {
    reduce_portable(dst, src, op);
}

#[inline(always)]
fn reduce_portable<T: Element>(dst: &mut [T], src: &[u8], op: ReduceOp) {
    let sz = std::mem::size_of::<T>();
    let p = src.as_ptr();
    // The loops are kept simple so they vectorise; `read_unaligned` because shared-memory and
    // staging positions are only element- not type-aligned.
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            for (i, d) in dst.iter_mut().enumerate() {
                // SAFETY: i < dst.len() and src holds dst.len() elements.
                let s = unsafe { std::ptr::read_unaligned(p.add(i * sz) as *const T) };
                *d = T::add(*d, s);
            }
        }
        ReduceOp::Max => {
            for (i, d) in dst.iter_mut().enumerate() {
                // SAFETY: as above.
                let s = unsafe { std::ptr::read_unaligned(p.add(i * sz) as *const T) };
                if s > *d {
                    *d = s;
                }
            }
        }
        ReduceOp::Min => {
            for (i, d) in dst.iter_mut().enumerate() {
                // SAFETY: as above.
                let s = unsafe { std::ptr::read_unaligned(p.add(i * sz) as *const T) };
                if s < *d {
                    *d = s;
                }
            }
        }
    }
}

/// Byte-level entry for the engine: `dst` is a byte view of a `[T]` region (aligned).
pub(crate) fn reduce_bytes<T: Element>(dst: &mut [u8], src: &[u8], op: ReduceOp) {
    let dst: &mut [T] = bytemuck::cast_slice_mut(dst);
    reduce_into(dst, src, op);
}

/// Divides every element by `n` (the last step of [`ReduceOp::Mean`]).
pub(crate) fn divide<T: Element>(buf: &mut [T], n: usize) {
    for x in buf {
        *x = T::div_count(*x, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels() {
        let mut d = vec![1.0f32, 5.0, -2.0];
        let s = [2.0f32, 3.0, -1.0];
        reduce_into(&mut d, bytemuck::cast_slice(&s), ReduceOp::Sum);
        assert_eq!(d, [3.0, 8.0, -3.0]);
        reduce_into(&mut d, bytemuck::cast_slice(&s), ReduceOp::Max);
        assert_eq!(d, [3.0, 8.0, -1.0]);
        reduce_into(&mut d, bytemuck::cast_slice(&s), ReduceOp::Min);
        assert_eq!(d, [2.0, 3.0, -1.0]);
        let mut i = vec![i64::MAX, 7];
        reduce_into(&mut i, bytemuck::cast_slice(&[1i64, 2]), ReduceOp::Sum);
        assert_eq!(i, [i64::MIN, 9]);
        divide(&mut i, 2);
        assert_eq!(i, [i64::MIN / 2, 4]);
        let mut u = vec![250u8, 3];
        reduce_into(&mut u, &[10, 4], ReduceOp::Sum);
        assert_eq!(u, [4, 7]);
        divide(&mut u, 300);
        assert_eq!(u, [0, 0]);
    }

    #[test]
    fn unaligned_source() {
        let raw: Vec<u8> = std::iter::once(0u8)
            .chain(bytemuck::cast_slice(&[1.5f64, 2.5]).iter().copied())
            .collect();
        let mut d = vec![1.0f64, 1.0];
        reduce_into(&mut d, &raw[1..], ReduceOp::Sum);
        assert_eq!(d, [2.5, 3.5]);
    }

    #[test]
    fn tags_differ() {
        let tags = [
            dtype_tag::<f32>(),
            dtype_tag::<f64>(),
            dtype_tag::<i64>(),
            dtype_tag::<i32>(),
            dtype_tag::<u8>(),
            tag_of("bf16", 2),
            tag_of("fp16", 2),
        ];
        for i in 0..tags.len() {
            for j in i + 1..tags.len() {
                assert_ne!(tags[i], tags[j]);
            }
        }
    }
}
