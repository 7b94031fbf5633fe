//! The command-line reference (`docs/src/reference/cli.md`) against the four
//! programs: every command and flag it names exists, and every command and
//! flag the programs have is named in it.
//!
//! The page names a command by a heading of its words (`### onejob jobs
//! show`) and its flags in the first column of the tables under it; the
//! flags under a program's own heading (`## onejob`) are its global options,
//! taken by every command of that program.

use std::collections::{BTreeMap, BTreeSet};

use super::markdown::{code_spans, heading, prose, row};
use super::programs::{PROGRAMS, command_tree};

/// What the page says of one command.
#[derive(Debug, Default)]
struct Documented {
    line: usize,
    flags: BTreeSet<String>,
}

/// Every command the page names, by program and words, with its flags.
fn documented() -> BTreeMap<(String, Vec<String>), Documented> {
    let page = super::read(&super::book().join("reference/cli.md"));
    let mut out: BTreeMap<(String, Vec<String>), Documented> = BTreeMap::new();
    let mut current: Option<(String, Vec<String>)> = None;
    for (n, line) in prose(&page) {
        if let Some((level, text)) = heading(line) {
            let mut words = text.split_whitespace().map(str::to_owned);
            let program = words.next().unwrap_or_default();
            current = (level >= 2 && PROGRAMS.contains(&program.as_str()))
                .then(|| (program, words.collect()));
            if let Some(key) = &current {
                let entry = out.entry(key.clone()).or_default();
                entry.line = n;
            }
            continue;
        }
        let (Some(key), Some(cells)) = (&current, row(line)) else {
            continue;
        };
        let entry = out.get_mut(key).expect("the current command");
        for span in code_spans(cells[0]) {
            entry.flags.extend(
                span.split_whitespace()
                    .filter(|w| w.starts_with('-'))
                    .map(|w| w.trim_end_matches(',').to_owned()),
            );
        }
    }
    out
}

/// Every command of every program, with its flags.
fn actual() -> BTreeMap<(String, Vec<String>), BTreeSet<String>> {
    let mut out = BTreeMap::new();
    for program in PROGRAMS {
        for (path, help) in command_tree(program) {
            out.insert((program.to_owned(), path), help.flags);
        }
    }
    out
}

/// A command as a reader types it.
fn named((program, words): &(String, Vec<String>)) -> String {
    std::iter::once(program.as_str())
        .chain(words.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The flags the page gives a command: its own and its program's global ones.
fn flags_of(
    docs: &BTreeMap<(String, Vec<String>), Documented>,
    key: &(String, Vec<String>),
) -> BTreeSet<String> {
    let global = docs
        .get(&(key.0.clone(), Vec::new()))
        .map(|d| d.flags.clone())
        .unwrap_or_default();
    let own = docs.get(key).map(|d| d.flags.clone()).unwrap_or_default();
    own.union(&global).cloned().collect()
}

#[test]
fn every_command_and_flag_the_reference_names_exists() {
    let docs = documented();
    let programs = actual();
    let mut wrong = Vec::new();
    for (key, doc) in &docs {
        let Some(flags) = programs.get(key) else {
            wrong.push(format!(
                "cli.md:{}: `{}` is not a command",
                doc.line,
                named(key)
            ));
            continue;
        };
        for flag in &doc.flags {
            // The version flag is the top level's alone.
            let flags = if key.1.is_empty() {
                flags.clone()
            } else {
                flags | &programs[&(key.0.clone(), Vec::new())]
            };
            if !flags.contains(flag) {
                wrong.push(format!(
                    "cli.md:{}: `{}` has no flag {flag}",
                    doc.line,
                    named(key)
                ));
            }
        }
    }
    assert!(
        docs.len() >= 20,
        "too few commands read from cli.md: {docs:?}"
    );
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_command_and_flag_of_the_programs_is_in_the_reference() {
    let docs = documented();
    let programs = actual();
    // A group (`onejob jobs`) has no heading: its commands have them.
    let is_group = |(program, words): &(String, Vec<String>)| {
        programs
            .keys()
            .any(|(p, w)| p == program && w.len() > words.len() && w.starts_with(words))
    };
    let mut missing = Vec::new();
    for (key, flags) in &programs {
        if !docs.contains_key(key) {
            if !is_group(key) {
                missing.push(format!("`{}` has no heading in cli.md", named(key)));
            }
            continue;
        }
        let named_flags = flags_of(&docs, key);
        for flag in flags.difference(&named_flags) {
            missing.push(format!("`{}`: cli.md does not name {flag}", named(key)));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}
