//! The metrics page (`docs/src/operations/health-and-metrics.md`) against
//! the code: every series the code registers is named on the page, and every
//! series the page names is one the code registers.
//!
//! The code's series are read from its source text (`src/` and the other
//! crates' `src/`), outside comments: the names given to `counter!`,
//! `gauge!` and `histogram!` (as a string or as a `const` holding one), and
//! those the table gauges write after `# TYPE`. Every other string that
//! starts with `onejob_` must be one of [`NOT_METRICS`], so that a series
//! registered some other way fails here until the test learns to read it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Strings in the code that start with `onejob_` and are not series, with
/// what they are.
const NOT_METRICS: &[(&str, &str)] = &[
    ("onejob_console", "the console's session cookie"),
    ("onejob_login", "the console's sign-in cookie"),
    (
        "onejob_attempt",
        "a metadata key every provider call carries",
    ),
    ("onejob_job", "a metadata key every provider call carries"),
    (
        "onejob_batch",
        "the metadata key that names onejob's batch on a provider's batch",
    ),
];

/// The macros that register a series, by their first argument.
const MACROS: [&str; 3] = ["counter!(", "gauge!(", "histogram!("];

/// The source folders of the workspace's crates.
const SOURCES: [&str; 4] = ["src", "core/src", "producer/src", "worker/src"];

/// A Rust source file read into code (comments dropped) and string
/// literals, in order.
#[derive(Debug)]
enum Piece {
    Code(String),
    Text(String),
}

/// Splits Rust source into code and string literals, dropping comments. Raw
/// strings (`r#"…"#`) and char literals (`'"'`) are read as such; a string's
/// escapes are kept as written.
fn pieces(source: &str) -> Vec<Piece> {
    let chars: Vec<char> = source.chars().collect();
    let mut out = Vec::new();
    let mut code = String::new();
    let mut i = 0;
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            i += 2;
            while i + 1 < chars.len() && !(chars[i] == '*' && chars[i + 1] == '/') {
                i += 1;
            }
            i += 2;
        } else if c == 'r'
            && !(i > 0 && ident(chars[i - 1]))
            && matches!(next, Some('"' | '#'))
            && {
                let hashes = chars[i + 1..].iter().take_while(|c| **c == '#').count();
                chars.get(i + 1 + hashes) == Some(&'"')
            }
        {
            let hashes = chars[i + 1..].iter().take_while(|c| **c == '#').count();
            let start = i + 2 + hashes;
            let close: Vec<char> = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            let mut end = start;
            while end < chars.len() && !chars[end..].starts_with(&close) {
                end += 1;
            }
            out.push(Piece::Code(std::mem::take(&mut code)));
            out.push(Piece::Text(chars[start..end].iter().collect()));
            i = end + close.len();
        } else if c == '"' {
            let mut end = i + 1;
            while end < chars.len() && chars[end] != '"' {
                end += if chars[end] == '\\' { 2 } else { 1 };
            }
            out.push(Piece::Code(std::mem::take(&mut code)));
            out.push(Piece::Text(
                chars[i + 1..end.min(chars.len())].iter().collect(),
            ));
            i = end + 1;
        } else if c == '\'' {
            // A char literal (`'"'`, `'\''`), or a lifetime's quote.
            let len = match (next, chars.get(i + 2)) {
                (Some('\\'), _) => chars[i + 2..]
                    .iter()
                    .skip(1)
                    .position(|c| *c == '\'')
                    .map(|p| p + 4),
                (Some(_), Some('\'')) => Some(3),
                _ => None,
            };
            match len {
                Some(len) => {
                    code.push_str("' '");
                    i += len;
                }
                None => {
                    code.push(c);
                    i += 1;
                }
            }
        } else {
            code.push(c);
            i += 1;
        }
    }
    out.push(Piece::Code(code));
    out
}

