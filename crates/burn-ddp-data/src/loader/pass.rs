//! [`ShardedBatches`]: one pass over this rank's batches, in plan order, with timeouts.

use super::workers::build_batch;
use super::*;

/// Where the batches of a pass come from.
pub(super) enum Source<I, O> {
    /// Built in the iterating thread (`num_workers == 0`).
    Inline {
        dataset: Arc<dyn Dataset<I>>,
        batcher: Arc<dyn Batcher<I, O>>,
        device: Device,
    },
    /// Built by the worker pool; batch `k` comes from receiver `(k - first) % workers` of
    /// the active pass, if this pass is still the active one.
    Workers {
        active: ActiveSlot<O>,
        workers: usize,
    },
}

/// The batches of one pass (one epoch) of a [`ShardedDataLoader`], in order.
pub struct ShardedBatches<I, O> {
    pub(super) source: Option<Source<I, O>>,
    pub(super) pending_error: Option<DataError>,
    pub(super) batches: Arc<Vec<Vec<usize>>>,
    pub(super) next: usize,
    pub(super) first: usize,
    pub(super) epoch: u64,
    pub(super) items_done: usize,
    pub(super) items_total: usize,
    pub(super) generation: u64,
    pub(super) live_generation: Arc<AtomicU64>,
    pub(super) state: Arc<Mutex<EpochState>>,
    pub(super) timeout: Duration,
    pub(super) finished: bool,
}

impl<I, O> ShardedBatches<I, O> {
    /// The epoch of this pass.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Batches this pass yields in total (including any skipped on resume).
    pub fn num_batches(&self) -> usize {
        self.batches.len()
    }

    /// Items yielded so far / items in this pass on this rank.
    pub fn progress(&self) -> Progress {
        Progress::new(self.items_done, self.items_total, Some("items".to_string()))
    }

    fn record(&self, batches_done: usize, done: bool) {
        let mut s = lock(&self.state);
        if let Some((generation, _, n)) = s.current.as_mut()
            && *generation == self.generation
        {
            *n = batches_done;
            if done {
                s.current = None;
            }
        }
    }

    fn fetch(&mut self, k: usize) -> Result<O, DataError> {
        let _span = ddp_trace::span("loader_wait", "data").arg("batch", k);
        match self
            .source
            .as_ref()
            .expect("source is set when no error is pending")
        {
            Source::Inline {
                dataset,
                batcher,
                device,
            } => build_batch(
                dataset.as_ref(),
                batcher.as_ref(),
                &self.batches[k],
                device,
                self.epoch,
                k,
            ),
            Source::Workers { active, workers } => {
                let worker = (k - self.first) % *workers;
                let slot = lock(active);
                let Some(pass) = slot.as_ref().filter(|p| p.generation == self.generation) else {
                    return Err(DataError::Superseded { epoch: self.epoch });
                };
                match pass.receivers[worker].recv_timeout(self.timeout) {
                    Ok(result) => result,
                    Err(RecvTimeoutError::Timeout) => Err(DataError::Timeout {
                        batch: k,
                        epoch: self.epoch,
                        timeout: self.timeout,
                    }),
                    Err(RecvTimeoutError::Disconnected) => {
                        if self.live_generation.load(Ordering::SeqCst) != self.generation {
                            Err(DataError::Superseded { epoch: self.epoch })
                        } else {
                            Err(DataError::WorkerLost {
                                worker,
                                batch: k,
                                epoch: self.epoch,
                            })
                        }
                    }
                }
            }
        }
    }
}

impl<I, O> ShardedBatches<I, O> {
    /// Ends the pass: drops its receivers (if still active) so its workers are released.
    fn release(&mut self) {
        if let Some(Source::Workers { active, .. }) = self.source.take() {
            let mut slot = lock(&active);
            if slot
                .as_ref()
                .is_some_and(|p| p.generation == self.generation)
            {
                *slot = None;
            }
        }
    }
}

impl<I, O> Drop for ShardedBatches<I, O> {
    fn drop(&mut self) {
        self.release();
    }
}

impl<I, O> Iterator for ShardedBatches<I, O> {
    type Item = Result<O, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.finished {
            return None;
        }
        if let Some(e) = self.pending_error.take() {
            self.finished = true;
            return Some(Err(e));
        }
        if self.next >= self.batches.len() {
            self.finished = true;
            self.release();
            self.record(self.next, true);
            return None;
        }
        let k = self.next;
        // The flight recorder's phases: data while fetching, forward once the batch is out.
        ddp_doctor::set_phase(ddp_doctor::Phase::Data);
        let fetched = self.fetch(k);
        ddp_doctor::set_phase(ddp_doctor::Phase::Forward);
        match fetched {
            Ok(batch) => {
                self.next += 1;
                self.items_done += self.batches[k].len();
                self.record(self.next, false);
                Some(Ok(batch))
            }
            Err(e) => {
                tracing::error!(epoch = self.epoch, batch = k, error = %e, "data loader error");
                self.finished = true;
                self.release();
                Some(Err(e))
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        if self.finished {
            return (0, Some(0));
        }
        let left = self.batches.len() - self.next.min(self.batches.len());
        (0, Some(left + usize::from(self.pending_error.is_some())))
    }
}
