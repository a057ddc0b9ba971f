//! `cargo xtask readme-deps`: the README's dependency lines, as a user's fresh project would
//! have them, resolve to a graph in which every burn-ddp feature builds — checked without
//! building Burn a second time.
//!
//! It writes a project under the target directory with the README's `[dependencies]` block
//! (`<checkout>` made this checkout, burn-ddp with every CPU feature: `learner`), lets cargo
//! resolve it afresh against the registry (`cargo metadata`: a lock file of its own, no
//! build), and refuses a graph that holds a crate known not to build in it. Burn's default
//! features turn on burn-train's system metrics, and `systemstat` 0.2.8 does not compile
//! there (five `RefCell … cannot be shared between threads` errors inside burn-train): the
//! README's `burn` line keeps Burn's defaults off, as the workspace does, and this check keeps
//! it so.

use std::path::Path;
use std::process::Command;

/// Crates that must not be in a fresh project's graph, and why.
const REFUSED: &[(&str, &str)] = &[(
    "systemstat",
    "burn-train's system metrics (Burn's default features): systemstat 0.2.8 does not compile \
     inside burn-train 0.22.1",
)];

/// The README's first ```toml block.
fn readme_dependencies(readme: &str) -> Result<&str, String> {
    let start = readme
        .find("```toml\n")
        .ok_or("README.md has no ```toml block")?
        + "```toml\n".len();
    let len = readme[start..]
        .find("```")
        .ok_or("README.md's ```toml block does not end")?;
    Ok(&readme[start..start + len])
}

/// The Cargo.toml of a user's project with `deps` (the README's block) from checkout `root`,
/// burn-ddp with its `learner` feature.
fn user_manifest(deps: &str, root: &Path) -> Result<String, String> {
    let deps = deps.replace("<checkout>", &root.display().to_string());
    if !deps.contains("[dependencies]") || !deps.contains("burn-ddp = {") {
        return Err(format!(
            "README.md's ```toml block is not a [dependencies] block with burn-ddp: {deps}"
        ));
    }
    let deps = deps.replacen("burn-ddp = {", "burn-ddp = { features = [\"learner\"],", 1);
    Ok(format!(
        "[package]\nname = \"readme-user\"\nversion = \"0.1.0\"\nedition = \"2024\"\n\n[workspace]\n\n{deps}"
    ))
}

/// The names and versions of the packages in `cargo metadata`'s output.
fn packages(metadata: &[u8]) -> Result<Vec<(String, String)>, String> {
    let v: serde_json::Value =
        serde_json::from_slice(metadata).map_err(|e| format!("cargo metadata's output: {e}"))?;
    let packages = v["packages"]
        .as_array()
        .ok_or("cargo metadata printed no packages")?;
    Ok(packages
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap_or_default().to_string(),
                p["version"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect())
}

/// Writes the project, resolves it, and checks its graph.
pub fn run(root: &Path) -> Result<(), String> {
    let readme =
        std::fs::read_to_string(root.join("README.md")).map_err(|e| format!("README.md: {e}"))?;
    let manifest = user_manifest(readme_dependencies(&readme)?, root)?;
    let dir = cargo_tasks::target_dir(root).join("readme-user");
    std::fs::create_dir_all(dir.join("src")).map_err(|e| format!("{}: {e}", dir.display()))?;
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))
    };
    write("Cargo.toml", &manifest)?;
    write("src/main.rs", "fn main() {}\n")?;
    // A fresh resolution every time, as a new user's first build makes.
    match std::fs::remove_file(dir.join("Cargo.lock")) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("{}: {e}", dir.join("Cargo.lock").display())),
    }
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(dir.join("Cargo.toml"))
        .output()
        .map_err(|e| format!("could not run cargo metadata: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo metadata on the README's dependency lines failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let packages = packages(&out.stdout)?;
    for (name, why) in REFUSED {
        if let Some((_, version)) = packages.iter().find(|(n, _)| n == name) {
            return Err(format!(
                "the README's dependency lines bring {name} {version} into a new project's graph \
                 ({why}); keep Burn's default features off in the README's burn line"
            ));
        }
    }
    eprintln!(
        "==> the README's dependency lines resolve to {} packages, with burn-ddp's learner \
         feature and none of {:?}",
        packages.len(),
        REFUSED.iter().map(|(n, _)| *n).collect::<Vec<_>>()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_readme_block_becomes_a_project_with_the_learner_feature() {
        let readme = "x\n```toml\n[dependencies]\nburn = \"=0.22.1\"\nburn-ddp = { path = \"<checkout>/crates/burn-ddp\" }\n```\n";
        let deps = readme_dependencies(readme).unwrap();
        let m = user_manifest(deps, Path::new("/src/burn-ddp")).unwrap();
        assert!(
            m.contains(
                r#"burn-ddp = { features = ["learner"], path = "/src/burn-ddp/crates/burn-ddp" }"#
            ),
            "{m}"
        );
        assert!(m.contains("[workspace]") && m.contains("name = \"readme-user\""));
        assert!(user_manifest("[dependencies]\nserde = \"1\"\n", Path::new("/")).is_err());
        let meta = br#"{"packages":[{"name":"systemstat","version":"0.2.8"}]}"#;
        assert_eq!(
            packages(meta).unwrap(),
            [("systemstat".to_string(), "0.2.8".to_string())]
        );
    }
}
