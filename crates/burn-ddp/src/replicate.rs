//! Model replication at start-up: check that every rank built the same model, then copy rank
//! 0's parameters and buffers to every rank.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Bool, DType, Int, Shape, Tensor, TensorData};

use crate::comm;
use crate::context::Ddp;
use crate::error::{DdpError, Result};
use std::hash::Hasher;

use fnv::FnvHasher;

/// What a module tensor is, for the cross-rank comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TensorKind {
    /// A float tensor that requires a gradient (a trainable parameter).
    Param,
    /// A float tensor that requires none (frozen parameter or buffer such as a running mean).
    Buffer,
    /// An integer tensor.
    Int,
    /// A boolean tensor.
    Bool,
}

/// Describes every module tensor in visit order as `path: kind [shape] dtype`.
#[derive(Default)]
struct Describer {
    path: Vec<String>,
    lines: Vec<String>,
}

impl Describer {
    fn push(&mut self, kind: TensorKind, shape: Shape, dtype: DType) {
        let path = if self.path.is_empty() {
            "<root>".to_string()
        } else {
            self.path.join(".")
        };
        let kind = match kind {
            TensorKind::Param => "param",
            TensorKind::Buffer => "buffer",
            TensorKind::Int => "int",
            TensorKind::Bool => "bool",
        };
        self.lines
            .push(format!("`{path}`: {kind} {:?} {dtype:?}", shape.as_slice()));
    }
}

impl ModuleVisitor for Describer {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let kind = if param.is_require_grad() {
            TensorKind::Param
        } else {
            TensorKind::Buffer
        };
        let v = param.val();
        self.push(kind, v.shape(), v.dtype());
    }
    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
        let v = param.val();
        self.push(TensorKind::Int, v.shape(), v.dtype());
    }
    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
        let v = param.val();
        self.push(TensorKind::Bool, v.shape(), v.dtype());
    }
}

/// Describes `module`'s tensors (paths, kinds, shapes, dtypes) in visit order, one line each.
pub(crate) fn describe<M: Module>(module: &M) -> Vec<String> {
    let mut d = Describer::default();
    module.visit(&mut d);
    d.lines
}

/// Concatenates the bytes of every module tensor in visit order (rank 0's payload).
struct Packer {
    bytes: Vec<u8>,
}

impl Packer {
    fn add(&mut self, data: TensorData) {
        self.bytes.extend_from_slice(data.as_bytes());
    }
}

impl ModuleVisitor for Packer {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.add(param.val().into_data());
    }
    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
        self.add(param.val().into_data());
    }
    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
        self.add(param.val().into_data());
    }
}

/// Replaces every module tensor by the next slice of rank 0's payload.
struct Unpacker<'a> {
    bytes: &'a [u8],
    offset: usize,
}

impl Unpacker<'_> {
    fn take(&mut self, shape: Shape, dtype: DType) -> TensorData {
        let n = shape.num_elements() * dtype.size();
        let end = (self.offset + n).min(self.bytes.len());
        let chunk = self.bytes[self.offset..end].to_vec();
        self.offset = end;
        TensorData::from_bytes_vec(chunk, shape, dtype)
    }
}

impl ModuleMapper for Unpacker<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        let require_grad = tensor.is_require_grad();
        let data = self.take(tensor.shape(), tensor.dtype());
        let mut value = Tensor::<D>::from_data(data, &tensor.device());
        if require_grad {
            value = value.require_grad();
        }
        Param::from_mapped_value(id, value, mapper)
    }
    fn map_int<const D: usize>(&mut self, param: Param<Tensor<D, Int>>) -> Param<Tensor<D, Int>> {
        let (id, tensor, mapper) = param.consume();
        let data = self.take(tensor.shape(), tensor.dtype());
        let value = Tensor::<D, Int>::from_data(data, &tensor.device());
        Param::from_mapped_value(id, value, mapper)
    }
    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<D, Bool>>,
    ) -> Param<Tensor<D, Bool>> {
        let (id, tensor, mapper) = param.consume();
        let data = self.take(tensor.shape(), tensor.dtype());
        let value = Tensor::<D, Bool>::from_data(data, &tensor.device());
        Param::from_mapped_value(id, value, mapper)
    }
}

fn fingerprint(lines: &[String]) -> i64 {
    let mut h = FnvHasher::default();
    h.write(&(lines.len() as u64).to_le_bytes());
    for l in lines {
        h.write(l.as_bytes());
        h.write(&[0]);
    }
    h.finish() as i64
}

