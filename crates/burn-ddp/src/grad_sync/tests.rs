//! The whole synchroniser in a world of one (collect, presence, buckets, comm thread,
//! write-back), and the NCCL device path where a GPU is present.

use super::slots::SlotCollector;
use super::*;
use burn::module::{Module, ParamId};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::Distribution;
use burn::tensor::{Device, Tensor};
use ddp_comm::ProcessGroup;
use std::sync::{Arc, Mutex};

#[derive(Module, Debug)]
struct Net {
    a: Linear,
    b: Linear,
    unused: Linear,
    frozen: Linear,
}

impl Net {
    fn new(device: &Device) -> Self {
        Net {
            a: LinearConfig::new(3, 4).init(device),
            b: LinearConfig::new(4, 2).init(device),
            unused: LinearConfig::new(3, 3).init(device),
            frozen: LinearConfig::new(3, 1).init(device).no_grad(),
        }
    }
}

fn grads_of(net: &Net, device: &Device) -> GradientsParams {
    let x = Tensor::<2>::random([5, 3], Distribution::Default, device);
    let loss = net.b.forward(net.a.forward(x.clone())).sum() + net.frozen.forward(x).sum();
    GradientsParams::from_grads(loss.backward(), net)
}

/// Syncs `net`'s gradients in a world of one and checks they come back unchanged: same
/// values and shapes, none for the unused and the frozen layer.
fn round_trip(net: &Net, device: &Device, sync: &mut GradientSynchronizer) {
    let grads = grads_of(net, device);
    let before_a = values::<2>(&grads, net.a.weight.id).unwrap();
    let before_bb = values::<1>(&grads, net.b.bias.as_ref().unwrap().id).unwrap();
    let out = sync.sync(net, grads).unwrap();
    assert_eq!(values::<2>(&out, net.a.weight.id).unwrap(), before_a);
    assert_eq!(
        values::<1>(&out, net.b.bias.as_ref().unwrap().id).unwrap(),
        before_bb
    );
    assert_eq!(
        out.get::<2>(net.a.weight.id).unwrap().shape().as_slice(),
        &[3, 4]
    );
    assert!(
        out.get::<2>(net.unused.weight.id).is_none(),
        "unused stays absent"
    );
    assert!(
        out.get::<2>(net.frozen.weight.id).is_none(),
        "frozen has none"
    );
    assert_eq!(out.len(), 4, "a.w a.b b.w b.b");
}

fn values<const D: usize>(g: &GradientsParams, id: ParamId) -> Option<Vec<f32>> {
    g.get::<D>(id)
        .map(|t| t.into_data().try_to_vec::<f32>().unwrap())
}

/// The whole pipeline (collect, buckets, comm thread, write-back) in a world of one must
/// give back exactly the gradients it got, for every bucket cap.
#[test]
fn full_pipeline_in_a_world_of_one_returns_the_same_gradients() {
    let device = Device::flex().autodiff();
    let net = Net::new(&device);
    let group = Arc::new(Mutex::new(ProcessGroup::single()));
    for (cap, overlap) in [4, 16, 40, 1 << 20]
        .into_iter()
        .flat_map(|c| [(c, true), (c, false)])
    {
        let mut sync = GradientSynchronizer::new(group.clone(), cap).with_overlap(overlap);
        sync.skip_when_alone = false;
        round_trip(&net, &device, &mut sync);
        let st = sync.last_stats();
        assert_eq!(st.elements, 3 * 4 + 4 + 4 * 2 + 2);
        // Sizes in visit order: a.weight 12, a.bias 4, b.weight 8, b.bias 2.
        let expected_buckets = match cap {
            4 | 16 => 4, // caps of 1 and 4 values: every parameter alone
            40 => 3,     // cap 10: [12] [4] [8, 2]
            _ => 1,
        };
        assert_eq!(st.buckets, expected_buckets, "cap {cap}");
    }
}

/// Gradients of 64 Ki values or more are reduced in their own buffers, between packed
/// runs of small ones; the values and shapes must come back unchanged either way.
#[test]
fn large_gradients_reduced_in_place_between_packed_runs() {
    let device = Device::flex().autodiff();
    let a = LinearConfig::new(3, 300).init(&device); // 900 + 300: packed
    let b = LinearConfig::new(300, 300).init(&device); // 90 000: own buffer, then 300
    let net = (a, b);
    let group = Arc::new(Mutex::new(ProcessGroup::single()));
    for (cap, overlap) in [(1 << 10, true), (1 << 30, true), (1 << 30, false)] {
        let x = Tensor::<2>::random([4, 3], Distribution::Default, &device);
        let loss = net.1.forward(net.0.forward(x)).sum();
        let grads = GradientsParams::from_grads(loss.backward(), &net);
        let before = values::<2>(&grads, net.1.weight.id).unwrap();
        let before_bias = values::<1>(&grads, net.0.bias.as_ref().unwrap().id).unwrap();
        let mut sync = GradientSynchronizer::new(group.clone(), cap).with_overlap(overlap);
        sync.skip_when_alone = false;
        let out = sync.sync(&net, grads).unwrap();
        assert_eq!(values::<2>(&out, net.1.weight.id).unwrap(), before);
        assert_eq!(
            values::<1>(&out, net.0.bias.as_ref().unwrap().id).unwrap(),
            before_bias
        );
        assert_eq!(
            out.get::<2>(net.1.weight.id).unwrap().shape().as_slice(),
            &[300, 300]
        );
        assert_eq!(out.len(), 4);
    }
}

