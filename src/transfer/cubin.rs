//! A kernel (the copy kernel, the device resolver) as a cubin for one GPU architecture:
//! compiled with NVRTC once, kept on disk.
//!
//! PTX needs the driver to JIT it and fails to load when NVRTC is newer than the driver
//! (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`); a cubin for the device's own compute capability
//! loads as it is. Compiling takes a few hundred milliseconds, so the image is cached under
//! [`cache_dir`], keyed by the kernel source's hash, the NVRTC version and the architecture: a
//! changed kernel, a different NVRTC or another GPU gets its own file. A cached file is used
//! only if it is an ELF image; it is written to a temporary name and renamed into place, so
//! concurrent processes never read half a file.

use super::cuda::{INSTALL_NVRTC, KERNEL_SOURCE, RESOLVE_SOURCE};
use crate::error::{Error, Result};
use std::ffi::{c_char, CString};
use std::hash::Hasher;
use std::path::{Path, PathBuf};

/// A kernel's source: its file name (for NVRTC's messages and the cache) and text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// The file name without `.cu`.
    pub name: &'static str,
    /// The CUDA C++ source.
    pub text: &'static str,
}

/// The copy kernel (`cuda/page_copy.cu`).
pub const PAGE_COPY: KernelSource = KernelSource {
    name: "page_copy",
    text: KERNEL_SOURCE,
};

/// The device resolver (`cuda/resolve.cu`).
pub const RESOLVE: KernelSource = KernelSource {
    name: "resolve",
    text: RESOLVE_SOURCE,
};

/// A compiled kernel image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cubin {
    /// The architecture it was compiled for, e.g. `sm_90`.
    pub arch: String,
    /// The ELF image, as `cuModuleLoadData` takes it.
    pub image: Vec<u8>,
    /// The file it is cached in.
    pub path: PathBuf,
    /// Whether it came from the disk cache rather than from NVRTC.
    pub from_cache: bool,
}

/// Where compiled kernels are cached: `$SPARSETIER_KERNEL_CACHE`, else
/// `$XDG_CACHE_HOME/sparsetier/kernels`, else `~/.cache/sparsetier/kernels`, else a
/// `sparsetier-kernels` folder in the system's temporary folder.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SPARSETIER_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("sparsetier").join("kernels");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return PathBuf::from(h)
            .join(".cache")
            .join("sparsetier")
            .join("kernels");
    }
    std::env::temp_dir().join("sparsetier-kernels")
}

/// `sm_<major><minor>` for a compute capability.
pub fn arch_of(major: i32, minor: i32) -> String {
    format!("sm_{major}{minor}")
}

fn check_arch(arch: &str) -> Result<()> {
    let digits = arch.strip_prefix("sm_").unwrap_or("");
    if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Error::config(
            "arch",
            format!("{arch:?}"),
            "a real GPU architecture such as sm_80 or sm_90 (a cubin is for one architecture)",
        ));
    }
    Ok(())
}

fn nvrtc_present() -> Result<()> {
    // SAFETY: only tries to dlopen libnvrtc.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::CudaUnavailable {
            what: "libnvrtc (the CUDA runtime compiler) cannot be loaded".into(),
            fix: INSTALL_NVRTC.into(),
        })
    }
}

fn nvrtc_err(call: &'static str, r: cudarc::nvrtc::sys::nvrtcResult) -> Error {
    Error::Cuda {
        call,
        message: format!("{r:?}"),
    }
}

/// The loaded NVRTC's version, (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    nvrtc_present()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: libnvrtc is loadable (checked above); both out-pointers are live locals.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_err("nvrtcVersion", r));
    }
    Ok((major, minor))
}

/// The cache file name of the copy kernel for `arch` under NVRTC `version`.
pub fn cache_name(arch: &str, version: (i32, i32)) -> String {
    cache_name_of(PAGE_COPY, arch, version)
}

