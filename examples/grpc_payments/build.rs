//! Generates the service's Rust code from `proto/payments.proto` with
//! `protoc` (Debian: `apt-get install protobuf-compiler`; macOS: `brew
//! install protobuf`; or set `PROTOC` to its path).
fn main() {
    println!("cargo:rerun-if-changed=proto/payments.proto");
    if let Err(error) = tonic_prost_build::compile_protos("proto/payments.proto") {
        panic!(
            "cannot generate the gRPC code: {error}\n\
             install protoc (Debian/Ubuntu: apt-get install protobuf-compiler; macOS: brew install protobuf) or set PROTOC to its path"
        );
    }
}
