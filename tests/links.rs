//! Every link of the pages the crate is read from resolves where they are read: README.md on
//! crates.io, the `docs/` pages that `src/lib.rs` renders under `specs` on docs.rs, the others
//! in the package and the repository, and the simulator's README on its own crates.io page.
//!
//! The rules, per link (images and raw HTML `href`/`src` too):
//! - a link into this repository (Cargo.toml's `repository`, as `/blob/main/PATH`,
//!   `/tree/main/PATH` or `raw.githubusercontent.com/.../main/PATH`) names a file or folder the
//!   repository holds, and its `#anchor` a heading of that page;
//! - any other absolute link (`https://`, `http://`, `mailto:`) is left to its site;
//! - `#anchor` alone names a heading of the same page;
//! - a relative path names a file of the page's own package (`cargo package --list`); on a
//!   page docs.rs renders it is refused, since there it would resolve against the module's
//!   address;
//! - `[text][label]` has a definition of `label` (GitHub would show it as plain text).

use std::collections::{BTreeSet, HashSet};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use pulldown_cmark::{BrokenLink, CowStr, Event, LinkType, Options, Parser, Tag, TagEnd};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests' crate is a folder of the repository")
        .to_path_buf()
}

/// The files `cargo package` puts into `package`, as paths relative to its manifest's folder.
fn packaged(package: &str) -> HashSet<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(root())
        .args(["package", "--list", "--allow-dirty", "-p", package])
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo package --list -p {package}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The repository's address, from the library's manifest.
fn repository() -> String {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    manifest
        .lines()
        .find_map(|l| l.strip_prefix("repository = \""))
        .and_then(|l| l.strip_suffix('"'))
        .expect("Cargo.toml names its repository")
        .to_owned()
}

/// The `docs/` pages `src/lib.rs` includes, which docs.rs renders.
fn rendered_on_docs_rs() -> BTreeSet<String> {
    let lib = std::fs::read_to_string(root().join("src/lib.rs")).unwrap();
    lib.split("include_str!(\"../")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .filter(|path| path.starts_with("docs/"))
        .map(str::to_owned)
        .collect()
}

/// GitHub's anchor for a heading: lower case, spaces to `-`, other punctuation dropped, and
/// `-1`, `-2`, ... on repeats.
fn anchors(markdown: &str) -> HashSet<String> {
    let mut seen = HashSet::new();
    let mut heading: Option<String> = None;
    for event in Parser::new_ext(markdown, Options::all()) {
        match event {
            Event::Start(Tag::Heading { .. }) => heading = Some(String::new()),
            Event::Text(t) | Event::Code(t) if heading.is_some() => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                let text = heading.take().unwrap_or_default();
                let slug: String = text
                    .chars()
                    .filter_map(|c| match c {
                        ' ' | '-' => Some('-'),
                        '_' => Some('_'),
                        c if c.is_alphanumeric() => Some(c.to_ascii_lowercase()),
                        _ => None,
                    })
                    .collect();
                let mut anchor = slug.clone();
                let mut n = 0;
                while !seen.insert(anchor.clone()) {
                    n += 1;
                    anchor = format!("{slug}-{n}");
                }
            }
            _ => {}
        }
    }
    seen
}

/// Every link target of a page, with what each is (for messages), and the references that
/// name no definition.
fn links(markdown: &str) -> (Vec<String>, Vec<String>) {
    let mut broken = Vec::new();
    let mut note = |link: BrokenLink<'_>| -> Option<(CowStr<'_>, CowStr<'_>)> {
        // `[5,1,1,0]` alone is data, not a link; `[text][label]` and `[label][]` are links.
        if matches!(link.link_type, LinkType::Reference | LinkType::Collapsed) {
            broken.push(link.reference.to_string());
        }
        None
    };
    let mut targets = Vec::new();
    for event in Parser::new_with_broken_link_callback(markdown, Options::all(), Some(&mut note)) {
        match event {
            Event::Start(Tag::Link { dest_url, .. } | Tag::Image { dest_url, .. }) => {
                targets.push(dest_url.to_string());
            }
            Event::Html(html) | Event::InlineHtml(html) => {
                for attribute in ["href=\"", "src=\""] {
                    for rest in html.split(attribute).skip(1) {
                        if let Some(value) = rest.split('"').next() {
                            targets.push(value.to_owned());
                        }
                    }
                }
            }
            _ => {}
        }
    }
    (targets, broken)
}

/// `dir/../a/./b` as `a/b`; `None` when it climbs out of the repository.
fn normalize(path: &Path) -> Option<String> {
    let mut parts: Vec<String> = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => parts.push(p.to_string_lossy().into_owned()),
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::CurDir => {}
            _ => return None,
        }
    }
    Some(parts.join("/"))
}

