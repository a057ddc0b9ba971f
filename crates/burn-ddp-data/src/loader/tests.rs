use std::collections::BTreeMap;
use std::time::Instant;

use burn::data::dataset::InMemDataset;
use burn::tensor::{Int, Tensor, TensorData};

use super::*;

/// Returns the ids it was given, untouched.
#[derive(Clone)]
struct Ids;
impl Batcher<usize, Vec<usize>> for Ids {
    fn batch(&self, items: Vec<usize>, _device: &Device) -> Vec<usize> {
        items
    }
}

/// Panics on a given item.
#[derive(Clone)]
struct PanicOn(usize);
impl Batcher<usize, Vec<usize>> for PanicOn {
    fn batch(&self, items: Vec<usize>, _device: &Device) -> Vec<usize> {
        assert!(!items.contains(&self.0), "poisoned item {}", self.0);
        items
    }
}

/// A dataset whose item `bad` fails to load.
struct Failing {
    len: usize,
    bad: usize,
}
impl Dataset<usize> for Failing {
    fn get(&self, index: usize) -> Result<usize, DatasetError> {
        if index == self.bad {
            Err(DatasetError::new(std::io::Error::other(format!(
                "disk error at {index}"
            ))))
        } else {
            Ok(index)
        }
    }
    fn len(&self) -> usize {
        self.len
    }
}

fn ids(n: usize) -> InMemDataset<usize> {
    InMemDataset::new((0..n).collect())
}

fn loader(
    n: usize,
    rank: usize,
    world: usize,
    batch: usize,
    workers: usize,
) -> ShardedDataLoader<usize, Vec<usize>> {
    ShardedDataLoaderBuilder::new(Ids)
        .batch_size(batch)
        .seed(11)
        .num_workers(workers)
        .build(ids(n), rank, world, Device::default())
        .unwrap()
}

fn epoch(l: &ShardedDataLoader<usize, Vec<usize>>) -> Vec<Vec<usize>> {
    l.batches().map(Result::unwrap).collect()
}

/// The loader yields exactly the sampler's shard, chunked in order.
#[test]
fn batches_are_the_sampler_shard_in_order() {
    for workers in [0, 1, 3] {
        let l = loader(103, 2, 4, 5, workers);
        let expected = l.sampler().indices();
        let got: Vec<usize> = epoch(&l).into_iter().flatten().collect();
        assert_eq!(got, expected, "workers = {workers}");
    }
}

#[test]
fn output_does_not_depend_on_worker_count() {
    let inline = loader(257, 1, 3, 7, 0);
    let reference: Vec<_> = (0..3).map(|_| epoch(&inline)).collect();
    for workers in [1, 2, 5, 16] {
        let l = loader(257, 1, 3, 7, workers);
        let got: Vec<_> = (0..3).map(|_| epoch(&l)).collect();
        assert_eq!(got, reference, "workers = {workers}");
    }
    assert_eq!(reference[2], epoch_n(257, 1, 3, 7, 2));
}

/// Epoch `e` of a fresh loader, reached through `set_epoch`.
fn epoch_n(n: usize, rank: usize, world: usize, batch: usize, e: u64) -> Vec<Vec<usize>> {
    let l = loader(n, rank, world, batch, 0);
    l.set_epoch(e);
    epoch(&l)
}

#[test]
fn epoch_advances_each_pass_and_is_settable() {
    let l = loader(100, 0, 2, 10, 2);
    assert_eq!(l.epoch(), 0);
    let e0 = epoch(&l);
    assert_eq!(l.epoch(), 1);
    let e1 = epoch(&l);
    assert_ne!(e0, e1);
    l.set_epoch(0);
    assert_eq!(epoch(&l), e0);
    assert_eq!(
        l.state(),
        LoaderState {
            epoch: 1,
            batches_done: 0,
            samples_done: Some(0),
            world_size: Some(2),
        }
    );
}

