//! `burn_ddp::init` twice in one process (alone in its test binary: the group is process-wide).

use std::time::Duration;

use burn::tensor::Device;
use burn_ddp::{Ddp, DdpError};
use ddp_comm::LaunchEnv;

#[test]
fn a_second_init_shares_the_group_with_the_same_settings_and_refuses_other_ones() {
    let builder = || {
        Ddp::builder()
            .launch_env(LaunchEnv::single_process())
            .device(Device::flex())
    };
    let first = builder().init().unwrap();
    // The same settings (another device or bucket cap is the caller's own): the same group.
    let again = builder().bucket_cap_bytes(1 << 20).init().unwrap();
    assert!(std::sync::Arc::ptr_eq(first.group(), again.group()));
    // Other group settings would be silently ignored: an error instead.
    let err = builder()
        .timeout(Duration::from_secs(7))
        .init()
        .unwrap_err();
    assert!(
        matches!(
            err,
            DdpError::InvalidSetting {
                setting: "burn_ddp::init",
                ..
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("called again with other settings"), "{msg}");
    assert!(msg.contains("7s"), "{msg}");
}
