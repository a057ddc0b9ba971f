//! The stand-in catches what the driver would refuse: a PTX that ptxas does not assemble for
//! sm_90a, and launches over the H200's limits. Needs `ptxas` (`pip install nvidia-cuda-nvcc`;
//! `.ci/run` installs it): without one this test fails and says so.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;

use cuda_standin::driver::*;

const GOOD: &str = r#"
.version 9.0
.target sm_90a
.address_size 64

.visible .entry add_one(.param .u64 p)
{
    .reg .b64 %rd<3>;
    .reg .f32 %f<3>;
    ld.param.u64 %rd1, [p];
    cvta.to.global.u64 %rd2, %rd1;
    ld.global.f32 %f1, [%rd2];
    add.f32 %f2, %f1, 0f3F800000;
    st.global.f32 [%rd2], %f2;
    ret;
}
"#;

/// Uses a register it never declares: ptxas fails.
const SYNTAX_ERROR: &str = r#"
.version 9.0
.target sm_90a
.address_size 64

.visible .entry broken(.param .u64 p)
{
    .reg .f32 %f<3>;
    add.f32 %f2, %f1, %f9;
    ret;
}
"#;

/// 240 000 bytes of static shared memory: more than the 227 KiB a block may have (ptxas
/// refuses it).
const TOO_MUCH_SHARED: &str = r#"
.version 9.0
.target sm_90a
.address_size 64

.visible .entry hoard(.param .u64 p)
{
    .shared .align 4 .b8 big[SIZE];
    .reg .b64 %rd<3>;
    .reg .f32 %f<2>;
    mov.u64 %rd1, big;
    ld.shared.f32 %f1, [%rd1];
    ld.param.u64 %rd2, [p];
    cvta.to.global.u64 %rd2, %rd2;
    st.global.f32 [%rd2], %f1;
    ret;
}
"#;

fn load(ptx: &str) -> (CuResult, Handle) {
    let text = std::ffi::CString::new(ptx).unwrap();
    let mut module: Handle = null_mut();
    let r = unsafe { cuModuleLoadData(&mut module, text.as_ptr().cast::<c_void>()) };
    (r, module)
}

fn launch(f: Handle, block_x: u32, shared: u32) -> CuResult {
    unsafe {
        cuLaunchKernel(
            f,
            8,
            1,
            1,
            block_x,
            1,
            1,
            shared,
            null_mut(),
            null_mut(),
            null_mut(),
        )
    }
}

#[test]
fn bad_ptx_and_bad_launches_are_refused_and_recorded() {
    let ptxas = ddp_nccl::cuda_toolkit::find_ptxas()
        .unwrap_or_else(|e| panic!("this test needs ptxas: {e}"));
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("standin.log");
    // SAFETY: the only test of this binary; nothing else reads the environment meanwhile.
    unsafe {
        std::env::set_var("CUDA_STANDIN_PTXAS", &ptxas);
        std::env::set_var("CUDA_STANDIN_LOG", &log);
    }
    unsafe { assert_eq!(cuInit(0), SUCCESS) };
    let mut count: c_int = 0;
    unsafe { assert_eq!(cuDeviceGetCount(&mut count), SUCCESS) };
    assert_eq!(count, 1);

    // A good module assembles and launches within the limits.
    let (r, module) = load(GOOD);
    assert_eq!(r, SUCCESS, "ptxas refused a valid kernel");
    let mut f: Handle = null_mut();
    let name = c"add_one";
    unsafe { assert_eq!(cuModuleGetFunction(&mut f, module, name.as_ptr()), SUCCESS) };
    assert_eq!(launch(f, 256, 0), SUCCESS);

    // Launches over the device's limits are refused as the driver refuses them.
    assert_eq!(launch(f, 2048, 0), INVALID_VALUE, "2048 threads per block");
    assert_eq!(
        launch(f, 128, 100 * 1024),
        INVALID_VALUE,
        "100 KiB without the opt-in"
    );
    unsafe { assert_eq!(cuFuncSetAttribute(f, 8, 100 * 1024), SUCCESS) };
    assert_eq!(
        launch(f, 128, 100 * 1024),
        SUCCESS,
        "100 KiB after the opt-in"
    );
    unsafe { assert_eq!(cuFuncSetAttribute(f, 8, 228 * 1024), INVALID_VALUE) };
    let mut regs: c_int = -1;
    unsafe { assert_eq!(cuFuncGetAttribute(&mut regs, 4, f), SUCCESS) };
    assert!(regs > 0, "registers from ptxas -v: {regs}");

    // PTX that does not assemble fails the load.
    assert_eq!(load(SYNTAX_ERROR).0, INVALID_PTX);
    assert_eq!(
        load(&TOO_MUCH_SHARED.replace("SIZE", "240000")).0,
        INVALID_PTX
    );

    // 200 000 static bytes assemble; with 40 KiB dynamic on top the block would pass 227 KiB.
    let (r, big) = load(&TOO_MUCH_SHARED.replace("SIZE", "200000"));
    assert_eq!(r, SUCCESS);
    let mut hoard: Handle = null_mut();
    unsafe {
        assert_eq!(
            cuModuleGetFunction(&mut hoard, big, c"hoard".as_ptr()),
            SUCCESS
        )
    };
    assert_eq!(launch(hoard, 32, 0), SUCCESS);
    unsafe { assert_eq!(cuFuncSetAttribute(hoard, 8, 40 * 1024), INVALID_VALUE) };
    assert_eq!(launch(hoard, 32, 40 * 1024), INVALID_VALUE);

    let record = std::fs::read_to_string(&log).unwrap();
    let modules: Vec<Vec<&str>> = record
        .lines()
        .map(|l| l.split('\t').collect::<Vec<_>>())
        .filter(|f| f[0] == "module")
        .collect();
    assert_eq!(modules.len(), 4, "{record}");
    assert_eq!(modules[0][2], "ok");
    assert_eq!(&modules[0][3..5], ["9.0", "sm_90a"]);
    assert_eq!(modules[0][6], "refuses_bad_kernels", "the program");
    assert_eq!(modules[0][7], "add_one");
    assert_eq!((modules[1][2], modules[2][2]), ("failed", "failed"));
    assert!(
        record.contains("launch\tadd_one\trefused\tblock dimension x = 2048"),
        "{record}"
    );
    // The refused modules are kept beside the record, with ptxas's words.
    let kept: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".ptxas.txt"))
        .collect();
    assert_eq!(kept.len(), 2, "{record}");
}
