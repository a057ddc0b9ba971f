//! Small host transfers of per-channel values (the host-staged exchange).

use burn::backend::{Backend, tensor::FloatTensor};

/// Reads a small backend tensor to the host as f64 (blocking).
pub(crate) fn read_host<B: Backend>(
    t: FloatTensor<B>,
) -> Result<Vec<f64>, super::error::SyncBatchNormError> {
    let err = |what: String| super::error::SyncBatchNormError::Device(what);
    let data = burn::tensor::try_read_sync(B::float_into_data(t))
        .ok_or_else(|| err("this platform can't read tensors synchronously".into()))?
        .map_err(|e| err(format!("reading per-channel values from the device: {e:?}")))?;
    data.convert::<f64>()
        .try_into_vec::<f64>()
        .map_err(|e| err(format!("per-channel values as f64: {e:?}")))
}

/// Uploads a small host buffer as a `shape` tensor of `dtype` on `device`.
pub(crate) fn upload<B: Backend>(
    values: &[f64],
    shape: &[usize],
    dtype: burn::tensor::DType,
    device: &B::Device,
) -> FloatTensor<B> {
    let data = burn::tensor::TensorData::new(values.to_vec(), shape.to_vec()).convert_dtype(dtype);
    B::float_from_data(data, device)
}
