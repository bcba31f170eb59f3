//! Compile the example/test service (`proto/echo.proto`) with tonic-build (needs `protoc`).
fn main() {
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&["proto/echo.proto"], &["proto"])
        .expect(
            "compile proto/echo.proto (is protoc installed? apt-get install protobuf-compiler)",
        );
}
