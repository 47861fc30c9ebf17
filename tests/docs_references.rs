//! Comments cite the project's own docs by section (`docs/cudnn-graphs.md §5.2`): every cited
//! section must exist, so a renumbered chapter cannot leave comments pointing nowhere.

use std::path::Path;

fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            let name = path.file_name().unwrap().to_string_lossy();
            if !matches!(name.as_ref(), "target" | ".deps" | ".git" | ".gpu-bundle") {
                sources(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_cited_docs_section_exists() {
    // The working directory when it is the repository (a bundled binary on the GPU machine
    // runs from a copy elsewhere), else where the test was built.
    let root = if Path::new("docs/cudnn-graphs.md").is_file() {
        Path::new(".")
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR"))
    };
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
        sources(&root.join(dir), &mut files);
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
