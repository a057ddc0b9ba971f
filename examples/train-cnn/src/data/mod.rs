//! Image data: the embedded synthetic dataset, the MNIST (IDX) loader, and the batcher that turns
//! items into tensors.

pub mod mnist;
pub mod synthetic;

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::tensor::{Device, Int, Tensor, TensorData};

/// One grayscale image (row-major, `rows × cols` values, already standardised) and its class.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageItem {
    /// Pixel values, row-major.
    pub pixels: Vec<f32>,
    /// Class index.
    pub label: usize,
}

/// A random-access collection of images of one size.
pub trait ImageSet: Send + Sync + std::fmt::Debug {
    /// Number of images.
    fn len(&self) -> usize;
    /// Whether there are no images.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `(rows, cols)` of every image.
    fn dims(&self) -> (usize, usize);
    /// Number of classes the model must output.
    fn num_classes(&self) -> usize;
    /// Image `index` (`index < len()`).
    fn item(&self, index: usize) -> ImageItem;
}

/// An [`ImageSet`] shared between threads, usable as a Burn [`Dataset`] (so Burn's data loaders
/// and burn-ddp's sharded loader accept it).
#[derive(Debug, Clone)]
pub struct Images(pub Arc<dyn ImageSet>);

impl Dataset<ImageItem> for Images {
    fn get(&self, index: usize) -> Result<ImageItem, DatasetError> {
        if index < self.0.len() {
            Ok(self.0.item(index))
        } else {
            Err(DatasetError::new(DataError::OutOfRange {
                index,
                len: self.0.len(),
            }))
        }
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

/// Errors reading or choosing a dataset.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file could not be read.
    #[error("cannot read {path}{hint}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Extra advice, possibly empty.
        hint: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An IDX file is malformed.
    #[error("{path} is not a valid IDX file: {reason}")]
    Idx {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The `--data` argument is not understood.
    #[error("unknown data source {0:?}: use `synthetic` or `mnist:PATH`")]
    Spec(String),
    /// Train and eval images differ in size.
    #[error("train images are {train:?} but eval images are {eval:?}")]
    DimsMismatch {
        /// (rows, cols) of the train split.
        train: (usize, usize),
        /// (rows, cols) of the eval split.
        eval: (usize, usize),
    },
    /// An index past the end of a dataset.
    #[error("index {index} out of range for a dataset of {len} images")]
    OutOfRange {
        /// The index asked for.
        index: usize,
        /// The dataset's length.
        len: usize,
    },
    /// A split holds no image.
    #[error("the {0} split is empty")]
    Empty(&'static str),
}

/// Where the images come from (`--data`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSpec {
    /// The embedded synthetic dataset.
    Synthetic,
    /// An MNIST-format directory.
    Mnist(PathBuf),
}

impl FromStr for DataSpec {
    type Err = DataError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            None if s == "synthetic" => Ok(DataSpec::Synthetic),
            Some(("mnist", p)) if !p.is_empty() => Ok(DataSpec::Mnist(PathBuf::from(p))),
            _ => Err(DataError::Spec(s.to_string())),
        }
    }
}

impl std::fmt::Display for DataSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataSpec::Synthetic => write!(f, "synthetic"),
            DataSpec::Mnist(p) => write!(f, "mnist:{}", p.display()),
        }
    }
}

/// The train and eval splits of a dataset.
#[derive(Debug, Clone)]
pub struct Splits {
    /// Training images.
    pub train: Images,
    /// Evaluation images.
    pub eval: Images,
}

impl Splits {
    /// `(rows, cols)` of the images.
    pub fn dims(&self) -> (usize, usize) {
        self.train.0.dims()
    }

    /// Number of classes.
    pub fn num_classes(&self) -> usize {
        self.train.0.num_classes().max(self.eval.0.num_classes())
    }
}

