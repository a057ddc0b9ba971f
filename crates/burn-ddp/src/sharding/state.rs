//! Optimizer states as burnpack bytes, re-keyed, filtered and merged by parameter id.
//!
//! Burn's `ModuleOptimizer` writes its state keyed per parameter: tensors named
//! `"{id}.{field}"` carrying the id, scalars `"{id}.{field}"` and a path entry `"{id}"` in the
//! metadata, where `{id}` is the parameter's `ParamId` in decimal. A sharded rank holds the
//! entries of the parameters it owns; [`transform`] maps each entry's id (or drops the entry)
//! and writes the union of several states, which is how the shards of all ranks become one
//! state in today's format and how a whole state is cut down to one rank's shard.

use std::collections::BTreeMap;

use burn::tensor::Bytes;
use burn_pack::{Reader, Scalar, Writer};

use super::error::ShardingError;

/// The parameter id of a state key `"{id}"` or `"{id}.{field}"`.
fn key_id(key: &str) -> Option<u64> {
    key.split('.').next()?.parse().ok()
}

/// `key` with its id replaced by `id`.
fn rekey(key: &str, id: u64) -> String {
    match key.split_once('.') {
        Some((_, rest)) => format!("{id}.{rest}"),
        None => id.to_string(),
    }
}

/// The union of the states `parts` (burnpack bytes), each entry's id mapped by `map` (`None`
/// drops the entry). Entries without a parameter id are kept as they are. Two parts with an
/// entry of the same name after mapping: the later part's wins (parts of disjoint shards
/// have none).
///
/// # Errors
/// [`ShardingError::State`] when a part is not a burnpack or the result can't be written.
pub(crate) fn transform(
    parts: &[&[u8]],
    map: impl Fn(u64) -> Option<u64>,
) -> Result<Vec<u8>, ShardingError> {
    let bad = |what: &str, e: burn_pack::Error| ShardingError::State(format!("{what}: {e}"));
    let mut tensors = BTreeMap::new();
    let mut scalars: BTreeMap<String, Scalar> = BTreeMap::new();
    let mut metadata: BTreeMap<String, String> = BTreeMap::new();
    for part in parts {
        if part.is_empty() {
            continue;
        }
        let reader = Reader::from_bytes(Bytes::from_bytes_vec(part.to_vec()))
            .map_err(|e| bad("reading a shard", e))?;
        for (k, v) in reader.scalars() {
            match key_id(k) {
                Some(id) => {
                    if let Some(new) = map(id) {
                        scalars.insert(rekey(k, new), *v);
                    }
                }
                None => {
                    scalars.insert(k.clone(), *v);
                }
            }
        }
        for (k, v) in reader.metadata() {
            match key_id(k) {
                Some(id) => {
                    if let Some(new) = map(id) {
                        metadata.insert(rekey(k, new), v.clone());
                    }
                }
                None => {
                    metadata.insert(k.clone(), v.clone());
                }
            }
        }
        for t in reader
            .into_tensors()
            .map_err(|e| bad("reading a shard's tensors", e))?
        {
            let (name, dtype, shape, param_id, bytes) =
                t.into_parts().map_err(|e| bad("reading a tensor", e))?;
            let (name, param_id) = match param_id.or_else(|| key_id(&name)) {
                Some(id) => match map(id) {
                    Some(new) => (rekey(&name, new), Some(new)),
                    None => continue,
                },
                None => (name, None),
            };
            tensors.insert(
                name.clone(),
                burn_pack::Tensor::new(name, dtype, shape, param_id, bytes),
            );
        }
    }
    let mut writer = Writer::new(tensors.into_values().collect());
    for (k, v) in &scalars {
        writer = writer.with_scalar(k, *v);
    }
    for (k, v) in &metadata {
        writer = writer.with_metadata(k, v);
    }
    Ok(writer
        .into_bytes()
        .map_err(|e| bad("writing the state", e))?
        .to_vec())
}