/// The cache file name of kernel `src` for `arch` under NVRTC `version`.
pub fn cache_name_of(src: KernelSource, arch: &str, version: (i32, i32)) -> String {
    let mut h = rustc_hash::FxHasher::default();
    h.write(src.text.as_bytes());
    format!(
        "{}-{arch}-nvrtc{}.{}-{:016x}.cubin",
        src.name,
        version.0,
        version.1,
        h.finish()
    )
}

/// The copy kernel's cubin for `arch` ([`cubin_of`]).
pub fn cubin(arch: &str, dir: Option<&Path>) -> Result<Cubin> {
    cubin_of(PAGE_COPY, arch, dir)
}

/// Kernel `src`'s cubin for `arch`, from `dir` (default [`cache_dir`]) or compiled and stored
/// there. A cache that cannot be written is not an error: the image is still returned.
pub fn cubin_of(src: KernelSource, arch: &str, dir: Option<&Path>) -> Result<Cubin> {
    check_arch(arch)?;
    let version = nvrtc_version()?;
    let dir = dir.map_or_else(cache_dir, Path::to_path_buf);
    let path = dir.join(cache_name_of(src, arch, version));
    if let Ok(image) = std::fs::read(&path) {
        if image.starts_with(b"\x7fELF") {
            return Ok(Cubin {
                arch: arch.to_owned(),
                image,
                path,
                from_cache: true,
            });
        }
    }
    let image = compile_cubin_of(src, arch)?;
    let _ = store(&dir, &path, &image);
    Ok(Cubin {
        arch: arch.to_owned(),
        image,
        path,
        from_cache: false,
    })
}

fn store(dir: &Path, path: &Path, image: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, image)?;
    std::fs::rename(&tmp, path)
}

/// Compiles the copy kernel with NVRTC straight to a cubin for `arch`.
pub fn compile_cubin(arch: &str) -> Result<Vec<u8>> {
    compile_cubin_of(PAGE_COPY, arch)
}

/// Compiles kernel `src` with NVRTC straight to a cubin for `arch`.
pub fn compile_cubin_of(kernel: KernelSource, arch: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    check_arch(arch)?;
    nvrtc_present()?;
    let src = CString::new(kernel.text).expect("the kernel source has no NUL");
    let file = CString::new(format!("{}.cu", kernel.name)).expect("a name without NUL");
    let prog = result::create_program(&src, Some(&file))
        .map_err(|e| nvrtc_err("nvrtcCreateProgram", e.0))?;
    let opts = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_owned(),
    ];
    // SAFETY: `prog` was just created and is destroyed once below; the options are C strings.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    let out = match compiled {
        Err(e) => {
            // SAFETY: as above.
            let log = unsafe { result::get_program_log(prog) }
                .map(|l| {
                    let bytes: Vec<u8> =
                        l.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
                    String::from_utf8_lossy(&bytes).into_owned()
                })
                .unwrap_or_default();
            Err(Error::Cuda {
                call: "nvrtcCompileProgram",
                message: format!("{:?}: {log}", e.0),
            })
        }
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled; `size` is a live local.
            let r = unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) };
            if r != sys::nvrtcResult::NVRTC_SUCCESS {
                Err(nvrtc_err("nvrtcGetCUBINSize", r))
            } else if size == 0 {
                Err(Error::Cuda {
                    call: "nvrtcGetCUBIN",
                    message: format!("no cubin for {arch} (a virtual architecture?)"),
                })
            } else {
                let mut image = vec![0u8; size];
                // SAFETY: `image` holds the `size` bytes NVRTC reported.
                let r = unsafe { sys::nvrtcGetCUBIN(prog, image.as_mut_ptr() as *mut c_char) };
                if r == sys::nvrtcResult::NVRTC_SUCCESS {
                    Ok(image)
                } else {
                    Err(nvrtc_err("nvrtcGetCUBIN", r))
                }
            }
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { result::destroy_program(prog) };
    out
}
