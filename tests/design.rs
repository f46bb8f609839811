//! `docs/design.md`, the map of the tree, stays true: what a program can check of it is
//! checked here.
//! - The tree: every file it names exists, and every source file of `src/` is named. In a row
//!   naming several files, a path after the first is relative to the first one's folder
//!   unless it starts with `src/`.
//! - The shapes: its table of shapes names each variant of `Quota`, and their files exist.
//! - State identity: every key suffix of `backend/redis/keys.rs` is named.
//! - The MUST list of a new shape names the number of files and folders it says, each one that exists
//!   (`<shape>` read as each shape's file), and the same files as the list on the `Quota` enum.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests' crate is a folder of the repository")
        .to_path_buf()
}

fn read(path: &str) -> String {
    fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The text of `page` from the line starting with `from` to the next line starting with `to`.
fn section<'a>(page: &'a str, from: &str, to: &str) -> &'a str {
    let start = page
        .find(from)
        .unwrap_or_else(|| panic!("design.md has no {from:?}"));
    let rest = &page[start + from.len()..];
    let end = rest.find(to).unwrap_or(rest.len());
    &rest[..end]
}

/// The `code` spans of `text`, in order.
fn spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// The files one row of the tree names: its first cell's spans, each after the first relative
/// to the first one's folder.
fn row_files(row: &str) -> Vec<String> {
    let cell = row.split('|').nth(1).unwrap_or("");
    let names = spans(cell);
    let Some(first) = names.first() else {
        return Vec::new();
    };
    let folder = Path::new(first).parent().unwrap_or(Path::new(""));
    let mut files = vec![first.trim_end_matches('/').to_string()];
    for name in &names[1..] {
        let file = if name.starts_with("src/") {
            Path::new(name).to_path_buf()
        } else {
            folder.join(name)
        };
        files.push(file.to_string_lossy().into_owned());
    }
    files
}

fn tree_files() -> Vec<String> {
    let page = read("docs/design.md");
    section(&page, "## The tree", "\n## ")
        .lines()
        .filter(|line| line.starts_with("| `"))
        .flat_map(row_files)
        .collect()
}

fn source_files(dir: &Path, out: &mut BTreeSet<String>) {
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            source_files(&path, out);
        } else {
            let relative = path.strip_prefix(root()).expect("under the root");
            out.insert(relative.to_string_lossy().into_owned());
        }
    }
}

#[test]
fn every_file_the_tree_names_exists_and_every_source_file_is_named() {
    let named = tree_files();
    let missing: Vec<&String> = named.iter().filter(|f| !root().join(f).exists()).collect();
    assert!(
        missing.is_empty(),
        "design.md names files that are not there: {missing:?}"
    );
    let mut sources = BTreeSet::new();
    source_files(&root().join("src"), &mut sources);
    let named: BTreeSet<&str> = named.iter().map(String::as_str).collect();
    let unnamed: Vec<&String> = sources
        .iter()
        .filter(|f| !named.contains(f.as_str()))
        .collect();
    assert!(
        unnamed.is_empty(),
        "design.md's tree does not name: {unnamed:?}"
    );
}

/// The variants of `pub enum Quota`, read from its source.
fn quota_variants() -> Vec<String> {
    let source = read("src/quota/mod.rs");
    let body = section(&source, "pub enum Quota {", "\n}");
    body.lines()
        .map(str::trim)
        .filter(|line| !line.starts_with("///") && !line.is_empty())
        .filter_map(|line| line.split('(').next())
        .map(str::to_string)
        .collect()
}

#[test]
fn the_table_of_shapes_names_every_variant_and_its_files() {
    let page = read("docs/design.md");
    let table = section(&page, "## The shapes", "\n## ");
    let rows: Vec<Vec<&str>> = table
        .lines()
        .filter(|line| line.starts_with("| `Quota::"))
        .map(spans)
        .collect();
    let listed: Vec<String> = rows
        .iter()
        .map(|row| row[0].trim_start_matches("Quota::").to_string())
        .collect();
    assert_eq!(
        listed,
        quota_variants(),
        "the table of shapes against `pub enum Quota`"
    );
    for row in &rows {
        for file in row
            .iter()
            .filter(|s| s.ends_with(".rs") || s.ends_with(".md"))
        {
            assert!(
                root().join(file).exists(),
                "{}: {file} is not there",
                row[0]
            );
        }
    }
}

