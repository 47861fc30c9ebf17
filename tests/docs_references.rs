//! Comments and docs cite the project's own files: every cited section of
//! `docs/cudnn-graphs.md` (`docs/cudnn-graphs.md §5.2`) and every cited repository path
//! (`docs/simulator.md`, `crates/3-amp/tests/sim_primitives.rs`, `tools/sim/`, `README.md`)
//! must exist, so a renumbered chapter or a moved file cannot leave comments pointing nowhere.

use std::path::{Path, PathBuf};

/// The files under `dir` whose extension is one of `exts`, skipping build outputs and
/// the downloaded test dependencies.
fn sources(dir: &Path, exts: &[&str], out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            let skipped = matches!(name.as_str(), "target" | "__pycache__")
                || name.starts_with('.')
                || name.starts_with("target-");
            if !skipped {
                sources(&path, exts, out);
            }
        } else if path
            .extension()
            .is_some_and(|e| exts.iter().any(|x| e == *x))
        {
            out.push(path);
        }
    }
}

/// The repository: the working directory when it is the repository (a bundled binary on the
/// GPU machine runs from a copy elsewhere), else where the test was built.
fn root() -> &'static Path {
    if Path::new("docs/cudnn-graphs.md").is_file() {
        Path::new(".")
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR"))
    }
}

#[test]
fn every_cited_docs_section_exists() {
    let root = root();
    let doc = std::fs::read_to_string(root.join("docs/cudnn-graphs.md")).unwrap();
    // Headings look like `## 5. Backward` or `### 5.2 Data gradient ...`.
    let sections: Vec<String> = doc
        .lines()
        .filter(|l| l.starts_with('#'))
        .filter_map(|l| l.trim_start_matches('#').split_whitespace().next())
        .map(|s| s.trim_end_matches('.').to_string())
        .collect();
    let mut files = Vec::new();
    for dir in ["src", "crates", "tools", "tests", "examples", "benches"] {
        sources(&root.join(dir), &["rs"], &mut files);
    }
    let mut cited = 0;
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (i, _) in text.match_indices("docs/cudnn-graphs.md §") {
            let rest = &text[i + "docs/cudnn-graphs.md §".len()..];
            let number: String = rest
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            let number = number.trim_end_matches('.');
            if number.is_empty() {
                continue; // this file's own search pattern
            }
            assert!(
                sections.iter().any(|s| s == number),
                "{} cites §{number}, which docs/cudnn-graphs.md does not have ({sections:?})",
                file.display()
            );
            cited += 1;
        }
    }
    assert!(
        cited >= 10,
        "only {cited} citations found: is the scan looking in the right place?"
    );
}

/// The first folders of the paths a citation names from the repository's root (or, inside a
/// crate, from the crate's folder).
const PATH_ROOTS: [&str; 8] = [
    "docs/",
    "crates/",
    "tools/",
    "scripts/",
    "tests/",
    "src/",
    "benches/",
    "examples/",
];

/// The comment text of a source file (all of it for Markdown): what follows `//` or `/*` in
/// Rust and C-family files, `#` in shell, Python and TOML files (a rough cut, enough to find
/// citations: a `//` or `#` inside a string counts as a comment).
fn comments(path: &Path, text: &str) -> String {
    let ext = path.extension().unwrap().to_string_lossy();
    if ext == "md" {
        return text.to_string();
    }
    let hash = matches!(ext.as_ref(), "sh" | "py" | "toml");
    let mut out = String::new();
    let mut in_block = false;
    for line in text.lines() {
        let mut rest = line;
        if in_block {
            match rest.find("*/") {
                Some(end) => {
                    out.push_str(&rest[..end]);
                    rest = &rest[end + 2..];
                    in_block = false;
                }
                None => {
                    out.push_str(rest);
                    out.push('\n');
                    continue;
                }
            }
        }
        if hash {
            if let Some(at) = rest.find('#') {
                out.push_str(&rest[at + 1..]);
            }
        } else if let Some(at) = rest.find("//") {
            out.push_str(&rest[at + 2..]);
        } else if let Some(at) = rest.find("/*") {
            let body = &rest[at + 2..];
            match body.find("*/") {
                Some(end) => out.push_str(&body[..end]),
                None => {
                    out.push_str(body);
                    in_block = true;
                }
            }
        }
        out.push('\n');
    }
    out
}

/// The repository paths `text` cites: words made of path characters that start with one of
/// [`PATH_ROOTS`] or are a bare upper-case Markdown name (`README.md`). A word that starts
/// inside another path or a URL (`/abs/src/x`, `https://host/docs/x`, `$root/tests`) is not
/// one, nor is a pattern (`tests/gpu_*`, `{a,b}`, `<name>`) or a path climbing out (`../x`).
fn cited_paths(text: &str) -> Vec<String> {
    let is_path_char = |c: char| c.is_ascii_alphanumeric() || "_./-*{}<>$~@+=".contains(c);
    let mut out = Vec::new();
    for word in text.split(|c: char| !is_path_char(c)) {
        if word.contains(|c: char| "*{}<>$~@+=".contains(c)) || word.contains("..") {
            continue;
        }
        let word = word.trim_end_matches(['.', '-']);
        let rooted = PATH_ROOTS
            .iter()
            .any(|r| word.starts_with(r) && word.len() > r.len());
        let stem = word.strip_suffix(".md").unwrap_or("");
        let upper_md = stem.starts_with(|c: char| c.is_ascii_uppercase())
            && stem
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_' || c == '-');
        if rooted || upper_md {
            out.push(word.to_string());
        }
    }
    out
}

/// The folder of the crate `file` belongs to (the nearest folder above it with a
/// `Cargo.toml`).
fn crate_dir(file: &Path) -> Option<&Path> {
    file.ancestors()
        .skip(1)
        .find(|dir| dir.join("Cargo.toml").is_file())
}

#[test]
fn every_cited_path_exists() {
    let root = root();
    let mut files = Vec::new();
    let exts = ["rs", "sh", "cu", "cuh", "cc", "h", "c", "py", "toml"];
    for dir in [
        "src", "crates", "tools", "tests", "examples", "benches", "scripts",
    ] {
        sources(&root.join(dir), &exts, &mut files);
    }
    sources(&root.join("docs"), &["md"], &mut files);
    files.push(root.join("README.md"));
    files.push(root.join("Cargo.toml"));
    let mut missing = Vec::new();
    let mut cited = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let crate_dir = crate_dir(file);
        for path in cited_paths(&comments(file, &text)) {
            cited += 1;
            let found =
                root.join(&path).exists() || crate_dir.is_some_and(|dir| dir.join(&path).exists());
            if !found {
                let shown = file.strip_prefix(root).unwrap_or(file);
                missing.push(format!("{} cites {path}", shown.display()));
            }
        }
    }
    missing.sort();
    missing.dedup();
    assert!(
        missing.is_empty(),
        "{} cited paths do not exist:\n{}",
        missing.len(),
        missing.join("\n")
    );
    assert!(
        cited >= 100,
        "only {cited} cited paths found: is the scan looking in the right place?"
    );
}
