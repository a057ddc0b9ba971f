//! The networks train-cnn trains ([`Net`], chosen by [`ModelConfig`]): the small CNN of this
//! module, conv blocks (conv 3×3 → norm → ReLU → max-pool 2×2) then a linear classifier, and
//! ResNet-18 in its CIFAR layout ([`crate::resnet`]).
//!
//! Both are generic over their normalisation layer ([`NormLayer`], module [`crate::norm`]), so
//! the same code builds them with Burn's `BatchNorm` (per-rank statistics) or with burn-ddp's
//! `SyncBatchNorm` (statistics over all ranks), whose records load into each other.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use serde::{Deserialize, Serialize};

pub use crate::norm::NormLayer;
pub use crate::params::{parameter_values, trainable_params};
use crate::resnet::{ResNet, ResNetConfig};

/// The shape of the small CNN.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CnnConfig {
    /// Output channels of each conv block (3–4 blocks is the intended size).
    pub channels: Vec<usize>,
    /// Input image rows.
    pub rows: usize,
    /// Input image columns.
    pub cols: usize,
    /// Number of classes.
    pub num_classes: usize,
}

impl CnnConfig {
    /// The default network for 28×28 inputs and ten classes: blocks of 16, 32 and 32 channels.
    pub fn small(rows: usize, cols: usize, num_classes: usize) -> Self {
        Self {
            channels: vec![16, 32, 32],
            rows,
            cols,
            num_classes,
        }
    }

    /// Spatial size after the conv blocks (each halves it, rounding down).
    pub fn feature_dims(&self) -> (usize, usize) {
        self.channels
            .iter()
            .fold((self.rows, self.cols), |(r, c), _| (r / 2, c / 2))
    }

    /// Checks that the input survives every pooling step.
    pub fn validate(&self) -> Result<(), String> {
        let (r, c) = self.feature_dims();
        if self.channels.is_empty() {
            return Err("the network needs at least one conv block".into());
        }
        if r == 0 || c == 0 {
            return Err(format!(
                "{}×{} images are too small for {} pooling blocks",
                self.rows,
                self.cols,
                self.channels.len()
            ));
        }
        if self.num_classes < 2 {
            return Err(format!("{} classes: need at least 2", self.num_classes));
        }
        Ok(())
    }

    /// Builds the network with norm layer `N` on `device`.
    pub fn init<N: NormLayer>(&self, device: &Device) -> Cnn<N> {
        let mut blocks = Vec::with_capacity(self.channels.len());
        let mut in_ch = 1;
        for &out in &self.channels {
            blocks.push(ConvBlock {
                conv: Conv2dConfig::new([in_ch, out], [3, 3])
                    .with_padding(PaddingConfig2d::Same)
                    .with_bias(false) // the norm layer's beta plays the bias
                    .init(device),
                norm: N::init(out, device),
                pool: MaxPool2dConfig::new([2, 2]).init(),
            });
            in_ch = out;
        }
        let (r, c) = self.feature_dims();
        Cnn {
            blocks,
            head: LinearConfig::new(in_ch * r * c, self.num_classes).init(device),
        }
    }
}

/// Which network to train (`--model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ModelKind {
    /// The small CNN ([`CnnConfig`], `--channels`).
    #[default]
    Cnn,
    /// ResNet-18 in its CIFAR layout ([`ResNetConfig::resnet18`]).
    Resnet18,
}

impl ModelKind {
    /// The name `--model` takes.
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Cnn => "cnn",
            ModelKind::Resnet18 => "resnet18",
        }
    }
}

/// The shape of either network. Serialised without a tag, so the checkpoints written before
/// the ResNet existed (a bare [`CnnConfig`]) still read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ModelConfig {
    /// The small CNN.
    Cnn(CnnConfig),
    /// A CIFAR-layout ResNet.
    ResNet(ResNetConfig),
}

impl ModelConfig {
    /// The network `kind` for `channels × rows × cols` images of `num_classes` classes;
    /// `cnn_channels` are the CNN's block widths (unused by the ResNet).
    pub fn new(
        kind: ModelKind,
        cnn_channels: &[usize],
        (channels, rows, cols): (usize, usize, usize),
        num_classes: usize,
    ) -> Self {
        match kind {
            ModelKind::Cnn => ModelConfig::Cnn(CnnConfig {
                channels: cnn_channels.to_vec(),
                rows,
                cols,
                num_classes,
            }),
            ModelKind::Resnet18 => {
                ModelConfig::ResNet(ResNetConfig::resnet18(channels, num_classes))
            }
        }
    }

