//! The worker pool: persistent threads that build batch `k` of a pass on worker
//! `k mod workers`, with bounded prefetch, turning dataset errors and panics into errors.

use super::*;

/// Fetches the items of one batch and batches them, turning a dataset error or a panic into
/// a [`DataError`].
pub(super) fn build_batch<I, O>(
    dataset: &dyn Dataset<I>,
    batcher: &dyn Batcher<I, O>,
    indices: &[usize],
    device: &Device,
    epoch: u64,
    batch: usize,
) -> Result<O, DataError> {
    let run = catch_unwind(AssertUnwindSafe(|| {
        dataset
            .get_many(indices.to_vec())
            .map(|items| batcher.batch(items, device))
    }));
    match run {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(e)) => Err(DataError::Dataset {
            epoch,
            batch,
            message: e.to_string(),
        }),
        Err(payload) => Err(DataError::Panicked {
            epoch,
            batch,
            message: panic_message(payload.as_ref()),
        }),
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// One pass handed to a worker.
struct Job<O> {
    generation: u64,
    epoch: u64,
    batches: Arc<Vec<Vec<usize>>>,
    /// The worker builds batches `start, start + stride, …`.
    start: usize,
    stride: usize,
    out: SyncSender<Result<O, DataError>>,
}

/// Persistent worker threads, reused for every pass.
pub(super) struct WorkerPool<O> {
    commands: Vec<Sender<Job<O>>>,
    handles: Vec<JoinHandle<()>>,
    prefetch: usize,
}

impl<O: Send + 'static> WorkerPool<O> {
    pub(super) fn spawn<I: Send + 'static>(
        num_workers: usize,
        prefetch: usize,
        dataset: Arc<dyn Dataset<I>>,
        batcher: Arc<dyn Batcher<I, O>>,
        device: Device,
        live_generation: Arc<AtomicU64>,
    ) -> Result<Self, DataError> {
        let mut commands = Vec::with_capacity(num_workers);
        let mut handles = Vec::with_capacity(num_workers);
        for w in 0..num_workers {
            let (tx, rx) = mpsc::channel::<Job<O>>();
            let dataset = dataset.clone();
            let batcher = batcher.clone();
            let device = device.clone();
            let live = live_generation.clone();
            let handle = std::thread::Builder::new()
                .name(format!("ddp-data-{w}"))
                .spawn(move || worker_loop(rx, dataset.as_ref(), batcher.as_ref(), &device, &live))
                .map_err(DataError::Spawn)?;
            commands.push(tx);
            handles.push(handle);
        }
        Ok(Self {
            commands,
            handles,
            prefetch,
        })
    }

    /// Hands a pass to every worker; returns the per-worker receivers.
    pub(super) fn start(
        &self,
        generation: u64,
        epoch: u64,
        batches: Arc<Vec<Vec<usize>>>,
        first: usize,
    ) -> Vec<Receiver<Result<O, DataError>>> {
        let stride = self.commands.len();
        self.commands
            .iter()
            .enumerate()
            .map(|(w, command)| {
                let (out, rx) = mpsc::sync_channel(self.prefetch);
                let job = Job {
                    generation,
                    epoch,
                    batches: batches.clone(),
                    start: first + w,
                    stride,
                    out,
                };
                // A dead worker drops the job (and its sender): the iterator then reports
                // `WorkerLost` for that worker's first batch instead of waiting.
                let _ = command.send(job);
                rx
            })
            .collect()
    }
}

impl<O> Drop for WorkerPool<O> {
    fn drop(&mut self) {
        // Closing the command channels ends each worker's loop once its current pass is over;
        // the live generation was bumped by the loader's drop, so a pass in progress stops
        // after the batch at hand. The threads are detached rather than joined: a worker may be
        // blocked handing a batch to an iterator that outlives the loader, and joining it here
        // could deadlock the thread that holds that iterator.
        self.commands.clear();
        self.handles.clear();
    }
}

fn worker_loop<I, O>(
    jobs: Receiver<Job<O>>,
    dataset: &dyn Dataset<I>,
    batcher: &dyn Batcher<I, O>,
    device: &Device,
    live_generation: &AtomicU64,
) {
    while let Ok(job) = jobs.recv() {
        let mut k = job.start;
        while k < job.batches.len() {
            if live_generation.load(Ordering::SeqCst) != job.generation {
                break; // superseded by a newer pass
            }
            let result = build_batch(dataset, batcher, &job.batches[k], device, job.epoch, k);
            let failed = result.is_err();
            if job.out.send(result).is_err() || failed {
                break; // the consumer is gone, or the pass ends at this error
            }
            k += job.stride;
        }
    }
}
