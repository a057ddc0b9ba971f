//! What the rank programs of the integration tests share: a model's parameters flattened,
//! written for the test to compare, and hashed to check that all ranks hold the same.

use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn_ddp::Ddp;

#[derive(Default)]
struct Flatten {
    values: Vec<f32>,
    trainable_only: bool,
}

impl ModuleVisitor for Flatten {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.trainable_only && !param.is_require_grad() {
            return;
        }
        let data = param.val().into_data().convert::<f32>();
        self.values
            .extend(data.as_slice::<f32>().expect("f32 after convert"));
    }
}

/// Every float parameter of `m` in visit order, as f32.
pub fn flatten<M: Module>(m: &M) -> Vec<f32> {
    let mut f = Flatten::default();
    m.visit(&mut f);
    f.values
}

/// The trainable float parameters of `m` in visit order, as f32 (not BatchNorm's running
/// statistics).
pub fn flatten_trainable<M: Module>(m: &M) -> Vec<f32> {
    let mut f = Flatten {
        trainable_only: true,
        ..Flatten::default()
    };
    m.visit(&mut f);
    f.values
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
    ddp.process_group()
        .all_gather(&[h], &mut all)
        .map_err(|e| e.to_string())?;
    if all.iter().any(|&x| x != h) {
        return Err(format!(
            "ranks differ after step {step}: parameter hashes {all:x?}"
        ));
    }
    Ok(())
}
