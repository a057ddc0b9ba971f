//! An MNIST-format (IDX) loader: `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
//! `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte` in one directory (uncompressed).
//!
//! IDX is big-endian: a magic number (`0x00000803` for `u8` images of rank 3, `0x00000801` for
//! `u8` labels of rank 1), then one `u32` per dimension, then the data.

use std::path::{Path, PathBuf};

use super::{DataError, ImageItem, ImageSet};

/// MNIST's pixel mean and standard deviation (of `pixel / 255`), used to standardise inputs.
const MEAN: f32 = 0.1307;
const STD: f32 = 0.3081;

/// Images and labels read from a pair of IDX files.
#[derive(Debug, Clone)]
pub struct IdxImages {
    pixels: Vec<u8>,
    labels: Vec<u8>,
    rows: usize,
    cols: usize,
    num_classes: usize,
}

/// The file names of one split.
#[derive(Debug, Clone, Copy)]
pub enum MnistSplit {
    /// `train-*`
    Train,
    /// `t10k-*`
    Test,
}

impl MnistSplit {
    fn files(self) -> (&'static str, &'static str) {
        match self {
            MnistSplit::Train => ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
            MnistSplit::Test => ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
        }
    }
}

impl IdxImages {
    /// Loads one split from the MNIST directory `dir`.
    pub fn load_split(dir: &Path, split: MnistSplit) -> Result<Self, DataError> {
        let (images, labels) = split.files();
        Self::load(&dir.join(images), &dir.join(labels))
    }

    /// Loads an image file and its label file.
    pub fn load(images: &Path, labels: &Path) -> Result<Self, DataError> {
        let img = read(images)?;
        let lab = read(labels)?;
        let (idims, ipix) = parse(images, &img, 3)?;
        let (ldims, lvals) = parse(labels, &lab, 1)?;
        let (n, rows, cols) = (idims[0], idims[1], idims[2]);
        if ldims[0] != n {
            return Err(DataError::Idx {
                path: labels.to_path_buf(),
                reason: format!("{} labels for {n} images", ldims[0]),
            });
        }
        if rows == 0 || cols == 0 {
            return Err(DataError::Idx {
                path: images.to_path_buf(),
                reason: format!("images of size {rows}×{cols}"),
            });
        }
        let num_classes = lvals.iter().copied().max().map_or(0, |m| m as usize + 1);
        Ok(Self {
            pixels: ipix.to_vec(),
            labels: lvals.to_vec(),
            rows,
            cols,
            num_classes,
        })
    }

    /// Number of distinct classes implied by the labels (max label + 1).
    pub fn label_classes(&self) -> usize {
        self.num_classes
    }
}

impl ImageSet for IdxImages {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    fn num_classes(&self) -> usize {
        // MNIST and its clones have ten classes; a file with higher labels widens the model.
        self.num_classes.max(10)
    }

    fn item(&self, index: usize) -> ImageItem {
        let n = self.rows * self.cols;
        let raw = &self.pixels[index * n..(index + 1) * n];
        ImageItem {
            pixels: raw
                .iter()
                .map(|&p| (p as f32 / 255.0 - MEAN) / STD)
                .collect(),
            label: self.labels[index] as usize,
        }
    }
}

/// Reads an IDX file, or the gzipped `PATH.gz` next to it (MNIST is distributed gzipped) when
/// `PATH` itself is missing.
fn read(path: &Path) -> Result<Vec<u8>, DataError> {
    let gz = PathBuf::from(format!("{}.gz", path.display()));
    if !path.exists() && gz.exists() {
        return read_gz(&gz);
    }
    std::fs::read(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        hint: String::new(),
        source,
    })
}

fn read_gz(path: &Path) -> Result<Vec<u8>, DataError> {
    use std::io::Read;
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        hint: " (a gzipped IDX file)".into(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(std::io::BufReader::new(file))
        .read_to_end(&mut bytes)
        .map_err(io)?;
    Ok(bytes)
}

/// Checks the header of an IDX file of unsigned bytes with `rank` dimensions and returns the
/// dimensions and the data.
fn parse<'a>(
    path: &Path,
    bytes: &'a [u8],
    rank: usize,
) -> Result<(Vec<usize>, &'a [u8]), DataError> {
    let err = |reason: String| DataError::Idx {
        path: path.to_path_buf(),
        reason,
    };
    let header = 4 + 4 * rank;
    if bytes.len() < 4 {
        return Err(err(format!(
            "{} bytes, shorter than the header",
            bytes.len()
        )));
    }
    let magic = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    let expected = 0x0800 | rank as u32;
    if magic != expected {
        return Err(err(format!(
            "magic number {magic:#010x}, expected {expected:#010x} (unsigned bytes, {rank} dimensions)"
        )));
    }
    if bytes.len() < header {
        return Err(err(format!(
            "{} bytes, shorter than the header",
            bytes.len()
        )));
    }
    let dims: Vec<usize> = (0..rank)
        .map(|d| {
            let o = 4 + 4 * d;
            u32::from_be_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]) as usize
        })
        .collect();
    let want = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let data = &bytes[header..];
    match want {
        Some(w) if w == data.len() => Ok((dims, data)),
        _ => Err(err(format!(
            "dimensions {dims:?} need {} data bytes, file has {}",
            want.map_or("too many".into(), |w| w.to_string()),
            data.len()
        ))),
    }
}

