//! The documentation's links stay inside the repository: every relative link of every markdown file (README,
//! ARCHITECTURE, `docs/`, `deploy/`, …) names a file or directory that exists in the repository, never a path
//! that escapes it (`../shared/…`); a `#fragment` names a heading of its target file. Links to public URLs
//! (`https://…`) are not followed.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

use fleet_e2e_client::workspace_root;

/// Every `*.md` file of the repository, outside build output, vendored code and hidden directories.
fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().filter_map(Result::ok) {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !name.starts_with('.') && !matches!(name.as_str(), "target" | "third_party" | "node_modules") {
                markdown_files(&path, out);
            }
        } else if name.ends_with(".md") {
            out.push(path);
        }
    }
}

/// The lines of a markdown text outside fenced code blocks (the fences themselves excluded).
fn unfenced_lines(text: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    text.lines().filter(move |line| {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            return false;
        }
        !fenced
    })
}

/// The inline code spans of `text` outside fenced blocks that name a path climbing out of their file's
/// directory (`../…`): prose must not point outside the repository either, link or not.
fn climbing_code_spans(text: &str) -> Vec<String> {
    let mut spans = Vec::new();
    for line in unfenced_lines(text) {
        for (i, span) in line.split('`').enumerate() {
            if i % 2 == 1 && span.starts_with("../") && !span.contains(char::is_whitespace) {
                spans.push(span.to_owned());
            }
        }
    }
    spans
}

/// The markdown text without fenced code blocks and inline code spans (links there are not links).
fn prose(text: &str) -> String {
    let mut out = String::new();
    for line in unfenced_lines(text) {
        let mut in_code = false;
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
            } else if !in_code {
                out.push(c);
            }
        }
        out.push('\n');
    }
    out
}

/// The targets of inline links `[text](target)` and reference definitions `[label]: target`.
fn link_targets(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("](") {
        let start = i + at + 2;
        let mut depth = 1;
        let mut end = start;
        while end < bytes.len() && bytes[end] != b'\n' {
            match bytes[end] {
                b'(' => depth += 1,
                b')' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                _ => {}
            }
            end += 1;
        }
        let raw = text[start..end].trim();
        let target = match raw.strip_prefix('<').and_then(|r| r.split_once('>')) {
            Some((bracketed, _)) => bracketed,
            None => raw.split_whitespace().next().unwrap_or_default(),
        };
        targets.push(target.to_owned());
        i = end.max(start);
    }
    for line in text.lines() {
        let line = line.trim_start();
        if let Some(rest) = line.strip_prefix('[')
            && let Some((_, target)) = rest.split_once("]: ")
        {
            targets.push(target.split_whitespace().next().unwrap_or_default().to_owned());
        }
    }
    targets
}

/// GitHub's anchor of a heading: lower case, punctuation dropped but `-` and `_`, spaces → `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a markdown file's headings (with GitHub's `-1`, `-2` suffixes for repeats).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for line in unfenced_lines(text) {
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let heading = heading.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let base = anchor(heading);
        let mut candidate = base.clone();
        let mut n = 0;
        while seen.contains(&candidate) {
            n += 1;
            candidate = format!("{base}-{n}");
        }
        seen.insert(candidate);
    }
    seen
}

/// `path` with `.` and `..` resolved lexically; `None` when it climbs above the root.
fn normalise(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::Normal(p) => out.push(p),
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// What is wrong with `target`, a link in `file` (relative to the repository root), if anything.
fn check(root: &Path, file: &Path, target: &str) -> Option<String> {
    if target.is_empty() {
        return Some("empty link".into());
    }
    if let Some((scheme, _)) = target.split_once(':')
        && !scheme.is_empty()
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
    {
        return match scheme {
            "https" | "http" | "mailto" => None,
            other => Some(format!("scheme {other:?} is not a public URL")),
        };
    }
    let (path, fragment) = match target.split_once('#') {
        Some((p, f)) => (p, Some(f)),
        None => (target, None),
    };
    if path.starts_with('/') {
        return Some("absolute path (use a path relative to the file)".into());
    }
    let resolved = if path.is_empty() {
        file.to_path_buf()
    } else {
        let Some(r) = normalise(&file.parent().unwrap_or(Path::new("")).join(path)) else {
            return Some("escapes the repository".into());
        };
        r
    };
    let on_disk = root.join(&resolved);
    if !on_disk.exists() {
        return Some(format!("{} does not exist", resolved.display()));
    }
    if let Some(fragment) = fragment
        && on_disk.is_file()
        && resolved.extension().is_some_and(|e| e == "md")
    {
        let text = std::fs::read_to_string(&on_disk).unwrap();
        if !anchors(&text).contains(fragment) {
            return Some(format!("{} has no heading #{fragment}", resolved.display()));
        }
    }
    None
}

#[test]
fn every_relative_link_of_the_documentation_names_a_file_of_the_repository() {
    let root = workspace_root();
    let mut files = Vec::new();
    markdown_files(&root, &mut files);
    files.sort();
    assert!(
        files.iter().any(|f| f.ends_with("README.md")) && files.iter().any(|f| f.ends_with("docs/api.md")),
        "the walk found the documentation: {files:?}"
    );
    let mut broken = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&root).unwrap();
        let raw = std::fs::read_to_string(file).unwrap();
        for target in link_targets(&prose(&raw)) {
            if let Some(why) = check(&root, relative, &target) {
                broken.push(format!("{}: ({target}): {why}", relative.display()));
            }
        }
        for span in climbing_code_spans(&raw) {
            if normalise(&relative.parent().unwrap_or(Path::new("")).join(&span)).is_none() {
                broken.push(format!(
                    "{}: `{span}`: a path outside the repository",
                    relative.display()
                ));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "broken or escaping links:\n{}",
        broken.join("\n")
    );
}

#[test]
fn the_checker_refuses_what_it_should() {
    let root = workspace_root();
    let readme = Path::new("README.md");
    assert!(check(&root, readme, "../shared/spec/executa-host.md").is_some());
    assert!(check(&root, Path::new("docs/api.md"), "../../shared/design.md").is_some());
    assert!(check(&root, readme, "docs/no-such-file.md").is_some());
    assert!(check(&root, readme, "/etc/passwd").is_some());
    assert!(check(&root, readme, "file:///etc/passwd").is_some());
    assert!(check(&root, readme, "docs/api.md#no-such-heading").is_some());
    assert!(check(&root, readme, "docs/api.md#error-codes").is_none());
    assert!(check(&root, readme, "https://docs.nats.io/").is_none());
    assert!(check(&root, Path::new("docs/operations.md"), "../deploy/helm/README.md").is_none());
    assert_eq!(
        anchor("Sampling and embeddings (`[llm]`)"),
        "sampling-and-embeddings-llm"
    );
    assert_eq!(
        anchor("Worker TOML (`fleet worker --config FILE`)"),
        "worker-toml-fleet-worker---config-file"
    );
    assert_eq!(
        link_targets("see [a](x.md#y) and [b](<z w.md>)\n[c]: https://e.org"),
        ["x.md#y", "z w.md", "https://e.org"]
    );
    assert_eq!(prose("a `[x](gone.md)` b\n```\n[y](gone.md)\n```\n"), "a  b\n");
    assert_eq!(
        climbing_code_spans("see `../shared/spec.md` and `x`\n```\n`../in/fence`\n```\n"),
        ["../shared/spec.md"]
    );
}
