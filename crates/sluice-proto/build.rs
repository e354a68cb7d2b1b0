use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read at run time, not compiled in: checkouts sharing one target
    // directory share this script's binary.
    let proto_root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let files = ["jobs", "admission", "limits", "rate", "refresh", "link"]
        .map(|name| proto_root.join(format!("sluice/v1/{name}.proto")));
    // Relative to this package's root, so that two checkouts sharing one
    // target directory (CI's fresh clones) each check their own protos: with
    // absolute paths, a build in one checkout could take the other's
    // generated code for fresh.
    for name in ["jobs", "admission", "limits", "rate", "refresh", "link"] {
        println!("cargo:rerun-if-changed=../../proto/sluice/v1/{name}.proto");
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .emit_rerun_if_changed(false)
        .codec_path("crate::codec::SluiceCodec")
        .file_descriptor_set_path(out_dir.join("sluice_descriptor.bin"))
        .compile_protos(&files, &[proto_root])?;
    Ok(())
}
