//! Compiles `kernels/<family>/*.cu` with nvcc into fatbins (sm_80 and sm_90a machine code,
//! compute_90 PTX for newer GPUs) when the `cuda` feature is on, all files at once. The fatbins
//! are embedded with `include_bytes!` and loaded through the CUDA driver, which picks the matching
//! image: no run-time compilation on Ampere and Hopper, which get code built for them. A newer GPU
//! compiles the compute_90 PTX when loading it, so that it has what the launchers assume of every
//! compute capability ≥ 9 (tensor-map copies, programmatic dependent launch); compute_80 PTX would
//! lack both. Each file's kernel instantiations are written first from `src/instances.rs`, the
//! list the launchers name kernels from. nvcc is `NVCC`, else `$CUDA_HOME/bin/nvcc` or
//! `$CUDA_PATH/bin/nvcc`, else the first on `PATH`. The `timeline` feature compiles the kernels'
//! timeline marks in (`M2_TIMELINE`).
//!
//! nvcc is driven directly: the kernel-builder crates (cudaforge 0.1, bindgen_cuda 0.1) compile
//! each file for one compute capability into PTX or a static library, and none emits the fatbin
//! of several cubins plus PTX that the loader here takes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

#[allow(dead_code)]
mod instances {
    include!("src/instances.rs");
}

/// The nvcc to run, and the environment variables that chose it (to re-run when they change).
fn nvcc() -> (PathBuf, &'static [&'static str]) {
    if let Some(p) = std::env::var_os("NVCC") {
        return (p.into(), &["NVCC"]);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            let p = Path::new(&home).join("bin").join("nvcc");
            if p.exists() {
                return (p, &["NVCC", "CUDA_HOME", "CUDA_PATH"]);
            }
        }
    }
    ("nvcc".into(), &["NVCC", "CUDA_HOME", "CUDA_PATH", "PATH"])
}

/// nvcc's release line (`Cuda compilation tools, release 13.0, V13.0.88`).
fn release(nvcc: &Path) -> String {
    let out = Command::new(nvcc)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find(|l| l.contains("release"))
        .unwrap_or("unknown release")
        .trim()
        .to_string()
}

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed=src/instances.rs");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let (nvcc, vars) = nvcc();
    for var in vars {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let inc = out.join("inc");
    let mut files: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for k in instances::instances() {
        files
            .entry(k.file)
            .or_default()
            .push(format!("{};", k.call));
    }
    for (file, calls) in &files {
        let path = inc.join(format!("{file}.inc"));
        std::fs::create_dir_all(path.parent().expect("an .inc file has a folder"))
            .expect("create OUT_DIR/inc");
        std::fs::write(&path, calls.join("\n") + "\n").expect("write an .inc file");
    }
    let marks: &[&str] = if std::env::var_os("CARGO_FEATURE_TIMELINE").is_some() {
        &["-DM2_TIMELINE"]
    } else {
        &[]
    };
    let failed: Vec<String> = std::thread::scope(|scope| {
        let jobs: Vec<_> = files
            .keys()
            .map(|file| {
                let (nvcc, inc, out) = (&nvcc, &inc, &out);
                scope.spawn(move || {
                    let src = format!("kernels/{file}.cu");
                    let dst = out.join(format!("{}.fatbin", file.replace('/', "_")));
                    let result = Command::new(nvcc)
                        .args(["--fatbin", "-O3", "-std=c++17", "-Xptxas=-warn-spills"])
                        .args(marks)
                        .arg("-Ikernels")
                        .arg(format!("-I{}", inc.display()))
                        .args(["-gencode", "arch=compute_80,code=sm_80"])
                        .args(["-gencode", "arch=compute_90a,code=sm_90a"])
                        .args(["-gencode", "arch=compute_90,code=compute_90"])
                        .arg("-o")
                        .arg(&dst)
                        .arg(&src)
                        .status();
                    match result {
                        Ok(s) if s.success() => None,
                        Ok(s) => Some(format!("nvcc failed on {src} ({s})")),
                        Err(e) => Some(format!("cannot run {}: {e}", nvcc.display())),
                    }
                })
            })
            .collect();
        jobs.into_iter()
            .filter_map(|j| j.join().expect("an nvcc job panicked"))
            .collect()
    });
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    println!(
        "cargo:warning=mamba2-kernels: {} kernel files compiled by {} ({})",
        files.len(),
        nvcc.display(),
        release(&nvcc)
    );
}
