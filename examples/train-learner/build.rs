//! Copies README.md's burn-train block (the `rust,ignore` block of "## Adopting it in
//! burn-train") into `OUT_DIR/readme_learner.rs`, wrapped in braces, for `readme_snippet` in
//! `src/main.rs` to compile against this program's model and loaders: a README edit that no
//! longer compiles fails this build.

use std::path::{Path, PathBuf};

fn main() {
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    println!("cargo::rerun-if-changed={}", readme.display());
    let text = std::fs::read_to_string(&readme)
        .unwrap_or_else(|e| panic!("reading {}: {e}", readme.display()));
    let block = text
        .split_once("## Adopting it in burn-train")
        .and_then(|(_, section)| section.split_once("```rust,ignore\n"))
        .and_then(|(_, rest)| rest.split_once("\n```"))
        .map(|(block, _)| block)
        .unwrap_or_else(|| {
            panic!(
                "{}: no ```rust,ignore block under \"## Adopting it in burn-train\"",
                readme.display()
            )
        });
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let path = out.join("readme_learner.rs");
    std::fs::write(&path, format!("{{\n{block}\n}}\n"))
        .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}