/// Save mid-epoch, restore into a fresh loader: the rest of the epoch and the next epoch match.
#[test]
fn state_resumes_mid_epoch() {
    let l = loader(200, 1, 2, 8, 2);
    let full0 = epoch(&l);
    let full1 = epoch(&l);
    l.set_epoch(0);
    let mut it = l.batches();
    for _ in 0..4 {
        it.next().unwrap().unwrap();
    }
    let saved = l.state();
    assert_eq!(
        saved,
        LoaderState {
            epoch: 0,
            batches_done: 4,
            samples_done: Some(4 * 8 * 2),
            world_size: Some(2),
        }
    );
    drop(it);

    let resumed = loader(200, 1, 2, 8, 3);
    resumed.load_state(saved);
    assert_eq!(epoch(&resumed), full0[4..].to_vec());
    assert_eq!(epoch(&resumed), full1);
}

/// Reads `batches` batches of epoch 0 on every rank of a `world`-rank job (resumed from
/// `from`, if given); returns the ids read and rank 0's state after them.
fn read_some(
    world: usize,
    from: Option<LoaderState>,
    batches: usize,
) -> (Vec<usize>, LoaderState, Vec<usize>) {
    let mut read = Vec::new();
    let mut state = None;
    let mut counts = Vec::new();
    for rank in 0..world {
        let l = loader(203, rank, world, 5, 0);
        if let Some(s) = from {
            l.load_state(s);
        }
        let mut it = l.batches();
        counts.push(it.num_batches());
        for b in it.by_ref().take(batches) {
            read.extend(b.unwrap());
        }
        state.get_or_insert(l.state());
        drop(it);
    }
    (read, state.unwrap(), counts)
}

/// A job of 3 ranks checkpoints after 4 batches; it resumes with 2 ranks, checkpoints again
/// after 3 batches, and finishes with 4 ranks: the epoch's items are all read, none twice
/// beyond the padding of each phase (fewer than its world size), every rank of a phase gets
/// the same count; a resume at the same world size continues exactly.
#[test]
fn an_epoch_resumed_at_other_world_sizes_reads_every_item_once() {
    let (mut read, after3, _) = read_some(3, None, 4);
    assert_eq!(after3.samples_done, Some(4 * 5 * 3));
    assert_eq!(after3.world_size, Some(3));
    let (more, after2, counts2) = read_some(2, Some(after3), 3);
    assert!(counts2.iter().all(|c| *c == counts2[0]), "{counts2:?}");
    assert_eq!(after2.samples_done, Some(4 * 5 * 3 + 3 * 5 * 2));
    read.extend(more);
    let (rest, end, counts4) = read_some(4, Some(after2), usize::MAX);
    assert!(counts4.iter().all(|c| *c == counts4[0]), "{counts4:?}");
    read.extend(rest);
    let distinct: std::collections::HashSet<usize> = read.iter().copied().collect();
    assert_eq!(distinct.len(), 203, "every item of the epoch was read");
    // Only the last phase pads: 203 - 60 - 30 = 113 items over 4 ranks → 3 repeated.
    assert_eq!(read.len(), 203 + 3);
    assert_eq!(
        end,
        LoaderState {
            samples_done: Some(0),
            world_size: Some(4),
            ..LoaderState::at_epoch(1)
        }
    );

    // At the same world size, the resumed rest equals the uninterrupted rest, batch by batch,
    // also from a state written by a pass that itself resumed at another size.
    for (world, from) in [(3, None), (2, Some(after3))] {
        let (_, state, _) = read_some(world, from, 2);
        for rank in 0..world {
            let whole = loader(203, rank, world, 5, 0);
            if let Some(s) = from {
                whole.load_state(s);
            }
            let uninterrupted = epoch(&whole);
            let resumed = loader(203, rank, world, 5, 0);
            resumed.load_state(state);
            let got: Vec<usize> = epoch(&resumed).into_iter().flatten().collect();
            let want: Vec<usize> = uninterrupted[2..].iter().flatten().copied().collect();
            assert_eq!(got, want, "world {world} rank {rank}");
        }
    }
}

