//! Compiles `kernels/*.cu` with nvcc into fatbins (sm_80 and sm_90a machine code, compute_90
//! PTX for newer GPUs) when the `cuda` feature is on. The fatbins are embedded with
//! `include_bytes!` and loaded through the CUDA driver, which picks the matching image: no
//! run-time compilation on Ampere and Hopper, which get code built for them. A newer GPU compiles
//! the compute_90 PTX when loading it, so that it has what the launchers assume of every compute
//! capability ≥ 9 (tensor-map copies, programmatic dependent launch); compute_80 PTX would lack
//! both. nvcc is found through `NVCC`, `CUDA_HOME`/`CUDA_PATH` or `PATH`. The `timeline` feature
//! compiles the kernels' timeline marks in (`M2_TIMELINE`).

use std::path::{Path, PathBuf};
use std::process::Command;

const KERNELS: &[&str] = &[
    "chunk_cumsum",
    "fwd_pass_state",
    "compute_out",
    "ssd_step",
    "causal_conv1d",
    "rms_norm",
    "matvec",
];

fn nvcc() -> PathBuf {
    if let Some(p) = std::env::var_os("NVCC") {
        return p.into();
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            let p = Path::new(&home).join("bin").join("nvcc");
            if p.exists() {
                return p;
            }
        }
    }
    "nvcc".into()
}

fn main() {
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-changed=kernels/common.cuh");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = nvcc();
    let marks: &[&str] = if std::env::var_os("CARGO_FEATURE_TIMELINE").is_some() {
        &["-DM2_TIMELINE"]
    } else {
        &[]
    };
    for name in KERNELS {
        let src = format!("kernels/{name}.cu");
        println!("cargo:rerun-if-changed={src}");
        let dst = out.join(format!("{name}.fatbin"));
        let status = Command::new(&nvcc)
            .args(["--fatbin", "-O3", "-std=c++17", "-Xptxas=-warn-spills"])
            .args(marks)
            .args(["-gencode", "arch=compute_80,code=sm_80"])
            .args(["-gencode", "arch=compute_90a,code=sm_90a"])
            .args(["-gencode", "arch=compute_90,code=compute_90"])
            .arg("-o")
            .arg(&dst)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
        assert!(status.success(), "nvcc failed on {src}");
    }
}
