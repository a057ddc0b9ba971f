//! What the rank programs of the integration tests share: deterministic synthetic data, a
//! model's parameters flattened, written for the test to compare, and hashed to check that
//! all ranks hold the same.

use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor, TensorData};
use burn_ddp::Ddp;

#[derive(Default)]
struct Flatten {
    values: Vec<f32>,
}

impl ModuleVisitor for Flatten {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let data = param.val().into_data().convert::<f32>();
        self.values
            .extend(data.as_slice::<f32>().expect("f32 after convert"));
    }
}

/// Every float parameter of `m` in visit order, as f32. BatchNorm's running statistics are
/// read as any visit reads them, without committing Burn's pending `RunningState` update (the
/// value one update older): committing here, after every step, would hide a checkpoint that
/// saves the older value.
pub fn flatten<M: Module>(m: &M) -> Vec<f32> {
    let mut f = Flatten::default();
    m.visit(&mut f);
    f.values
}

/// Per-rank variables `(rank, name, value)` that let `world` NCCL ranks run on this machine:
/// none where it has a GPU per rank (each rank takes GPU `LOCAL_RANK`), else every rank an
/// emulated GPU host of its own ([`ddp_comm::gpu_hosts`], as `ddprun --emulate-gpu-hosts`
/// sets), so that ranks share the GPU(s) through NCCL's socket transport.
#[cfg(feature = "cuda")]
pub fn nccl_rank_env(world: usize) -> Vec<(usize, &'static str, String)> {
    let gpus = ddp_nccl::visible_cuda_devices().unwrap_or(0);
    if gpus >= world {
        return Vec::new();
    }
    (0..world)
        .flat_map(|r| {
            ddp_comm::gpu_hosts::rank_vars(r)
                .into_iter()
                .map(move |(k, v)| (r, k, v))
        })
        .collect()
}

/// Writes `v` as little-endian f32 values (what the tests read back).
///
/// # Errors
/// The write's.
pub fn write_f32(path: &Path, v: &[f32]) -> std::io::Result<()> {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(path, bytes)
}

/// FNV-1a over the bits of `v`.
pub fn hash(v: &[f32]) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in v {
        for b in x.to_bits().to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    }
    h as i64
}

/// Fails unless every rank holds bitwise the same parameters (a collective).
///
/// # Errors
/// A message naming the step and every rank's hash; the all-gather's error.
pub fn check_identical<M: Module>(ddp: &Ddp, model: &M, step: usize) -> Result<(), String> {
    let h = hash(&flatten(model));
    let mut all = vec![0i64; ddp.world_size()];
    ddp.with_group(|pg| pg.all_gather(&[h], &mut all))
        .map_err(|e| e.to_string())?;
    if all.iter().any(|&x| x != h) {
        return Err(format!(
            "ranks differ after step {step}: parameter hashes {all:x?}"
        ));
    }
    Ok(())
}

/// Deterministic sample `i` of a regression task: `IN` features in [0.5, 2.5) (a non-zero
/// mean, so that normalisation layers have work) and `OUT` targets in [-0.5, 0.5).
pub fn sample<const IN: usize, const OUT: usize>(i: usize) -> ([f32; IN], [f32; OUT]) {
    let mut s = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut next = || {
        s ^= s >> 33;
        s = s.wrapping_mul(0xff51_afd7_ed55_8ccd);
        s ^= s >> 33;
        (s >> 40) as f32 / (1u64 << 24) as f32 // [0, 1)
    };
    let mut x = [0.0; IN];
    x.iter_mut().for_each(|v| *v = 2.0 * next() + 0.5);
    let mut y = [0.0; OUT];
    y.iter_mut().for_each(|v| *v = next() - 0.5);
    (x, y)
}

/// The samples `indices` ([`sample`]) as an `[n, IN]` input and an `[n, OUT]` target.
pub fn batch<const IN: usize, const OUT: usize>(
    indices: impl Iterator<Item = usize>,
    device: &Device,
) -> (Tensor<2>, Tensor<2>) {
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    let mut n = 0;
    for i in indices {
        let (x, y) = sample::<IN, OUT>(i);
        xs.extend(x);
        ys.extend(y);
        n += 1;
    }
    (
        Tensor::from_data(TensorData::new(xs, [n, IN]), device),
        Tensor::from_data(TensorData::new(ys, [n, OUT]), device),
    )
}