#[test]
fn same_batch_count_on_every_rank() {
    for (n, world, batch, drop_last, drop_batch) in [
        (100, 3, 7, false, false),
        (100, 3, 7, true, false),
        (100, 3, 7, false, true),
        (99, 3, 11, false, false),
        (5, 8, 2, false, false),
    ] {
        let counts: Vec<usize> = (0..world)
            .map(|rank| {
                let l = ShardedDataLoaderBuilder::new(Ids)
                    .batch_size(batch)
                    .drop_last(drop_last)
                    .drop_last_batch(drop_batch)
                    .build(ids(n), rank, world, Device::default())
                    .unwrap();
                let got = epoch(&l);
                assert_eq!(got.len(), l.num_batches());
                assert_eq!(
                    got.iter().map(Vec::len).sum::<usize>(),
                    l.num_items_per_epoch()
                );
                if drop_batch {
                    assert!(got.iter().all(|b| b.len() == batch));
                }
                got.len()
            })
            .collect();
        assert!(counts.windows(2).all(|w| w[0] == w[1]), "{counts:?}");
    }
}

/// Empty dataset, or fewer items than ranks with drop_last: an empty epoch, promptly.
#[test]
fn empty_epochs_end_immediately() {
    for workers in [0, 2] {
        let l = loader(0, 1, 4, 3, workers);
        assert_eq!(l.num_batches(), 0);
        assert!(epoch(&l).is_empty());
        assert!(epoch(&l).is_empty());
        let l = ShardedDataLoaderBuilder::new(Ids)
            .drop_last(true)
            .num_workers(workers)
            .build(ids(3), 3, 4, Device::default())
            .unwrap();
        assert!(epoch(&l).is_empty());
    }
    // Fewer items than ranks without drop_last: one (repeated) item per rank.
    let l = loader(3, 3, 4, 2, 2);
    assert_eq!(epoch(&l).iter().map(Vec::len).collect::<Vec<_>>(), vec![1]);
}

#[test]
fn bad_config_is_an_error() {
    let b = || ShardedDataLoaderBuilder::new(Ids);
    assert!(matches!(
        b().build(ids(4), 2, 2, Device::default()),
        Err(DataError::RankOutOfRange { .. })
    ));
    assert!(matches!(
        b().build(ids(4), 0, 0, Device::default()),
        Err(DataError::ZeroReplicas)
    ));
    assert!(matches!(
        b().batch_size(0).build(ids(4), 0, 1, Device::default()),
        Err(DataError::ZeroBatchSize)
    ));
}

#[test]
fn batcher_panic_is_an_error_not_a_hang() {
    for workers in [0, 1, 3] {
        let l = ShardedDataLoaderBuilder::new(PanicOn(37))
            .batch_size(4)
            .shuffle(false)
            .num_workers(workers)
            .build(ids(100), 0, 1, Device::default())
            .unwrap();
        let start = Instant::now();
        let results: Vec<_> = l.batches().collect();
        // Batches 0..9 are fine, batch 9 (items 36..40) panics, and the pass ends there.
        assert_eq!(results.len(), 10, "workers = {workers}");
        assert!(results[..9].iter().all(Result::is_ok));
        let err = results[9].as_ref().unwrap_err();
        assert!(
            matches!(err, DataError::Panicked { batch: 9, message, .. } if message.contains("poisoned item 37")),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(60));
        // The loader stays usable: the next pass reports the same failure again.
        assert!(l.batches().any(|r| r.is_err()));
    }
}

#[test]
fn dataset_error_is_an_error() {
    for workers in [0, 2] {
        let l = ShardedDataLoaderBuilder::new(Ids)
            .batch_size(3)
            .shuffle(false)
            .num_workers(workers)
            .build(Failing { len: 30, bad: 10 }, 0, 1, Device::default())
            .unwrap();
        let results: Vec<_> = l.batches().collect();
        assert_eq!(results.len(), 4);
        let err = results[3].as_ref().unwrap_err();
        assert!(err.to_string().contains("disk error at 10"), "{err}");
        assert!(matches!(err, DataError::Dataset { batch: 3, .. }));
    }
}

#[test]
fn timeout_is_an_error() {
    #[derive(Clone)]
    struct Slow;
    impl Batcher<usize, Vec<usize>> for Slow {
        fn batch(&self, items: Vec<usize>, _device: &Device) -> Vec<usize> {
            std::thread::sleep(Duration::from_millis(500));
            items
        }
    }
    let l = ShardedDataLoaderBuilder::new(Slow)
        .num_workers(1)
        .batch_timeout(Duration::from_millis(20))
        .build(ids(4), 0, 1, Device::default())
        .unwrap();
    let results: Vec<_> = l.batches().collect();
    assert_eq!(results.len(), 1);
    assert!(matches!(
        results[0],
        Err(DataError::Timeout { batch: 0, .. })
    ));
}