/// The presence exchange carries the device-path vote only when asked to, and decodes it
/// as "every rank voted yes".
#[test]
fn presence_exchange_decodes_the_device_vote() {
    let device = Device::flex().autodiff();
    let net = Net::new(&device);
    let mut grads = grads_of(&net, &device);
    let mut collector = SlotCollector {
        grads: &mut grads,
        slots: Vec::new(),
    };
    net.visit(&mut collector);
    let slots = collector.slots;
    let sync = GradientSynchronizer::new(Arc::new(Mutex::new(ProcessGroup::single())), 64);
    for (vote, expected) in [(None, false), (Some(false), false), (Some(true), true)] {
        let p = sync.exchange_presence(&slots, vote).unwrap();
        assert_eq!(p.on_device, expected, "vote {vote:?}");
        assert_eq!(p.present, vec![true, true, true, true, false, false]);
        assert!(!p.any_tcp, "a group of one has no link");
    }
}

/// Deterministic gradients of `net` for `rank` (the same on every call).
fn rank_grads(net: &Net, device: &Device, rank: usize) -> GradientsParams {
    let x = Tensor::<2>::from_floats(
        [
            [0.5, -1.0, 2.0],
            [1.5, 0.25, -0.75],
            [-2.0, 1.0, 0.125],
            [0.0, 3.0, -1.5],
            [1.0, 1.0, 1.0],
        ],
        device,
    ) * (rank as f32 + 1.0);
    let loss = net.b.forward(net.a.forward(x.clone())).sum() + net.frozen.forward(x).sum();
    GradientsParams::from_grads(loss.backward(), net)
}

/// The device path (buckets packed, reduced and sliced back as tensors) on two CPU ranks,
/// through the host-staged stand-in for NCCL: the same bits as the host path, for one bucket
/// per slot and for one bucket for all.
#[test]
fn the_device_path_equals_the_host_path_on_two_ranks() {
    let results = crate::test_ranks::run_ranks(2, |group, rank| {
        let device = Device::flex().autodiff();
        let net = Net::new(&device);
        let ids = [
            (net.a.weight.id, 2),
            (net.b.weight.id, 2),
            (net.b.bias.as_ref().unwrap().id, 1),
        ];
        for cap in [4, 1 << 20] {
            let mut host = GradientSynchronizer::new(group.clone(), cap).with_overlap(false);
            // Each rank builds its own net here: the gradients are what is compared.
            host.check_replicas = false;
            let on_host = host.sync(&net, rank_grads(&net, &device, rank)).unwrap();
            assert!(!host.last_sync_on_device());
            let mut dev = GradientSynchronizer::new(group.clone(), cap)
                .with_device_comm(Some(crate::cuda::DeviceComm::host_staged(group.clone())));
            dev.check_replicas = false;
            let on_dev = dev.sync(&net, rank_grads(&net, &device, rank)).unwrap();
            assert!(dev.last_sync_on_device(), "cap {cap}: took the host path");
            for (id, dims) in ids {
                let (h, d) = if dims == 2 {
                    (values::<2>(&on_host, id), values::<2>(&on_dev, id))
                } else {
                    (values::<1>(&on_host, id), values::<1>(&on_dev, id))
                };
                let (h, d) = (h.unwrap(), d.unwrap());
                assert!(
                    h.iter().zip(&d).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "rank {rank}, cap {cap}: {h:?} vs {d:?}"
                );
            }
            assert!(on_dev.get::<2>(net.unused.weight.id).is_none());
            assert!(on_dev.get::<2>(net.frozen.weight.id).is_none());
        }
        rank
    });
    assert_eq!(results, [0, 1]);
}

