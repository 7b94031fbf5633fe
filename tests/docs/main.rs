//! The documentation, held to the code: the README and the book (`docs/src/`)
//! say nothing the programs do not do.
//!
//! One binary, its tests by topic: the configuration reference against the
//! parser (`configuration`), the command-line reference against the programs
//! (`cli`), the metrics page against the series the code registers
//! (`metrics`), every fenced code block a reader may paste (`blocks`), and the
//! README's first job run as written on a fleet of its own (`first_job`).
//! `markdown` reads the pages (fenced blocks, headings, table rows) and
//! `shell` reads the command lines in them; `programs` runs the binaries.
//!
//! A block says what it is by its fence's info string: `text` for output,
//! pictures and synopses (not checked), `console` for a transcript whose
//! commands follow a `$ ` prompt, `sh` or `bash` for commands alone, `toml`
//! for configuration (`toml,cargo` for a `Cargo.toml` fragment), `json`.

use onejob_test_support as common;

mod blocks;
mod cli;
mod configuration;
mod first_job;
mod markdown;
mod metrics;
mod programs;
mod shell;

use std::path::{Path, PathBuf};

/// The repository's root.
fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The book's source folder.
fn book() -> PathBuf {
    root().join("docs/src")
}

/// Every page a reader reads: the README, ARCHITECTURE.md, and every chapter
/// of the book, by path from the root.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md"), root().join("ARCHITECTURE.md")];
    let mut stack = vec![book()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read docs/src") {
            let path = entry.expect("a folder entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    pages.sort();
    pages
}

/// A page's text.
fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A page's path for messages: from the repository's root.
fn shown(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}