/// Abandoning a pass (the consumer stops early) does not block the next pass, even with
/// full prefetch queues.
#[test]
fn abandoned_and_superseded_passes_do_not_block() {
    let l = loader(1000, 0, 1, 1, 3);
    let mut first = l.batches();
    first.next().unwrap().unwrap();
    // A new pass while `first` is still alive: `first` is superseded, the new one completes.
    let second = epoch(&l);
    assert_eq!(second.len(), 1000);
    let rest: Vec<_> = first.collect();
    assert_eq!(rest.len(), 1);
    assert!(matches!(rest[0], Err(DataError::Superseded { epoch: 0 })));
    // And a pass abandoned by dropping its iterator does not hold up the next one.
    let mut third = l.batches();
    third.next().unwrap().unwrap();
    drop(third);
    assert_eq!(epoch(&l).len(), 1000);
    drop(l); // no join hang with everything dropped
}

#[test]
fn dropping_the_loader_while_iterating_does_not_hang() {
    let l = loader(1000, 0, 1, 1, 2);
    let mut it = l.batches();
    it.next().unwrap().unwrap();
    drop(l);
    // The iterator ends (with an error or the batches already prefetched) instead of hanging.
    let start = Instant::now();
    let n = it.count();
    assert!(n < 1000);
    assert!(start.elapsed() < Duration::from_secs(60));
}

/// Burn's `DataLoader` trait: same batches as `batches()`, progress counts this rank's items,
/// `slice` splits the shard and `to_device` keeps the order.
#[test]
fn burn_dataloader_trait() {
    let l = loader(50, 1, 2, 4, 2);
    let plain = epoch_n(50, 1, 2, 4, 0);
    let dl: &dyn DataLoader<Vec<usize>> = &l;
    assert_eq!(dl.num_items(), 25);
    let mut it = dl.iter();
    let mut got = Vec::new();
    for b in it.by_ref() {
        got.push(b.unwrap());
    }
    assert_eq!(got, plain);
    let p = it.progress();
    assert_eq!((p.items_processed, p.items_total), (25, 25));

    let l = loader(50, 1, 2, 4, 2);
    let head = l.slice(0, 12);
    let tail = l.slice(12, 25);
    assert_eq!(head.num_items() + tail.num_items(), 25);
    let joined: Vec<usize> = head
        .iter()
        .chain(tail.iter())
        .flat_map(Result::unwrap)
        .collect();
    assert_eq!(joined, plain.concat());

    let moved = l.to_device(&Device::default());
    assert_eq!(moved.iter().map(Result::unwrap).collect::<Vec<_>>(), plain);
    assert!(l.slice_items(5, 2).is_err());
}

/// Batches are tensors on the loader's device.
#[test]
fn tensor_batches_on_device() {
    #[derive(Clone)]
    struct ToTensor;
    impl Batcher<usize, Tensor<1, Int>> for ToTensor {
        fn batch(&self, items: Vec<usize>, device: &Device) -> Tensor<1, Int> {
            let n = items.len();
            let v: Vec<i64> = items.into_iter().map(|i| i as i64).collect();
            Tensor::from_data(TensorData::new(v, [n]), device)
        }
    }
    let device = Device::default();
    let l = ShardedDataLoaderBuilder::new(ToTensor)
        .batch_size(6)
        .num_workers(2)
        .build(ids(40), 0, 2, device.clone())
        .unwrap();
    let mut seen = BTreeMap::new();
    for batch in l.batches() {
        let t = batch.unwrap();
        assert_eq!(t.device(), device);
        for v in t.into_data().try_to_vec_as::<i64>().unwrap() {
            *seen.entry(v).or_insert(0) += 1;
        }
    }
    assert_eq!(seen.values().sum::<i32>(), 20);
    assert_eq!(seen.keys().map(|&k| k as usize).collect::<Vec<_>>(), {
        let mut s = l.sampler();
        s.set_epoch(0);
        let mut v = s.indices();
        v.sort_unstable();
        v
    });
}
