//! Where the workspace's per-package profile settings live (a test only).
//!
//! Cargo warns about every `[profile.*.package.NAME]` of the manifest whose package a build does
//! not include, and `cargo install --path crates/ddprun` (the README's install line) includes
//! none of the GPU stack: it printed 43 such warnings. It does not warn about a config file's,
//! so the named entries live in `.cargo/config.toml`; the manifest keeps `[profile.dev]`, the
//! `"*"` entry and `[profile.release]`.

/// The `[profile.<p>.package.<name>]` headers of a TOML file, `"*"` left out.
fn named_package_profiles(text: &str) -> Vec<&str> {
    text.lines()
        .map(str::trim)
        .filter(|l| l.starts_with("[profile.") && l.contains(".package.") && !l.contains("\"*\""))
        .collect()
}

#[test]
fn named_package_profiles_live_in_the_config_file() {
    let root = cargo_tasks::workspace_root();
    let read = |p: &str| {
        let path = root.join(p);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let manifest = read("Cargo.toml");
    assert_eq!(
        named_package_profiles(&manifest),
        Vec::<&str>::new(),
        "move these to .cargo/config.toml (cargo install warns about them)"
    );
    let config = read(".cargo/config.toml");
    let moved = named_package_profiles(&config);
    assert!(
        moved.contains(&"[profile.dev.package.cubecl-core]"),
        "the GPU stack's settings are kept: {moved:?}"
    );
}