    /// Checks that the network can be built.
    pub fn validate(&self) -> Result<(), String> {
        match self {
            ModelConfig::Cnn(c) => c.validate(),
            ModelConfig::ResNet(c) => c.validate(),
        }
    }

    /// Builds the network with norm layer `N` on `device`.
    pub fn init<N: NormLayer>(&self, device: &Device) -> Net<N> {
        match self {
            ModelConfig::Cnn(c) => Net::Cnn(c.init(device)),
            ModelConfig::ResNet(c) => Net::ResNet(c.init(device)),
        }
    }
}

impl std::fmt::Display for ModelConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelConfig::Cnn(c) => write!(
                f,
                "a CNN of blocks {:?} for {}×{} images and {} classes (--model cnn --channels)",
                c.channels, c.rows, c.cols, c.num_classes
            ),
            ModelConfig::ResNet(c) => write!(
                f,
                "a ResNet of stages {:?} × {} blocks for {} input channel(s) and {} classes \
                 (--model resnet18)",
                c.widths, c.blocks_per_stage, c.in_channels, c.num_classes
            ),
        }
    }
}

/// Either network, one module type for the training loop and the checkpoints.
// One value per process: the ResNet's size is no cost worth a box, which Burn's derive would
// have to see through.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Net<N> {
    /// The small CNN.
    Cnn(Cnn<N>),
    /// A CIFAR-layout ResNet.
    ResNet(ResNet<N>),
}

impl<N: NormLayer> Net<N> {
    /// Logits `[batch, classes]` for images `[batch, channels, rows, cols]`.
    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        match self {
            Net::Cnn(m) => m.forward(images),
            Net::ResNet(m) => m.forward(images),
        }
    }
}

/// conv 3×3 → norm → ReLU → max-pool 2×2.
#[derive(Module, Debug)]
pub struct ConvBlock<N> {
    conv: Conv2d,
    norm: N,
    pool: MaxPool2d,
}

impl<N: NormLayer> ConvBlock<N> {
    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        self.pool
            .forward(relu(self.norm.forward(self.conv.forward(x))))
    }
}

/// The classifier: conv blocks then a linear layer on the flattened features.
#[derive(Module, Debug)]
pub struct Cnn<N> {
    blocks: Vec<ConvBlock<N>>,
    head: Linear,
}

impl<N: NormLayer> Cnn<N> {
    /// Logits `[batch, classes]` for images `[batch, 1, rows, cols]`.
    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = self.blocks.iter().fold(images, |x, b| b.forward(x));
        self.head.forward(x.flatten(1, 3))
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::BatchNorm;

    use super::*;

    #[test]
    fn shapes_flow_through_the_network() {
        let device = Device::flex();
        let cfg = CnnConfig::small(28, 28, 10);
        assert_eq!(cfg.feature_dims(), (3, 3));
        let model: Cnn<BatchNorm> = cfg.init(&device);
        let x = Tensor::<4>::zeros([2, 1, 28, 28], &device);
        assert_eq!(model.forward(x).dims(), [2, 10]);
        // conv weights (no bias) + 4 vectors per norm (γ, β and the running statistics) + head.
        let expected = 16 * 9 + 32 * 16 * 9 + 32 * 32 * 9 + 4 * (16 + 32 + 32) + 32 * 9 * 10 + 10;
        assert_eq!(model.num_params(), expected);
        assert_eq!(trainable_params(&model), expected - 2 * (16 + 32 + 32));
    }

    #[test]
    fn checkpoints_written_before_the_resnet_still_name_their_cnn() {
        let old = r#"{"channels":[16,32,32],"rows":28,"cols":28,"num_classes":10}"#;
        let read: ModelConfig = serde_json::from_str(old).unwrap();
        assert_eq!(read, ModelConfig::Cnn(CnnConfig::small(28, 28, 10)));
        let resnet = ModelConfig::new(ModelKind::Resnet18, &[], (1, 28, 28), 10);
        let json = serde_json::to_string(&resnet).unwrap();
        assert_eq!(serde_json::from_str::<ModelConfig>(&json).unwrap(), resnet);
    }

    #[test]
    fn bad_shapes_are_rejected() {
        assert!(CnnConfig::small(4, 28, 10).validate().is_err());
        assert!(CnnConfig::small(28, 28, 1).validate().is_err());
        assert!(CnnConfig::small(8, 8, 10).validate().is_ok());
    }
}
