//! The GPU check's first row (`gpu-check run`, about 20 s): a handful of Burn kernels on CUDA
//! device 0 against the same operations on the CPU — one element-wise, one reduction, one
//! exp/log (libdevice) and one f16/bf16 kernel — so that a machine whose CUDA path is broken
//! says so before the long rows. `#[ignore]`d: it needs a GPU.

use burn::tensor::{DType, Device, Tensor, TensorData};

/// Values with a non-zero mean and both signs.
fn input(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 % 1000) as f32 / 250.0 - 1.5) + 0.25)
        .collect()
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32 data")
}

/// The largest error of `got` against `want`, relative to max(|want|, 1).
fn max_rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / w.abs().max(1.0))
        .fold(0.0, f32::max)
}

/// Runs the four kernels on `device`: (element-wise, row sums, exp/log, f16, bf16).
fn kernels(device: &Device) -> [Vec<f32>; 5] {
    let (rows, cols) = (64, 257);
    let x = Tensor::<2>::from_data(TensorData::new(input(rows * cols), [rows, cols]), device);
    let elementwise = values(x.clone() * 2.5 + 1.0);
    let sums = values(x.clone().sum_dim(1));
    let exp_log = values((x.clone().abs() + 1.0).log() + (x.clone() * 0.5).exp());
    let half = |dtype: DType| {
        let h: Tensor<2> = x.clone().cast(dtype) * 3.0 + 0.5;
        values(h.cast(DType::F32))
    };
    [
        elementwise,
        sums,
        exp_log,
        half(DType::F16),
        half(DType::BF16),
    ]
}

#[test]
#[ignore = "needs CUDA"]
fn cuda_smoke_kernels_match_the_cpu() {
    let libdevice = ddp_nccl::cuda_toolkit::prepare_libdevice()
        .unwrap_or_else(|e| panic!("the exp/log kernel needs libdevice: {e}"));
    let cuda = kernels(&Device::cuda(0));
    let cpu = kernels(&Device::flex());
    let names = ["element-wise", "sum", "exp/log", "f16", "bf16"];
    // f32 kernels agree up to summation order; 16-bit ones within one rounding of the result.
    let tolerances = [1e-6, 1e-5, 1e-5, 2f32.powi(-10), 2f32.powi(-7)];
    let mut errs = Vec::new();
    for ((name, tol), (got, want)) in names.iter().zip(tolerances).zip(cuda.iter().zip(&cpu)) {
        let err = max_rel_err(got, want);
        assert!(
            err <= tol,
            "{name}: CUDA vs CPU relative error {err:e} > {tol:e}"
        );
        errs.push(format!("{name} {err:.1e}"));
    }
    println!(
        "OUTCOME CUDA smoke: element-wise, sum, exp/log (libdevice {}), f16, bf16 match the CPU \
         (max rel. err. {})",
        libdevice.file.display(),
        errs.join(", ")
    );
}
