//! ResNet-18 in its CIFAR layout, generic over the normalisation layer ([`NormLayer`]).
//!
//! The layout of the usual CIFAR ResNet-18 in PyTorch (and of `scripts/resnet18_torch.py`,
//! which builds the same network): a 3×3 stem convolution of stride 1 (no 7×7 convolution, no
//! max-pool), four stages of two basic blocks with 64, 128, 256 and 512 channels (the first
//! block of stages 2–4 halves the spatial size with stride 2 and carries a 1×1 projection
//! shortcut), global average pooling and one linear layer. Convolutions have no bias (the norm
//! layer's β plays it); the linear layer has one. For 3 input channels and 10 classes that is
//! 11,173,962 trainable parameters, PyTorch's count; the norm layers' running statistics are
//! buffers, not parameters, in both frameworks' counts.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::norm::NormLayer;

/// The shape of a CIFAR-layout ResNet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResNetConfig {
    /// Channels of the input images (3 for CIFAR, 1 for train-cnn's grey images).
    pub in_channels: usize,
    /// Output channels of each stage; the first stage keeps the stem's width.
    pub widths: Vec<usize>,
    /// Basic blocks per stage.
    pub blocks_per_stage: usize,
    /// Number of classes.
    pub num_classes: usize,
}

impl ResNetConfig {
    /// ResNet-18: stages of 64, 128, 256 and 512 channels, two basic blocks each.
    pub fn resnet18(in_channels: usize, num_classes: usize) -> Self {
        Self {
            in_channels,
            widths: vec![64, 128, 256, 512],
            blocks_per_stage: 2,
            num_classes,
        }
    }

    /// Checks the shape describes a network.
    pub fn validate(&self) -> Result<(), String> {
        if self.in_channels == 0 {
            return Err("the ResNet needs at least one input channel".into());
        }
        if self.widths.is_empty() || self.widths.contains(&0) || self.blocks_per_stage == 0 {
            return Err(format!(
                "a ResNet of stages {:?} with {} block(s) each is empty",
                self.widths, self.blocks_per_stage
            ));
        }
        if self.num_classes < 2 {
            return Err(format!("{} classes: need at least 2", self.num_classes));
        }
        Ok(())
    }

    /// Builds the network with norm layer `N` on `device`.
    pub fn init<N: NormLayer>(&self, device: &Device) -> ResNet<N> {
        let stem_width = self.widths[0];
        let mut blocks = Vec::with_capacity(self.widths.len() * self.blocks_per_stage);
        let mut in_ch = stem_width;
        for (stage, &width) in self.widths.iter().enumerate() {
            for block in 0..self.blocks_per_stage {
                let stride = if stage > 0 && block == 0 { 2 } else { 1 };
                blocks.push(BasicBlock::new(in_ch, width, stride, device));
                in_ch = width;
            }
        }
        ResNet {
            stem: conv3x3(self.in_channels, stem_width, 1, device),
            stem_norm: N::init(stem_width, device),
            blocks,
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            head: LinearConfig::new(in_ch, self.num_classes).init(device),
        }
    }
}

/// A 3×3 convolution with padding 1 and no bias.
fn conv3x3(in_ch: usize, out_ch: usize, stride: usize, device: &Device) -> Conv2d {
    Conv2dConfig::new([in_ch, out_ch], [3, 3])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .with_bias(false)
        .init(device)
}

/// The projection shortcut of a block that changes the width or the spatial size: a 1×1
/// convolution of the block's stride, then a norm layer.
#[derive(Module, Debug)]
pub struct Projection<N> {
    conv: Conv2d,
    norm: N,
}

/// conv 3×3 → norm → ReLU → conv 3×3 → norm, plus the shortcut, then ReLU.
#[derive(Module, Debug)]
pub struct BasicBlock<N> {
    conv1: Conv2d,
    norm1: N,
    conv2: Conv2d,
    norm2: N,
    /// `None`: the identity.
    shortcut: Option<Projection<N>>,
}

