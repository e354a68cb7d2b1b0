//! Code generated from `proto/` — every public gRPC method and Kafka message of
//! Sluice is defined there once. This crate only generates; domain types live
//! in the service crates.

#![allow(clippy::large_enum_variant, clippy::derive_partial_eq_without_eq)]

pub mod codec;

pub mod v1 {
    tonic::include_proto!("sluice.v1");
}

/// Encoded `FileDescriptorSet` of every Sluice proto, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("sluice_descriptor");