/// The parameter ids that `state` holds entries for.
///
/// # Errors
/// [`ShardingError::State`] when `state` is not a burnpack.
pub(crate) fn ids_in(state: &[u8]) -> Result<std::collections::BTreeSet<u64>, ShardingError> {
    if state.is_empty() {
        return Ok(Default::default());
    }
    let reader = Reader::from_bytes(Bytes::from_bytes_vec(state.to_vec()))
        .map_err(|e| ShardingError::State(format!("reading a state: {e}")))?;
    let mut ids: std::collections::BTreeSet<u64> = reader
        .scalars()
        .keys()
        .chain(reader.metadata().keys())
        .filter_map(|k| key_id(k))
        .collect();
    ids.extend(reader.tensor_names().iter().filter_map(|n| key_id(n)));
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer};
    use burn::tensor::{Device, Distribution, Tensor};

    fn stepped() -> (Linear, ModuleOptimizer) {
        let device = Device::flex().autodiff();
        let model: Linear = LinearConfig::new(3, 2).init(&device);
        let mut optim: ModuleOptimizer = AdamConfig::new().init();
        let x = Tensor::<2>::random([4, 3], Distribution::Default, &device);
        let loss = model.forward(x).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let model = optim.step(0.1, model, grads);
        (model, optim)
    }

    fn ids(model: &Linear) -> Vec<u64> {
        burn::module::list_param_ids(model)
            .iter()
            .map(|i| i.val())
            .collect()
    }

    /// Splitting a state by parameter and merging the halves gives the state back: the merged
    /// bytes load into an optimizer that then steps exactly as the original.
    #[test]
    fn split_and_merged_states_are_the_whole_state() {
        let (model, optim) = stepped();
        let whole = optim.into_bytes().unwrap().to_vec();
        let all = ids(&model);
        assert_eq!(all.len(), 2);
        assert_eq!(ids_in(&whole).unwrap(), all.iter().copied().collect());
        let half = |keep: u64| transform(&[&whole], |id| (id == keep).then_some(id)).unwrap();
        let (a, b) = (half(all[0]), half(all[1]));
        assert_eq!(ids_in(&a).unwrap(), [all[0]].into());
        let merged = transform(&[&a, &b], Some).unwrap();
        assert_eq!(ids_in(&merged).unwrap(), ids_in(&whole).unwrap());
        let restored: ModuleOptimizer = AdamConfig::new().init();
        let mut restored = restored.from_bytes(Bytes::from_bytes_vec(merged)).unwrap();
        let mut original = optim;
        // One more step from the same model with the same batch: bitwise the same result.
        let device = Device::flex().autodiff();
        let x = Tensor::<2>::random([4, 3], Distribution::Default, &device);
        let step = |optim: &mut ModuleOptimizer| {
            let m = model.clone();
            let loss = m.forward(x.clone()).powi_scalar(2).mean();
            let grads = GradientsParams::from_grads(loss.backward(), &m);
            let m = optim.step(0.1, m, grads);
            m.weight.val().into_data().try_to_vec::<f32>().unwrap()
        };
        let (a, b) = (step(&mut original), step(&mut restored));
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "the merged state steps differently: {a:?} vs {b:?}"
        );
    }

    /// Re-keying moves every entry to the new id.
    #[test]
    fn rekeyed_entries_carry_the_new_id() {
        let (model, optim) = stepped();
        let whole = optim.into_bytes().unwrap().to_vec();
        let all = ids(&model);
        let moved = transform(&[&whole], |id| Some(if id == all[0] { 7 } else { id })).unwrap();
        assert_eq!(ids_in(&moved).unwrap(), [7, all[1]].into());
        assert!(transform(&[b"not a burnpack"], Some).is_err());
        assert_eq!(key_id("123.moment_1"), Some(123));
        assert_eq!(rekey("123.moment_1.x", 9), "9.moment_1.x");
        assert_eq!(rekey("123", 9), "9");
    }
}
