//! The rule "no module imports one that imports it", checked over the workspace's library
//! sources and the tools' (`tools/`) as a test (`cargo test -p xtask`, part of CI's test
//! step); and the tools' one crate rule, that they depend on no bench or training runner above
//! them (`the_tools_depend_on_nothing_above_them`).
//!
//! The graph is one node per source file (`a.rs` or `a/mod.rs` is module `a`). A file has an
//! edge to the file of every module it names by path — `crate::a::b::X`, `super::x`,
//! `self::x`, in `use` declarations (braces expanded) and inline — resolved to the deepest
//! module of that path, so `crate::a::X` (an item `a` re-exports) is an edge to `a`'s own file.
//! A file naming one of its ancestors (`use super::*` in a child, a child using its parent's
//! types) is containment, not an import: such edges are left out. Comments and string
//! literals are skipped. A cycle is reported with its files in order.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path, `["a", "b"]` for `crate::a::b` (empty: the crate root).
type ModPath = Vec<String>;

/// Every module of the crate rooted at `src/lib.rs`: module path → file.
fn modules(src: &Path) -> BTreeMap<ModPath, PathBuf> {
    let mut out = BTreeMap::new();
    out.insert(Vec::new(), src.join("lib.rs"));
    walk(src, &mut Vec::new(), &mut out);
    out
}

fn walk(dir: &Path, prefix: &mut ModPath, out: &mut BTreeMap<ModPath, PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        let name = p
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        if p.is_dir() {
            if prefix.is_empty() && name == "bin" {
                continue; // binaries are crates of their own
            }
            prefix.push(name.clone());
            if p.join("mod.rs").is_file() {
                out.insert(prefix.clone(), p.join("mod.rs"));
            }
            walk(&p, prefix, out);
            prefix.pop();
        } else if let Some(stem) = name.strip_suffix(".rs")
            && !matches!(stem, "mod" | "lib" | "main")
        {
            let mut m = prefix.clone();
            m.push(stem.to_string());
            out.insert(m, p);
        }
    }
}

/// `text` without comments, string and char literals (each replaced by a space).
fn strip(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                while i < b.len() {
                    if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                        depth += 1;
                        i += 2;
                    } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
                out.push(' ');
            }
            b'"' => {
                // A raw string's `r#"` was copied already; its end is the next quote (plus
                // hashes), which is enough for these sources.
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    if b[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i += 1;
                out.push(' ');
            }
            c => {
                out.push(c as char);
                i += 1;
            }
        }
    }
    out
}

/// Expands a `use` tree (`a::{b, c::{d, e}}`) into its paths.
fn expand(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        return vec![tree.split(" as ").next().unwrap_or(tree).trim().to_string()];
    };
    let prefix = tree[..open].trim_end_matches("::").trim();
    let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.trim().is_empty())
        .flat_map(expand)
        .map(|p| {
            if p == "self" {
                prefix.to_string()
            } else if prefix.is_empty() {
                p
            } else {
                format!("{prefix}::{p}")
            }
        })
        .collect()
}

/// Every path starting with `crate`, `super` or `self` that `code` (stripped) names.
fn paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    // `use` declarations, braces expanded.
    let mut rest = code;
    while let Some(at) = rest.find("use ") {
        let before = rest[..at].chars().last();
        rest = &rest[at + 4..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let end = rest.find(';').unwrap_or(rest.len());
        let tree: String = rest[..end].split_whitespace().collect::<Vec<_>>().join(" ");
        out.extend(expand(&tree));
    }
    // Inline paths.
    let bytes = code.as_bytes();
    for head in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(pos) = code[from..].find(head) {
            let at = from + pos;
            from = at + head.len();
            if at > 0
                && (bytes[at - 1].is_ascii_alphanumeric()
                    || bytes[at - 1] == b'_'
                    || bytes[at - 1] == b':')
            {
                continue;
            }
            let end = code[at..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .map_or(code.len(), |e| at + e);
            out.push(code[at..end].trim_end_matches(':').to_string());
        }
    }
    out
}