impl<N: NormLayer> BasicBlock<N> {
    fn new(in_ch: usize, out_ch: usize, stride: usize, device: &Device) -> Self {
        let shortcut = (stride != 1 || in_ch != out_ch).then(|| Projection {
            conv: Conv2dConfig::new([in_ch, out_ch], [1, 1])
                .with_stride([stride, stride])
                .with_bias(false)
                .init(device),
            norm: N::init(out_ch, device),
        });
        BasicBlock {
            conv1: conv3x3(in_ch, out_ch, stride, device),
            norm1: N::init(out_ch, device),
            conv2: conv3x3(out_ch, out_ch, 1, device),
            norm2: N::init(out_ch, device),
            shortcut,
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let y = relu(self.norm1.forward(self.conv1.forward(x.clone())));
        let y = self.norm2.forward(self.conv2.forward(y));
        let skip = match &self.shortcut {
            Some(p) => p.norm.forward(p.conv.forward(x)),
            None => x,
        };
        relu(y + skip)
    }
}

/// The CIFAR-layout ResNet: stem, basic blocks, global average pooling, linear classifier.
#[derive(Module, Debug)]
pub struct ResNet<N> {
    stem: Conv2d,
    stem_norm: N,
    blocks: Vec<BasicBlock<N>>,
    pool: AdaptiveAvgPool2d,
    head: Linear,
}

impl<N: NormLayer> ResNet<N> {
    /// Logits `[batch, classes]` for images `[batch, in_channels, rows, cols]`.
    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = relu(self.stem_norm.forward(self.stem.forward(images)));
        let x = self.blocks.iter().fold(x, |x, b| b.forward(x));
        self.head.forward(self.pool.forward(x).flatten(1, 3))
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::BatchNorm;
    use burn_ddp::sync_batch_norm::SyncBatchNorm;

    use super::*;
    use crate::params::trainable_params;

    /// PyTorch's count for its CIFAR ResNet-18 (3 input channels, 10 classes);
    /// `scripts/resnet18_torch.py --count-params` prints the same number (checked by
    /// [`the_torch_script_builds_the_same_parameter_count`] where torch is installed).
    const TORCH_RESNET18_PARAMS: usize = 11_173_962;

    #[test]
    fn resnet18_has_pytorchs_parameter_count() {
        let device = Device::flex();
        let cfg = ResNetConfig::resnet18(3, 10);
        let bn: ResNet<BatchNorm> = cfg.init(&device);
        assert_eq!(trainable_params(&bn), TORCH_RESNET18_PARAMS);
        let sync: ResNet<SyncBatchNorm> = cfg.init(&device);
        assert_eq!(trainable_params(&sync), TORCH_RESNET18_PARAMS);
        // 20 norm layers (stem, 16 in the blocks, 3 shortcuts) of 64..512 channels hold running
        // means and variances besides: 2 × 4800 buffer values.
        assert_eq!(bn.num_params(), TORCH_RESNET18_PARAMS + 2 * 4800);
    }

    /// The PyTorch side of `cargo xtask bench resnet` builds a network with Burn's count.
    #[test]
    #[ignore = "needs PyTorch: python3 with torch, or DDP_TORCH_DIR (cargo xtask bench resnet installs it there)"]
    fn the_torch_script_builds_the_same_parameter_count() {
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../scripts/resnet18_torch.py");
        let mut python = std::process::Command::new("python3");
        if let Some(dir) = std::env::var_os("DDP_TORCH_DIR") {
            python.env("PYTHONPATH", dir);
        }
        let out = python
            .arg(&script)
            .arg("--count-params")
            .output()
            .expect("python3 runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let burn: ResNet<BatchNorm> = ResNetConfig::resnet18(3, 10).init(&Device::flex());
        let want = format!("PARAMS {}", trainable_params(&burn));
        assert!(
            out.status.success() && stdout.contains(&want),
            "{want} expected; {}: {stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn a_narrow_resnet_classifies_grey_and_colour_images() {
        let device = Device::flex();
        for in_channels in [1, 3] {
            let cfg = ResNetConfig {
                widths: vec![4, 8, 8, 16],
                ..ResNetConfig::resnet18(in_channels, 10)
            };
            let model: ResNet<BatchNorm> = cfg.init(&device);
            let x = Tensor::<4>::ones([2, in_channels, 28, 28], &device);
            assert_eq!(model.forward(x).dims(), [2, 10]);
        }
    }

    #[test]
    fn empty_or_degenerate_shapes_are_rejected() {
        assert!(ResNetConfig::resnet18(3, 10).validate().is_ok());
        assert!(ResNetConfig::resnet18(0, 10).validate().is_err());
        assert!(ResNetConfig::resnet18(3, 1).validate().is_err());
        let empty = ResNetConfig {
            widths: vec![],
            ..ResNetConfig::resnet18(3, 10)
        };
        assert!(empty.validate().is_err());
    }
}