/// The sharded optimizer's gradient path on the device communicator (owner-major buckets
/// packed on the device and reduce-scattered, here through the host-staged stand-in) on two
/// CPU ranks: each rank keeps bitwise the averaged gradients the host path keeps, of the
/// parameters it owns and of no other, for several owner tables and bucket caps.
#[test]
fn the_sharded_device_path_keeps_the_host_paths_gradients_on_two_ranks() {
    let results = crate::test_ranks::run_ranks(2, |group, rank| {
        let device = Device::flex().autodiff();
        let net = Net::new(&device);
        // The trainable parameters in visit order (the frozen layer has none).
        let ids = [
            (net.a.weight.id, 2),
            (net.a.bias.as_ref().unwrap().id, 1),
            (net.b.weight.id, 2),
            (net.b.bias.as_ref().unwrap().id, 1),
            (net.unused.weight.id, 2),
            (net.unused.bias.as_ref().unwrap().id, 1),
        ];
        let mut kept = 0;
        for owners in [vec![0, 1, 0, 1, 0, 1], vec![1, 1, 1, 0, 1, 1]] {
            for cap in [4, 24, 1 << 20] {
                let mut host = GradientSynchronizer::new(group.clone(), cap).with_overlap(false);
                host.check_replicas = false;
                let on_host = host
                    .sync_to_owners(&net, rank_grads(&net, &device, rank), &owners)
                    .unwrap();
                assert!(!host.last_sync_on_device());
                let mut dev = GradientSynchronizer::new(group.clone(), cap)
                    .with_device_comm(Some(crate::cuda::DeviceComm::host_staged(group.clone())));
                dev.check_replicas = false;
                let on_dev = dev
                    .sync_to_owners(&net, rank_grads(&net, &device, rank), &owners)
                    .unwrap();
                assert!(dev.last_sync_on_device(), "cap {cap}: took the host path");
                assert_eq!(on_host.present, on_dev.present);
                for (slot, (id, dims)) in ids.into_iter().enumerate() {
                    let get = |g: &GradientsParams| {
                        if dims == 2 {
                            values::<2>(g, id)
                        } else {
                            values::<1>(g, id)
                        }
                    };
                    let (h, d) = (get(&on_host.grads), get(&on_dev.grads));
                    let mine = owners[slot] == rank && on_host.present[slot];
                    assert_eq!(d.is_some(), mine, "rank {rank}, slot {slot}, cap {cap}");
                    assert_eq!(h.is_some(), d.is_some(), "rank {rank}, slot {slot}");
                    if let (Some(h), Some(d)) = (h, d) {
                        kept += 1;
                        assert!(
                            h.iter().zip(&d).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "rank {rank}, slot {slot}, cap {cap}: {h:?} vs {d:?}"
                        );
                    }
                }
            }
        }
        kept
    });
    // Each rank kept gradients under both tables (the unused layer has none anywhere).
    assert!(results.iter().all(|&k| k > 0), "{results:?}");
}

/// The device path with a real NCCL communicator (`#[ignore]`d: they need a GPU).
#[cfg(feature = "cuda")]
mod nccl_path {
    use super::*;

    /// The NCCL device path in a world of one: real NCCL calls on the GPU, which must hand
    /// back exactly the gradients they got, for several bucket layouts.
    #[test]
    #[ignore = "needs an NVIDIA GPU with libcuda and libnccl, and Burn's CUDA backend built \
                (cubecl-llvm downloads LLVM at build time)"]
    fn nccl_device_path_in_a_world_of_one_returns_the_same_gradients() {
        let device = Device::cuda(0).autodiff();
        let net = Net::new(&device);
        let (nccl, group) = one_rank_nccl();
        for cap in [4, 40, 1 << 20] {
            let mut sync = GradientSynchronizer::new(group.clone(), cap).with_nccl(nccl.clone());
            sync.skip_when_alone = false;
            round_trip(&net, &device, &mut sync);
            assert!(sync.last_sync_on_device(), "cap {cap}: took the host path");
        }
    }

    /// The NCCL device path with bf16 / fp16 on the wire, in a world of one: the gradients come
    /// back as f32, each within one 16-bit rounding of the original (a one-rank NCCL all-reduce
    /// only rounds), on the device path.
    #[test]
    #[ignore = "needs CUDA"]
    fn nccl_device_path_with_16_bit_wire_rounds_once() {
        use ddp_comm::Compression;
        let device = Device::cuda(0).autodiff();
        let net = Net::new(&device);
        let (nccl, group) = one_rank_nccl();
        for (compression, unit) in [
            (Compression::Bf16, 2f32.powi(-8)),
            (Compression::Fp16, 2f32.powi(-11)),
        ] {
            let mut sync = GradientSynchronizer::new(group.clone(), 1 << 20)
                .with_nccl(nccl.clone())
                .with_compression(compression);
            sync.skip_when_alone = false;
            let grads = grads_of(&net, &device);
            let before = values::<2>(&grads, net.a.weight.id).unwrap();
            let out = sync.sync(&net, grads).unwrap();
            assert!(
                sync.last_sync_on_device(),
                "{compression}: took the host path"
            );
            let after = values::<2>(&out, net.a.weight.id).unwrap();
            assert_eq!(after.len(), before.len());
            for (a, b) in after.iter().zip(&before) {
                assert!(
                    (a - b).abs() <= unit * b.abs() + 1e-7,
                    "{compression}: {a} vs {b}"
                );
            }
        }
    }

    /// A one-rank NCCL communicator on CUDA device 0 and a world-of-one process group.
    fn one_rank_nccl() -> (crate::nccl::SharedNccl, crate::comm::SharedGroup) {
        use ddp_nccl::{NcclGroup, NcclOptions};
        let nccl = NcclGroup::single(&NcclOptions {
            device: Some(0),
            ..NcclOptions::default()
        })
        .unwrap();
        (
            Arc::new(Mutex::new(nccl)),
            Arc::new(Mutex::new(ProcessGroup::single())),
        )
    }
}