/// The module a path names, from the module `here` (the deepest module prefix).
fn resolve(path: &str, here: &ModPath, known: &BTreeMap<ModPath, PathBuf>) -> Option<ModPath> {
    let mut segs = path.split("::").filter(|s| !s.is_empty()).peekable();
    let mut base: ModPath = match *segs.peek()? {
        "crate" => Vec::new(),
        "self" => here.clone(),
        "super" => {
            let mut b = here.clone();
            b.pop();
            b
        }
        // A path relative to this module: one of its children (`use child::X`).
        first => {
            let mut child = here.clone();
            child.push(first.to_string());
            if !known.contains_key(&child) {
                return None;
            }
            here.clone()
        }
    };
    if matches!(segs.peek(), Some(&("crate" | "self" | "super"))) {
        segs.next();
    }
    let rest: Vec<&str> = segs.collect();
    let mut i = 0;
    while i < rest.len() && rest[i] == "super" {
        base.pop();
        i += 1;
    }
    let mut deepest = base.clone();
    for s in &rest[i..] {
        base.push((*s).to_string());
        if known.contains_key(&base) {
            deepest = base.clone();
        } else {
            break;
        }
    }
    Some(deepest)
}

/// The module a file is: for `a/mod.rs` and `a.rs`, `a`.
fn module_of(file: &Path, known: &BTreeMap<ModPath, PathBuf>) -> ModPath {
    known
        .iter()
        .find(|(_, f)| f.as_path() == file)
        .map(|(m, _)| m.clone())
        .unwrap_or_default()
}

/// The import edges of the crate at `src` (files as module paths; see the module docs).
fn edges(src: &Path) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let known = modules(src);
    let mut graph: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (m, file) in &known {
        let code = strip(&std::fs::read_to_string(file).unwrap_or_default());
        let here = module_of(file, &known);
        let out = graph.entry(m.clone()).or_default();
        // Inline paths through a child module (`child::f()`), as `use child::f` would.
        let children: Vec<String> = known
            .keys()
            .filter(|k| k.len() == here.len() + 1 && k.starts_with(&here))
            .map(|k| k[here.len()].clone())
            .collect();
        let mut named = paths(&code);
        for c in children {
            let needle = format!("{c}::");
            let hit = code.match_indices(&needle).any(|(i, _)| {
                i == 0 || {
                    let b = code.as_bytes()[i - 1];
                    !(b.is_ascii_alphanumeric() || b == b'_' || b == b':')
                }
            });
            if hit {
                named.push(c);
            }
        }
        for p in named {
            let Some(target) = resolve(&p, &here, &known) else {
                continue;
            };
            // The file itself, or one of its ancestors: containment, not an import.
            if here.starts_with(&target) {
                continue;
            }
            out.insert(target);
        }
    }
    graph
}