/// Opens the dataset `spec`. `synthetic_sizes` is `(train, eval)` for the synthetic dataset,
/// generated from `seed`.
pub fn open(
    spec: &DataSpec,
    seed: u64,
    synthetic_sizes: (usize, usize),
) -> Result<Splits, DataError> {
    let (train, eval): (Arc<dyn ImageSet>, Arc<dyn ImageSet>) = match spec {
        DataSpec::Synthetic => (
            Arc::new(synthetic::SyntheticImages::new(
                seed,
                synthetic::Split::Train,
                synthetic_sizes.0,
            )),
            Arc::new(synthetic::SyntheticImages::new(
                seed,
                synthetic::Split::Eval,
                synthetic_sizes.1,
            )),
        ),
        DataSpec::Mnist(dir) => (
            Arc::new(mnist::IdxImages::load_split(dir, mnist::MnistSplit::Train)?),
            Arc::new(mnist::IdxImages::load_split(dir, mnist::MnistSplit::Test)?),
        ),
    };
    if train.dims() != eval.dims() {
        return Err(DataError::DimsMismatch {
            train: train.dims(),
            eval: eval.dims(),
        });
    }
    if train.is_empty() {
        return Err(DataError::Empty("train"));
    }
    if eval.is_empty() {
        return Err(DataError::Empty("eval"));
    }
    Ok(Splits {
        train: Images(train),
        eval: Images(eval),
    })
}

/// Channels of every image train-cnn reads (grey: MNIST and the synthetic set).
pub const CHANNELS: usize = 1;

/// A batch of images `[batch, CHANNELS, rows, cols]` and their classes `[batch]`.
#[derive(Debug, Clone)]
pub struct ImageBatch {
    /// The images.
    pub images: Tensor<4>,
    /// The classes.
    pub targets: Tensor<1, Int>,
}

/// Stacks [`ImageItem`]s of `rows × cols` pixels into an [`ImageBatch`].
#[derive(Debug, Clone, Copy)]
pub struct ImageBatcher {
    /// Rows per image.
    pub rows: usize,
    /// Columns per image.
    pub cols: usize,
}

impl Batcher<ImageItem, ImageBatch> for ImageBatcher {
    fn batch(&self, items: Vec<ImageItem>, device: &Device) -> ImageBatch {
        let n = items.len();
        let per = self.rows * self.cols;
        let mut pixels = Vec::with_capacity(n * per);
        let mut labels = Vec::with_capacity(n);
        for it in items {
            assert_eq!(
                it.pixels.len(),
                per,
                "image of {} pixels, expected {per}",
                it.pixels.len()
            );
            pixels.extend_from_slice(&it.pixels);
            labels.push(it.label as i64);
        }
        ImageBatch {
            images: Tensor::from_data(
                TensorData::new(pixels, [n, CHANNELS, self.rows, self.cols]),
                device,
            ),
            targets: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_spec_parses() {
        assert_eq!(
            "synthetic".parse::<DataSpec>().unwrap(),
            DataSpec::Synthetic
        );
        assert_eq!(
            "mnist:/tmp/m".parse::<DataSpec>().unwrap(),
            DataSpec::Mnist("/tmp/m".into())
        );
        for bad in ["mnist:", "cifar", "", "synthetic:3"] {
            let e = bad.parse::<DataSpec>().unwrap_err();
            assert!(e.to_string().contains("synthetic"), "{e}");
        }
    }

    #[test]
    fn batcher_stacks_items_in_order() {
        let ds = synthetic::SyntheticImages::new(0, synthetic::Split::Train, 10);
        let items: Vec<ImageItem> = (0..3).map(|i| ds.item(i)).collect();
        let device = Device::flex();
        let b = ImageBatcher { rows: 28, cols: 28 }.batch(items.clone(), &device);
        assert_eq!(b.images.dims(), [3, 1, 28, 28]);
        let px: Vec<f32> = b.images.into_data().try_to_vec().unwrap();
        assert_eq!(&px[784..2 * 784], &items[1].pixels[..]);
        let t: Vec<i64> = b.targets.into_data().convert::<i64>().try_to_vec().unwrap();
        assert_eq!(t, vec![0, 1, 2]);
    }

    #[test]
    fn images_is_a_burn_dataset() {
        let splits = open(&DataSpec::Synthetic, 1, (30, 10)).unwrap();
        assert_eq!(splits.train.len(), 30);
        assert_eq!(splits.eval.len(), 10);
        assert!(splits.train.get(29).is_ok());
        let e = splits.train.get(30).unwrap_err();
        assert!(e.to_string().contains("index 30 out of range"), "{e}");
        assert_eq!(splits.dims(), (28, 28));
        assert_eq!(splits.num_classes(), 10);
    }
}
