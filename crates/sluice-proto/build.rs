use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files = ["jobs", "admission", "limits", "rate", "refresh", "link"]
        .map(|name| proto_root.join(format!("sluice/v1/{name}.proto")));
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .codec_path("crate::codec::SluiceCodec")
        .file_descriptor_set_path(out_dir.join("sluice_descriptor.bin"))
        .compile_protos(&files, &[proto_root])?;
    Ok(())
}