/// What is wrong with one link of `page` (a path relative to the repository), if anything.
fn check(
    page: &str,
    target: &str,
    repository: &str,
    package: &HashSet<String>,
    package_dir: &str,
    on_docs_rs: bool,
) -> Option<String> {
    let root = root();
    let heading_of = |file: &str, anchor: &str| -> Option<String> {
        let text = std::fs::read_to_string(root.join(file)).ok()?;
        if anchors(&text).contains(anchor) {
            None
        } else {
            Some(format!("{file} has no heading whose anchor is #{anchor}"))
        }
    };
    let (path, anchor) = match target.split_once('#') {
        Some((p, a)) => (p, Some(a)),
        None => (target, None),
    };
    let raw = repository.replace("https://github.com/", "https://raw.githubusercontent.com/");
    let in_repository = [
        format!("{repository}/blob/main/"),
        format!("{repository}/tree/main/"),
        format!("{raw}/main/"),
    ]
    .into_iter()
    .find_map(|prefix| path.strip_prefix(prefix.as_str()).map(str::to_owned));
    if let Some(file) = in_repository {
        if !root.join(&file).exists() {
            return Some(format!("the repository has no {file}"));
        }
        return anchor.and_then(|a| heading_of(&file, a));
    }
    if path.starts_with(repository) && path != repository {
        return Some("a link into the repository names a path on main (/blob/main/...)".into());
    }
    if path.contains("://") || path.starts_with("mailto:") {
        return None;
    }
    if path.is_empty() {
        return anchor.and_then(|a| heading_of(page, a));
    }
    if on_docs_rs {
        return Some("a relative link is dead on docs.rs: link to the repository".into());
    }
    let folder = Path::new(page).parent().unwrap_or(Path::new(""));
    let Some(file) = normalize(&folder.join(path)) else {
        return Some("it leaves the repository".into());
    };
    let in_package = file
        .strip_prefix(package_dir)
        .map(|f| f.trim_start_matches('/'))
        .filter(|f| package.contains(*f));
    match in_package {
        None => Some(format!(
            "{file} is not in the package, so the link is dead on crates.io: package it or \
             link to the repository"
        )),
        Some(_) => anchor.and_then(|a| heading_of(&file, a)),
    }
}

#[test]
fn every_link_of_the_readme_and_the_docs_resolves_where_it_is_read() {
    let root = root();
    let repository = repository();
    let library = packaged("tower-ratelimits");
    let simulator = packaged("tower-ratelimits-simulator");
    let on_docs_rs = rendered_on_docs_rs();
    assert!(
        on_docs_rs.contains("docs/guide.md") && on_docs_rs.contains("docs/operating.md"),
        "{on_docs_rs:?}"
    );

    let mut pages = vec!["README.md".to_owned()];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") {
            pages.push(format!("docs/{name}"));
        }
    }
    pages.push("simulator/README.md".into());
    pages.sort();

    let mut wrong = Vec::new();
    let mut checked = 0;
    for page in &pages {
        let text = std::fs::read_to_string(root.join(page)).unwrap();
        let (package, dir) = if page.starts_with("simulator/") {
            (&simulator, "simulator")
        } else {
            (&library, "")
        };
        let (targets, broken) = links(&text);
        for label in broken {
            wrong.push(format!("{page}: [{label}] has no definition"));
        }
        for target in targets {
            checked += 1;
            let rendered = on_docs_rs.contains(page.as_str());
            if let Some(why) = check(page, &target, &repository, package, dir, rendered) {
                wrong.push(format!("{page}: {target}: {why}"));
            }
        }
    }
    assert!(wrong.is_empty(), "dead links:\n{}", wrong.join("\n"));
    assert!(
        checked > 30,
        "only {checked} links found: is the parser reading the pages?"
    );
}

/// The checker itself: each kind of dead link is caught, and the good ones pass.
#[test]
fn the_link_check_catches_each_kind_of_dead_link() {
    let repository = repository();
    let package: HashSet<String> = ["README.md", "docs/gcra.md"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    let blob = format!("{repository}/blob/main");
    let good = [
        "https://docs.rs/tower",
        "#units",
        "gcra.md",
        &format!("{blob}/docs/gcra.md"),
        &format!("{blob}/docs/operating.md#sizing"),
        &format!("{repository}/tree/main/examples"),
    ];
    for target in good {
        assert_eq!(
            check("docs/gcra.md", target, &repository, &package, "", false),
            None,
            "{target}"
        );
    }
    let bad = [
        ("BENCHMARKS.md", false),                             // not packaged
        ("../../etc/passwd", false),                          // outside
        ("gcra.md", true),                                    // relative on docs.rs
        ("#no-such-heading", false),                          // anchor
        (&format!("{blob}/docs/nothing.md") as &str, false),  // no such file
        (&format!("{blob}/docs/gcra.md#nowhere"), false),     // no such heading
        (&format!("{repository}/blob/dev/README.md"), false), // not main
    ];
    for (target, rendered) in bad {
        assert!(
            check("docs/gcra.md", target, &repository, &package, "", rendered).is_some(),
            "{target} passed"
        );
    }
    let (_, broken) = links("see [the guide][guide] and [5,1,1,0]\n");
    assert_eq!(broken, ["guide"]);
}
