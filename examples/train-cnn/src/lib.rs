//! A CNN with BatchNorm trained data-parallel with burn-ddp: the library behind the `train-cnn`
//! rank program (model, data, training loop, metrics, plot, checkpoints), kept in a library so
//! tests reach every part.

pub mod bench;
pub mod checkpoint;
pub mod data;
pub mod metrics;
pub mod model;
pub mod norm;
pub mod params;
pub mod plot;
pub mod resnet;
pub mod rng;
pub mod train;