/// The cycles of `graph`, each as the modules along it (one per strongly connected part).
fn cycles(graph: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<Vec<ModPath>> {
    let mut found = Vec::new();
    let mut done: BTreeSet<ModPath> = BTreeSet::new();
    for start in graph.keys() {
        if done.contains(start) {
            continue;
        }
        // Depth-first search for a path back to `start`.
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        let mut seen = BTreeSet::new();
        while let Some((node, path)) = stack.pop() {
            for next in graph.get(&node).into_iter().flatten() {
                if next == start {
                    found.push(path.clone());
                    done.extend(path.iter().cloned());
                    stack.clear();
                    break;
                }
                if seen.insert(next.clone()) {
                    let mut p = path.clone();
                    p.push(next.clone());
                    stack.push((next.clone(), p));
                }
            }
        }
        done.insert(start.clone());
    }
    found
}

fn show(m: &ModPath) -> String {
    if m.is_empty() {
        "crate".into()
    } else {
        m.join("::")
    }
}

#[test]
fn the_libraries_have_no_import_cycles() {
    let root = cargo_tasks::workspace_root();
    let mut report = Vec::new();
    let mut checked = 0;
    for krate in [
        "crates/ddp-store",
        "crates/ddp-trace",
        "crates/ddp-doctor",
        "crates/ddp-comm",
        "crates/ddp-nccl",
        "crates/ddprun",
        "crates/burn-ddp-data",
        "crates/burn-ddp-batchnorm",
        "crates/burn-ddp-checkpoint",
        "crates/burn-ddp",
        "crates/ddp-testkit",
        "tools/cuda-standin",
        "tools/cuda-tools",
        "tools/cargo-tasks",
        "crates/ddp-bench/runs",
        "examples/train-cnn",
        "examples/train-cnn/runs",
    ] {
        let src = root.join(krate).join("src");
        assert!(
            src.join("lib.rs").is_file(),
            "{} has no lib.rs",
            src.display()
        );
        let graph = edges(&src);
        checked += graph.len();
        for c in cycles(&graph) {
            report.push(format!(
                "{krate}: {} → {}",
                c.iter().map(show).collect::<Vec<_>>().join(" → "),
                show(&c[0])
            ));
        }
    }
    assert!(
        checked > 50,
        "only {checked} modules found: the walk is broken"
    );
    assert!(report.is_empty(), "import cycles:\n{}", report.join("\n"));
}

/// The workspace crates a manifest's `[dependencies]` name (`NAME.workspace = true` or
/// `NAME = { workspace = true, … }`), of those in `workspace`'s `[workspace.dependencies]`
/// with a path: their paths.
fn workspace_deps(manifest: &str, workspace: &str) -> Vec<String> {
    let section = |text: &str, header: &str| -> Vec<String> {
        text.lines()
            .map(str::trim)
            .skip_while(|l| *l != header)
            .skip(1)
            .take_while(|l| !l.starts_with('['))
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(str::to_string)
            .collect()
    };
    let name = |l: &str| {
        l.split(['.', '=', ' '])
            .next()
            .unwrap_or_default()
            .to_string()
    };
    let paths: Vec<(String, String)> = section(workspace, "[workspace.dependencies]")
        .iter()
        .filter_map(|l| {
            let path = l.split("path = \"").nth(1)?.split('"').next()?;
            Some((name(l), path.to_string()))
        })
        .collect();
    section(manifest, "[dependencies]")
        .iter()
        .filter(|l| l.contains("workspace = true") || l.contains(".workspace"))
        .filter_map(|l| paths.iter().find(|(n, _)| *n == name(l)))
        .map(|(_, p)| p.clone())
        .collect()
}

/// The tools sit above the libraries and below the runners that use them (xtask, the bench
/// and training runners): cargo-tasks depends on no workspace crate, cuda-tools on cargo-tasks
/// and the libraries in `crates/` only, never on a runner (`crates/ddp-bench/runs`,
/// `examples/*/runs`), the tests, their kit or xtask. cuda-tools once depended on ddp-bench-runs for the ResNet table, which now lives in
/// cargo-tasks.
#[test]
fn the_tools_depend_on_nothing_above_them() {
    let root = cargo_tasks::workspace_root();
    let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap();
    let workspace = read("Cargo.toml");
    assert_eq!(
        workspace_deps(&read("tools/cargo-tasks/Cargo.toml"), &workspace),
        Vec::<String>::new()
    );
    let cuda_tools = workspace_deps(&read("tools/cuda-tools/Cargo.toml"), &workspace);
    assert!(
        cuda_tools.contains(&"tools/cargo-tasks".to_string()),
        "{cuda_tools:?}"
    );
    for dep in &cuda_tools {
        // The libraries, not the benchmarks, the multi-process tests or their kit.
        let library = dep.starts_with("crates/")
            && !["crates/ddp-bench", "crates/ddp-tests", "crates/ddp-testkit"]
                .iter()
                .any(|above| dep.starts_with(above));
        assert!(
            library || dep == "tools/cargo-tasks",
            "tools/cuda-tools depends on {dep}, above it or beside it"
        );
    }
    // The parser sees a runner where there is one.
    assert_eq!(
        workspace_deps(&read("xtask/Cargo.toml"), &workspace)
            .iter()
            .filter(|d| d.ends_with("/runs"))
            .count(),
        2
    );
}

#[test]
fn a_cycle_through_a_re_export_is_found_and_containment_is_not_one() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    let w = |p: &str, t: &str| {
        let f = src.join(p);
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, t).unwrap();
    };
    w("lib.rs", "mod error;\nmod a;\nmod b;\n");
    w(
        "error.rs",
        "// uses crate::b::Ignored in a comment\npub enum E { A(crate::a::AError) }\n",
    );
    w("a/mod.rs", "mod inner;\npub use inner::AError;\n");
    w(
        "a/inner.rs",
        "use super::*; use crate::b::{self, x::{Y as Z}};\npub struct AError;\n",
    );
    w(
        "b.rs",
        "use crate::error::E;\nconst S: &str = \"crate::a\";\n",
    );
    let graph = edges(src);
    let m = |s: &str| s.split("::").map(String::from).collect::<ModPath>();
    assert_eq!(
        graph[&m("a::inner")],
        BTreeSet::from([m("b")]),
        "super is containment"
    );
    assert_eq!(
        graph[&m("error")],
        BTreeSet::from([m("a")]),
        "comments are skipped"
    );
    assert_eq!(
        graph[&m("b")],
        BTreeSet::from([m("error")]),
        "strings are skipped"
    );
    let c = cycles(&graph);
    assert_eq!(c.len(), 1, "{c:?}");
    assert!(
        c[0].contains(&m("error")) && c[0].contains(&m("b")),
        "{c:?}"
    );
    assert_eq!(
        expand("a::{b, c::{d, e as f}, self}"),
        ["a::b", "a::c::d", "a::c::e", "a"]
    );
}
