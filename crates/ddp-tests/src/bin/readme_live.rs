//! The README's adoption loop with live recovery, word for word below this comment (a test in
//! `tests/live_training.rs` keeps the two equal), to run under `ddprun --recover live` with a
//! rank killed: it must print the losses of the job never killed.

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use burn_ddp::checkpoint::Progress;
use burn_ddp::data::{LoaderState, ShardedDataLoaderBuilder};

#[derive(Clone)]
struct Rows;
impl Batcher<[f32; 9], (Tensor<2>, Tensor<2>)> for Rows {
    fn batch(&self, items: Vec<[f32; 9]>, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let n = items.len();
        let t = Tensor::<2>::from_data(TensorData::new(items.concat(), [n, 9]), device);
        (t.clone().slice([0..n, 0..8]), t.slice([0..n, 8..9]))
    }
}

fn main() -> Result<(), burn_ddp::DdpError> {
    // Declares the loop recoverable (a lost rank replaced under `ddprun --recover live`).
    let ddp = burn_ddp::Ddp::builder().live_recovery().init()?;
    let device = ddp.device().clone().autodiff();
    device.seed(7); // the same weights in every run of the job
    let model = ddp.replicate_model(LinearConfig::new(8, 1).init(&device))?;
    let optim = burn_ddp::DdpOptimizer::new(&ddp, AdamConfig::new().init());
    let data = InMemDataset::new((0..65536).map(|i| [i as f32 / 65536.0; 9]).collect());
    let loader = ShardedDataLoaderBuilder::new(Rows)
        .batch_size(32)
        .build_for(data, &ddp)?;
    // Model, optimizer, progress and the state (this epoch's loss sums over all ranks):
    // a replacement takes the survivors' here, and its loader their position.
    let mut live = ddp
        .live(model, optim)
        .start(Progress::default(), [0.0f64; 2])?;
    if let Some(at) = live.progress().loader {
        loader.load_state(at);
    }
    while live.progress().epochs_done < 3 {
        for batch in loader.batches() {
            let (x, y) = batch?;
            let n = x.dims()[0] as f64;
            // Forward, backward, the sums over the ranks, the sync, the update: redone after a
            // lost rank; `None` when a survivor had finished the step (its state counts it).
            let summed = live.step(1e-3, |model: &Linear, _| {
                let loss = (model.forward(x.clone()) - y.clone()).powi_scalar(2).mean();
                let sum = loss.clone().into_scalar::<f32>() as f64 * n;
                let grads = GradientsParams::from_grads(loss.backward(), model);
                (grads, [sum, n])
            })?;
            if let Some([sum, n]) = summed {
                let epoch = live.state_mut();
                (epoch[0], epoch[1]) = (epoch[0] + sum, epoch[1] + n);
            }
            live.progress_mut().loader = Some(loader.state());
        }
        let [sum, n] = std::mem::take(live.state_mut());
        let progress = live.progress_mut();
        progress.epochs_done += 1;
        progress.loader = Some(LoaderState::at_epoch(progress.epochs_done));
        if ddp.is_main() {
            println!("epoch {}: loss {}", progress.epochs_done, sum / n);
        }
    }
    Ok(())
}