/// Finds the first rank and tensor that differ from rank 0 (deterministic on every rank).
fn first_mismatch(all: &[Vec<String>]) -> Option<DdpError> {
    let reference = &all[0];
    for (rank, lines) in all.iter().enumerate().skip(1) {
        let n = reference.len().max(lines.len());
        for index in 0..n {
            let a = reference.get(index);
            let b = lines.get(index);
            if a != b {
                let show = |x: Option<&String>| x.cloned().unwrap_or_else(|| "nothing".into());
                return Some(DdpError::ModelMismatch {
                    rank,
                    index,
                    expected: show(a),
                    found: show(b),
                });
            }
        }
    }
    None
}

impl Ddp {
    /// Makes every rank start from rank 0's model, as PyTorch's `DistributedDataParallel(model)`
    /// does: first checks that all ranks built the same model (tensor paths in visit order,
    /// kinds, shapes and dtypes), then copies rank 0's parameters **and** buffers (BatchNorm
    /// running statistics and any other non-trainable tensors) to every rank.
    ///
    /// Call it once after building (or loading) the model and before the first step. Ranks may
    /// start from different random initialisations; afterwards they are bitwise identical.
    ///
    /// # Errors
    /// [`DdpError::ModelMismatch`] on **every** rank when a rank's model differs, naming the
    /// first differing rank and tensor, e.g. ``tensor #2 is `fc2.weight`: param [64, 10] F32 on
    /// rank 0 but `fc2.weight`: param [64, 12] F32 on rank 1``; a communication error otherwise.
    pub fn replicate_model<M: Module>(&self, model: M) -> Result<M> {
        // A replacement for a lost rank gets its parameters in `Ddp::recover`; the running
        // ranks broadcast nothing now.
        if self.world_size() == 1 || self.is_replacement() {
            return Ok(model);
        }
        // Rank 0 sends its newest running statistics; the others' pending updates must not
        // overwrite what they receive.
        burn_ddp_checkpoint::commit_running_states(&model);
        let lines = describe(&model);
        let fp = fingerprint(&lines);
        let group = self.group().clone();
        let mut g = comm::lock(&group);
        let mut fps = vec![0i64; self.world_size()];
        g.all_gather(&[fp], &mut fps)?;
        if fps.iter().any(|&f| f != fp) {
            let text = lines.join("\n").into_bytes();
            let all = g.all_gather_varlen(&text)?;
            let all: Vec<Vec<String>> = all
                .iter()
                .map(|b| {
                    String::from_utf8_lossy(b)
                        .lines()
                        .map(str::to_string)
                        .collect()
                })
                .collect();
            let err = first_mismatch(&all).unwrap_or_else(|| {
                DdpError::Comm(ddp_comm::CommError::Mismatch(
                    "the ranks' model fingerprints differ, but their descriptions agree".into(),
                ))
            });
            tracing::error!(%err, "model replication refused");
            return Err(err);
        }
        let mut payload = if self.is_main() {
            let mut p = Packer { bytes: Vec::new() };
            model.visit(&mut p);
            p.bytes
        } else {
            Vec::new()
        };
        ddp_comm::doctor::label_next(ddp_comm::doctor::Label::new("rank 0's parameters"));
        g.broadcast_bytes(&mut payload, 0)?;
        drop(g);
        tracing::debug!(
            bytes = payload.len(),
            tensors = lines.len(),
            "model broadcast from rank 0"
        );
        if self.is_main() {
            return Ok(model);
        }
        let mut u = Unpacker {
            bytes: &payload,
            offset: 0,
        };
        let model = model.map(&mut u);
        if u.offset != payload.len() {
            return Err(DdpError::TensorData {
                what: "model broadcast".into(),
                msg: format!(
                    "rank 0 sent {} bytes but this rank's tensors hold {}",
                    payload.len(),
                    u.offset
                ),
            });
        }
        Ok(model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn mismatch_names_first_rank_and_tensor() {
        let a = l(&["`a`: param [2] F32", "`b`: param [3] F32"]);
        let b = l(&["`a`: param [2] F32", "`b`: param [4] F32"]);
        let e = first_mismatch(&[a.clone(), a.clone(), b.clone()]).unwrap();
        let msg = e.to_string();
        assert!(msg.contains("rank 2"), "{msg}");
        assert!(msg.contains("tensor #1"), "{msg}");
        assert!(msg.contains("[4]"), "{msg}");
        let short = l(&["`a`: param [2] F32"]);
        let e = first_mismatch(&[a.clone(), short]).unwrap().to_string();
        assert!(e.contains("nothing"), "{e}");
        assert!(first_mismatch(&[a.clone(), a]).is_none());
    }
}
