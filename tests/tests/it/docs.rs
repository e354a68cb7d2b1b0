//! The documentation's relative links resolve: every link and image in
//! README.md, CHANGELOG.md, docs/**/*.md, helm/sluice/README.md and the
//! READMEs under examples/ and sdks/ names a file or directory of the
//! repository, and an `#anchor` names a heading of the page it points to
//! (GitHub's anchors). Links to other sites are not followed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Markdown pages checked.
fn pages(root: &Path) -> Vec<PathBuf> {
    let mut pages = vec![
        root.join("README.md"),
        root.join("CHANGELOG.md"),
        root.join("helm/sluice/README.md"),
    ];
    collect(&root.join("docs"), &mut pages, &|name| name.ends_with(".md"));
    for tree in ["examples", "sdks"] {
        collect(&root.join(tree), &mut pages, &|name| name == "README.md");
    }
    pages.retain(|page| page.is_file());
    pages.sort();
    pages
}

fn collect(dir: &Path, pages: &mut Vec<PathBuf>, wanted: &dyn Fn(&str) -> bool) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().to_string();
        if path.is_dir() {
            // Build output, installed packages and generated stubs hold no docs of ours.
            let skipped = ["target", "node_modules", "generated", "dist", "build"];
            if !name.starts_with('.') && !skipped.contains(&name.as_str()) {
                collect(&path, pages, wanted);
            }
        } else if wanted(&name) {
            pages.push(path);
        }
    }
}

/// Each line of `text` outside fenced code blocks, with its number, and
/// with inline code spans (which may wrap within a paragraph) left out.
fn prose_lines(text: &str) -> Vec<(usize, String)> {
    let mut lines = Vec::new();
    let mut fence: Option<&str> = None;
    let mut in_code = false;
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            in_code = false;
        }
        let trimmed = line.trim_start();
        if let Some(open) = fence {
            if trimmed.starts_with(open) {
                fence = None;
            }
            continue;
        }
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fence = Some(&trimmed[..3]);
            continue;
        }
        let mut prose = String::new();
        for character in line.chars() {
            if character == '`' {
                in_code = !in_code;
            } else if !in_code {
                prose.push(character);
            }
        }
        lines.push((index + 1, prose));
    }
    lines
}

/// The targets of `[text](target)`, `![alt](target)` and `[label]: target`.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (number, line) in prose_lines(text) {
        let trimmed = line.trim_start();
        if trimmed.starts_with('[') {
            if let Some((_, target)) = trimmed.split_once("]: ") {
                found.push((number, first_token(target)));
                continue;
            }
        }
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            found.push((number, first_token(&after[..end])));
            rest = &after[end..];
        }
    }
    found
}

fn first_token(target: &str) -> String {
    let token = target.split_whitespace().next().unwrap_or_default();
    token.trim_start_matches('<').trim_end_matches('>').to_string()
}

/// GitHub's anchor of a heading: lower case, spaces to `-`, punctuation
/// other than `-` and `_` dropped.
fn slug(heading: &str) -> String {
    let mut slug = String::new();
    for character in heading.trim().to_lowercase().chars() {
        if character.is_alphanumeric() || character == '-' || character == '_' {
            slug.push(character);
        } else if character == ' ' {
            slug.push('-');
        }
    }
    slug
}

/// The anchors of a page's headings (a repeated heading gets `-1`, `-2`, …).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut anchors = BTreeSet::new();
    // Headings keep their code spans' text: read the raw lines, skipping fences.
    let mut in_fence = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        let level = trimmed.chars().take_while(|character| *character == '#').count();
        if level == 0 || level > 6 || !trimmed[level..].starts_with(' ') {
            continue;
        }
        // A link in a heading counts by its text.
        let heading = trimmed[level..].replace('`', "");
        let heading = match heading.split_once("](") {
            Some((text, _)) => text.replace('[', ""),
            None => heading,
        };
        let base = slug(&heading);
        let mut anchor = base.clone();
        let mut repeat = 0;
        while anchors.contains(&anchor) {
            repeat += 1;
            anchor = format!("{base}-{repeat}");
        }
        anchors.insert(anchor);
    }
    anchors
}

/// What is wrong with each relative link of `page`, if anything.
fn broken_links(root: &Path, page: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(page).unwrap_or_default();
    let shown = page.strip_prefix(root).unwrap_or(page).display().to_string();
    let mut broken = Vec::new();
    for (line, target) in links(&text) {
        if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((path, anchor)) => (path, Some(anchor)),
            None => (target.as_str(), None),
        };
        let path = path.replace("%20", " ");
        let resolved = if path.is_empty() {
            page.to_path_buf()
        } else if let Some(from_root) = path.strip_prefix('/') {
            root.join(from_root)
        } else {
            page.parent().unwrap_or(root).join(&path)
        };
        if !resolved.exists() {
            broken.push(format!("{shown}:{line}: {target}: no such file"));
            continue;
        }
        let Some(anchor) = anchor else {
            continue;
        };
        if resolved.extension().is_some_and(|extension| extension == "md") {
            let linked = std::fs::read_to_string(&resolved).unwrap_or_default();
            if !anchors(&linked).contains(anchor) {
                broken.push(format!("{shown}:{line}: {target}: no heading with that anchor"));
            }
        }
    }
    broken
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let root = repo_root();
    let pages = pages(&root);
    assert!(
        pages.len() >= 10 && pages.iter().any(|page| page.ends_with("docs/architecture.md")),
        "the pages were not found: {pages:?}"
    );
    let broken: Vec<String> = pages.iter().flat_map(|page| broken_links(&root, page)).collect();
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_checker_finds_links_and_anchors_as_github_does() {
    let page = "# The `Work` stream\n\n## 7. A job's path: five-minute tour\n\n## Twice\n\n## Twice\n\n\
                See [a](docs/a.md#x), ![b](b.png \"title\") and `[not](a link)`.\n\n\
                ```\n[not](in code)\n```\n\n[label]: ../c.md\n";
    let found: Vec<String> = links(page).into_iter().map(|(_, target)| target).collect();
    assert_eq!(found, ["docs/a.md#x", "b.png", "../c.md"]);
    let anchors = anchors(page);
    for anchor in ["the-work-stream", "7-a-jobs-path-five-minute-tour", "twice", "twice-1"] {
        assert!(anchors.contains(anchor), "{anchor} in {anchors:?}");
    }
}