#[test]
fn state_identity_names_every_key_suffix() {
    let keys = read("src/backend/redis/keys.rs");
    let suffixes: Vec<&str> = keys
        .lines()
        .filter(|line| line.contains("_SUFFIX: &str = \""))
        .filter_map(|line| line.split('"').nth(1))
        .collect();
    assert!(suffixes.len() >= 7, "keys.rs's suffixes: {suffixes:?}");
    let page = read("docs/design.md");
    let identity = section(&page, "## State identity", "\n## ");
    let named = spans(identity);
    for suffix in suffixes {
        let after_the_tag = format!("}}{suffix}");
        assert!(
            named
                .iter()
                .any(|s| *s == suffix || s.ends_with(&after_the_tag)),
            "State identity does not name the suffix `{suffix}`"
        );
    }
}

/// The files under `src/` that `text` names, `<shape>` read as `shape`.
fn named_sources(text: &str, shape: &str) -> BTreeSet<String> {
    spans(text)
        .into_iter()
        .filter(|s| s.starts_with("src/") && (s.ends_with(".rs") || s.ends_with(".lua")))
        .map(|s| s.replace("<shape>", shape))
        .collect()
}

#[test]
fn the_must_list_of_a_new_shape_is_whole_and_the_same_as_the_enum_s() {
    let page = read("docs/design.md");
    let list = section(
        &page,
        "**A new limit shape: MUST update**",
        "What the seam offers",
    );
    let items = section(list, "\n  1. ", "\n  7. ");
    let files = named_sources(items, "fair_share");
    let missing: Vec<&String> = files.iter().filter(|f| !root().join(f).exists()).collect();
    assert!(
        missing.is_empty(),
        "the MUST list names files that are not there: {missing:?}"
    );

    // The number the list writes after `before`.
    let stated = |before: &str| -> usize {
        list.split(before)
            .nth(1)
            .and_then(|s| s.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("the MUST list says \"{before}N\""))
    };
    assert_eq!(
        files.len(),
        stated("names "),
        "the MUST list names {files:?}"
    );

    let folders: BTreeSet<&str> = files
        .iter()
        .filter_map(|f| f.rsplit_once('/').map(|(folder, _)| folder))
        .collect();
    assert_eq!(
        folders.len(),
        stated(" files in "),
        "the MUST list's folders: {folders:?}"
    );

    let source = read("src/quota/mod.rs");
    let on_enum = section(&source, "every place it MUST be added", "#[derive");
    assert_eq!(
        named_sources(on_enum, "fair_share"),
        files,
        "the list on `Quota` and design.md's name different files"
    );
}

/// The variants of `pub enum Stored` (the kit's states), read from its source.
fn stored_variants() -> Vec<String> {
    let source = read("src/backend/kit/mod.rs");
    let body = section(&source, "pub enum Stored {", "\n}");
    body.lines()
        .map(str::trim)
        .filter(|line| !line.starts_with("///") && !line.starts_with("#[") && !line.is_empty())
        .filter_map(|line| line.split('(').next())
        .map(str::to_string)
        .collect()
}

/// The dry run of a new shape: every Rust file of `src/` and the simulator that names every
/// shape (each variant of `Quota`, or of `ShapeRef` outside the crate, or each of the kit's
/// states) is a site the compiler lists for a new one, and the MUST list names it. Run with
/// `--nocapture` to see the sites.
#[test]
fn every_file_that_names_every_shape_is_in_the_must_list() {
    let page = read("docs/design.md");
    let list = section(
        &page,
        "**A new limit shape: MUST update**",
        "What the seam offers",
    );
    let (shapes, states) = (quota_variants(), stored_variants());
    let names_all = |text: &str, kinds: &[&str], variants: &[String]| {
        variants.iter().all(|v| {
            kinds.iter().any(|k| {
                let at = format!("{k}::{v}");
                text.match_indices(&at).any(|(i, _)| {
                    !text[i + at.len()..].starts_with(|c: char| c.is_alphanumeric() || c == '_')
                })
            })
        })
    };
    let mut sources = BTreeSet::new();
    source_files(&root().join("src"), &mut sources);
    source_files(&root().join("simulator/src"), &mut sources);
    let sites: Vec<&String> = sources
        .iter()
        .filter(|f| f.ends_with(".rs") && !f.ends_with("tests.rs") && !f.contains("/tests/"))
        .filter(|f| {
            let text = read(f);
            names_all(&text, &["Quota", "ShapeRef"], &shapes)
                || names_all(&text, &["Stored", "Read"], &states)
        })
        .collect();
    eprintln!("the sites that name every shape: {sites:#?}");
    assert!(sites.len() >= 5, "the scan finds the sites: {sites:?}");
    let unlisted: Vec<&&String> = sites
        .iter()
        .filter(|f| !list.contains(f.as_str()))
        .collect();
    assert!(
        unlisted.is_empty(),
        "files that name every shape but not in design.md's MUST list: {unlisted:?}"
    );
}
