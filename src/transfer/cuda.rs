//! CUDA engines (kernel, direct): see issue 4.
