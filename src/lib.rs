pub use mamba2_kernels as kernels;
