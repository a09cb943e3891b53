//! Test builds (`host-kernel`) compile the device resolver's CUDA kernel for the CPU.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "host-kernel")]
    {
        println!("cargo:rerun-if-changed=cuda/resolve.cu");
        println!("cargo:rerun-if-changed=cuda/host/resolve_host.cpp");
        cc::Build::new()
            .cpp(true)
            .std("c++17")
            .opt_level(2)
            .warnings(true)
            .extra_warnings(true)
            .warnings_into_errors(true)
            .file("cuda/host/resolve_host.cpp")
            .compile("sparsetier_resolve_host");
    }
}
