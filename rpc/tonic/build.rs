//! Compile the example/test service (`proto/echo.proto`) in pure Rust: `protox`
//! parses the .proto into a descriptor set and tonic-build generates the code
//! from it, so building needs nothing outside cargo (no `protoc` on PATH).
fn main() {
    let fds = protox::compile(["proto/echo.proto"], ["proto"])
        .unwrap_or_else(|e| panic!("compile proto/echo.proto: {e}"));
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)
        .expect("generate the echo service from its descriptor set");
    println!("cargo::rerun-if-changed=proto");
}