/// The series name at the start of `text` (`onejob_jobs{{status…`).
fn leading_name(text: &str) -> Option<&str> {
    let end = text
        .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
        .unwrap_or(text.len());
    text[..end]
        .strip_prefix("onejob_")
        .filter(|rest| !rest.is_empty())
        .map(|_| &text[..end])
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("a folder entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// What the code says: the series it registers, and every other string that
/// starts with `onejob_`, each with the file it is in.
#[derive(Debug, Default)]
struct Code {
    series: BTreeMap<String, String>,
    others: BTreeMap<String, String>,
}

fn code() -> Code {
    let mut registered = BTreeMap::new();
    let mut leading = BTreeMap::new();
    // `const NAME: &str = "onejob_…"`, and the constants a macro names.
    let mut consts = BTreeMap::new();
    let mut named = Vec::new();
    for dir in SOURCES {
        for path in rust_files(&super::root().join(dir)) {
            let file = super::shown(&path);
            let pieces = pieces(&super::read(&path));
            for (k, piece) in pieces.iter().enumerate() {
                match piece {
                    Piece::Text(text) => {
                        let before = match k.checked_sub(1).map(|k| &pieces[k]) {
                            Some(Piece::Code(code)) => code.trim_end(),
                            _ => "",
                        };
                        if let Some(name) = leading_name(text) {
                            leading.insert(name.to_owned(), file.clone());
                            if MACROS.iter().any(|m| before.ends_with(m)) {
                                registered.insert(name.to_owned(), file.clone());
                            }
                            if let Some(decl) = before.strip_suffix(": &str =")
                                && let Some((_, constant)) = decl.rsplit_once("const ")
                            {
                                consts.insert(constant.trim().to_owned(), name.to_owned());
                            }
                        }
                        for (at, line) in text.match_indices("# TYPE ") {
                            if let Some(name) = leading_name(&text[at + line.len()..]) {
                                registered.insert(name.to_owned(), file.clone());
                            }
                        }
                    }
                    Piece::Code(code) => {
                        for m in MACROS {
                            for (at, _) in code.match_indices(m) {
                                let arg = code[at + m.len()..].trim_start();
                                let end = arg
                                    .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                                    .unwrap_or(arg.len());
                                let path = &arg[..end];
                                if let Some(last) = path.rsplit("::").next()
                                    && !last.is_empty()
                                {
                                    named.push((last.to_owned(), file.clone()));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    for (constant, file) in named {
        if let Some(name) = consts.get(&constant) {
            registered.insert(name.clone(), file);
        }
    }
    let others = leading
        .into_iter()
        .filter(|(name, _)| !registered.contains_key(name))
        .collect();
    Code {
        series: registered,
        others,
    }
}

/// Every `onejob_…` name on the metrics page, with its first line.
fn documented() -> BTreeMap<String, usize> {
    let page = super::read(&super::book().join("operations/health-and-metrics.md"));
    let mut out = BTreeMap::new();
    for (n, line) in page.lines().enumerate() {
        for (at, _) in line.match_indices("onejob_") {
            if at > 0 && line[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                continue;
            }
            if let Some(name) = leading_name(&line[at..]) {
                out.entry(name.to_owned()).or_insert(n + 1);
            }
        }
    }
    out
}

#[test]
fn every_string_in_the_code_that_starts_with_onejob_is_a_series_or_known() {
    let code = code();
    assert!(
        code.series.len() > 25,
        "only {} series read from the code: {:?}",
        code.series.len(),
        code.series.keys()
    );
    let known: BTreeSet<&str> = NOT_METRICS.iter().map(|(name, _)| *name).collect();
    let mut wrong = Vec::new();
    for (name, file) in &code.others {
        if !known.contains(name.as_str()) {
            wrong.push(format!(
                "{file}: {name:?} starts with onejob_ but is registered by no counter!, gauge!, \
                 histogram! nor # TYPE line this test reads: a series registered another way \
                 (teach the test), or not one (add it to NOT_METRICS)"
            ));
        }
    }
    for (name, what) in NOT_METRICS {
        if code.series.contains_key(*name) {
            wrong.push(format!(
                "{name}: NOT_METRICS says {what}, but the code registers it as a series"
            ));
        } else if !code.others.contains_key(*name) {
            wrong.push(format!(
                "{name}: in NOT_METRICS ({what}), but no longer in the code"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_series_the_code_registers_is_on_the_metrics_page_and_back() {
    let code = code();
    let page = documented();
    let mut wrong = Vec::new();
    for (name, file) in &code.series {
        if !page.contains_key(name) {
            wrong.push(format!(
                "{name} ({file}) is registered but not on operations/health-and-metrics.md"
            ));
        }
    }
    for (name, line) in &page {
        // A histogram's own series (`_bucket`, `_sum`, `_count`) are its.
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .filter(|base| code.series.contains_key(*base));
        if !code.series.contains_key(name) && base.is_none() {
            wrong.push(format!(
                "health-and-metrics.md:{line}: {name} is no series the code registers"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