/// Writes an IDX file of unsigned bytes (used by tests and handy for making small datasets).
pub fn write_idx(path: &Path, dims: &[usize], data: &[u8]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(4 + 4 * dims.len() + data.len());
    out.extend_from_slice(&(0x0800u32 | dims.len() as u32).to_be_bytes());
    for &d in dims {
        out.extend_from_slice(&(d as u32).to_be_bytes());
    }
    out.extend_from_slice(data);
    std::fs::write(path, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_split(dir: &Path, split: MnistSplit, n: usize) {
        let (im, lb) = split.files();
        let pixels: Vec<u8> = (0..n * 4 * 3).map(|i| (i * 7 % 256) as u8).collect();
        let labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
        write_idx(&dir.join(im), &[n, 4, 3], &pixels).unwrap();
        write_idx(&dir.join(lb), &[n], &labels).unwrap();
    }

    #[test]
    fn reads_what_write_idx_wrote() {
        let dir = tempfile::tempdir().unwrap();
        write_split(dir.path(), MnistSplit::Train, 12);
        let ds = IdxImages::load_split(dir.path(), MnistSplit::Train).unwrap();
        assert_eq!(ds.len(), 12);
        assert_eq!(ds.dims(), (4, 3));
        assert_eq!(ds.label_classes(), 10);
        let it = ds.item(5);
        assert_eq!(it.label, 5);
        let p0 = ((5 * 12) * 7 % 256) as f32;
        assert!((it.pixels[0] - (p0 / 255.0 - MEAN) / STD).abs() < 1e-6);
        assert_eq!(it.pixels.len(), 12);
    }

    #[test]
    fn reads_gzipped_files_as_mnist_is_distributed() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        write_split(dir.path(), MnistSplit::Test, 7);
        let plain = IdxImages::load_split(dir.path(), MnistSplit::Test).unwrap();
        let (im, lb) = MnistSplit::Test.files();
        for name in [im, lb] {
            let path = dir.path().join(name);
            let mut gz = flate2::write::GzEncoder::new(
                std::fs::File::create(dir.path().join(format!("{name}.gz"))).unwrap(),
                flate2::Compression::default(),
            );
            gz.write_all(&std::fs::read(&path).unwrap()).unwrap();
            gz.finish().unwrap();
            std::fs::remove_file(path).unwrap();
        }
        let gzipped = IdxImages::load_split(dir.path(), MnistSplit::Test).unwrap();
        assert_eq!(gzipped.len(), 7);
        assert_eq!(gzipped.item(3), plain.item(3));
        // A corrupt .gz is a clear error naming it.
        std::fs::write(dir.path().join(format!("{im}.gz")), b"not gzip").unwrap();
        let e = IdxImages::load_split(dir.path(), MnistSplit::Test).unwrap_err();
        assert!(e.to_string().contains(&format!("{im}.gz")), "{e}");
    }

    #[test]
    fn bad_files_give_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        // Missing file.
        let e = IdxImages::load_split(p, MnistSplit::Test).unwrap_err();
        assert!(e.to_string().contains("t10k-images-idx3-ubyte"), "{e}");
        // Wrong magic (labels file given as images).
        write_idx(&p.join("a"), &[3], &[1, 2, 3]).unwrap();
        write_idx(&p.join("b"), &[3], &[1, 2, 3]).unwrap();
        let e = IdxImages::load(&p.join("a"), &p.join("b")).unwrap_err();
        assert!(e.to_string().contains("magic number"), "{e}");
        // Truncated data.
        write_idx(&p.join("c"), &[2, 2, 2], &[0; 7]).unwrap();
        let e = IdxImages::load(&p.join("c"), &p.join("b")).unwrap_err();
        assert!(e.to_string().contains("need 8 data bytes"), "{e}");
        // Label count mismatch.
        write_idx(&p.join("d"), &[2, 2, 2], &[0; 8]).unwrap();
        let e = IdxImages::load(&p.join("d"), &p.join("b")).unwrap_err();
        assert!(e.to_string().contains("3 labels for 2 images"), "{e}");
        // Short header.
        std::fs::write(p.join("e"), [0u8, 0, 8]).unwrap();
        let e = IdxImages::load(&p.join("e"), &p.join("b")).unwrap_err();
        assert!(e.to_string().contains("shorter than the header"), "{e}");
    }
}
