//! The bucket planner: present slots packed in order into buckets of at most the cap. Pure
//! code over sizes, so every rank computes the same plan from the same reduced bitmap.

use super::slots::Slot;

/// A run of consecutive present slots reduced in one all-reduce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Bucket {
    /// Indices into the slot list, in order.
    pub(crate) slots: Vec<usize>,
    /// Total f32 values.
    pub(crate) len: usize,
}

/// Packs present slots in order into buckets of at most `cap` values (a bigger slot gets a
/// bucket of its own).
pub(crate) fn plan_buckets(slots: &[Slot], present: &[bool], cap: usize) -> Vec<Bucket> {
    plan_bucket_sizes(slots.iter().map(|s| s.numel), present, cap)
}

/// [`plan_buckets`] over the slots' sizes.
pub(crate) fn plan_bucket_sizes(
    sizes: impl Iterator<Item = usize>,
    present: &[bool],
    cap: usize,
) -> Vec<Bucket> {
    let mut buckets = Vec::new();
    let mut cur = Bucket {
        slots: Vec::new(),
        len: 0,
    };
    for (i, numel) in sizes.enumerate() {
        if !present[i] {
            continue;
        }
        if !cur.slots.is_empty() && cur.len + numel > cap {
            buckets.push(std::mem::replace(
                &mut cur,
                Bucket {
                    slots: Vec::new(),
                    len: 0,
                },
            ));
        }
        cur.slots.push(i);
        cur.len += numel;
    }
    if !cur.slots.is_empty() {
        buckets.push(cur);
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sizes(b: &[Bucket]) -> Vec<(Vec<usize>, usize)> {
        b.iter().map(|b| (b.slots.clone(), b.len)).collect()
    }

    #[test]
    fn buckets_pack_in_order_and_respect_the_cap() {
        let s = [3usize, 4, 2, 10, 1];
        let present = [true; 5];
        let b = plan_bucket_sizes(s.iter().copied(), &present, 7);
        assert_eq!(
            sizes(&b),
            vec![(vec![0, 1], 7), (vec![2], 2), (vec![3], 10), (vec![4], 1)]
        );
    }

    #[test]
    fn absent_slots_are_skipped() {
        let s = [3usize, 4, 2];
        let b = plan_bucket_sizes(s.iter().copied(), &[true, false, true], 100);
        assert_eq!(sizes(&b), vec![(vec![0, 2], 5)]);
        let none = plan_bucket_sizes(s.iter().copied(), &[false; 3], 100);
        assert!(none.is_empty());
    }

    proptest! {
        /// Every present slot lands in exactly one bucket, in order; absent ones in none; a
        /// bucket exceeds the cap only when it holds one slot alone; no two neighbouring
        /// buckets could have been merged under the cap.
        #[test]
        fn plans_cover_present_slots_in_order_under_the_cap(
            slots in proptest::collection::vec((1usize..50, any::<bool>()), 0..40),
            cap in 1usize..120,
        ) {
            let sizes: Vec<usize> = slots.iter().map(|s| s.0).collect();
            let present: Vec<bool> = slots.iter().map(|s| s.1).collect();
            let plan = plan_bucket_sizes(sizes.iter().copied(), &present, cap);
            let flat: Vec<usize> = plan.iter().flat_map(|b| b.slots.clone()).collect();
            let expected: Vec<usize> = (0..sizes.len()).filter(|&i| present[i]).collect();
            prop_assert_eq!(flat, expected);
            for b in &plan {
                prop_assert!(!b.slots.is_empty());
                prop_assert_eq!(b.len, b.slots.iter().map(|&i| sizes[i]).sum::<usize>());
                prop_assert!(b.len <= cap || b.slots.len() == 1);
            }
            for w in plan.windows(2) {
                let first_of_next = sizes[w[1].slots[0]];
                prop_assert!(w[0].len + first_of_next > cap);
            }
        }
    }
}
