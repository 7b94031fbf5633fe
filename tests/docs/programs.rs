//! The four programs the pages name, and what their `--help` says: their
//! commands and flags, read from the real binaries.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// The programs a page may run.
pub(crate) const PROGRAMS: [&str; 4] = [
    "onejob",
    "onejob-producer",
    "onejob-worker",
    "onejob-mock-provider",
];

pub(crate) use crate::common::binaries::{bin_dir, binary};

/// Runs a program with `args` and `--help`: whether clap took every word
/// before it, and what it printed.
pub(crate) fn help(program: &str, args: &[String]) -> Result<String, String> {
    let out = Command::new(binary(program))
        .args(args)
        .arg("--help")
        .env_remove("RUST_LOG")
        .output()
        .expect("run a program");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    match out.status.success() {
        true => Ok(stdout),
        false => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
    }
}

/// What one command's help says: its subcommands and its flags (`--long`
/// and `-s`).
#[derive(Debug, Default)]
pub(crate) struct Help {
    pub(crate) commands: Vec<String>,
    pub(crate) flags: BTreeSet<String>,
}

/// Reads a help text.
pub(crate) fn parse_help(text: &str) -> Help {
    let mut help = Help::default();
    let mut section = "";
    for line in text.lines() {
        if !line.starts_with(' ') && line.ends_with(':') {
            section = line;
            continue;
        }
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        match section {
            "Commands:" if indent == 2 => {
                let name = trimmed.split_whitespace().next().unwrap_or_default();
                if name != "help" {
                    help.commands.push(name.to_owned());
                }
            }
            "Options:" if trimmed.starts_with('-') && indent <= 6 => {
                for word in trimmed.split([' ', ',']) {
                    if word.starts_with('-') && word.len() > 1 {
                        help.flags.insert(word.to_owned());
                    }
                    if !word.starts_with('-') && !word.is_empty() {
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    help
}

/// Every command of a program, by its words after the program's name (the
/// program itself is the empty path), with its flags.
pub(crate) fn command_tree(program: &str) -> BTreeMap<Vec<String>, Help> {
    let mut tree = BTreeMap::new();
    let mut todo = vec![Vec::<String>::new()];
    while let Some(path) = todo.pop() {
        let text = help(program, &path)
            .unwrap_or_else(|e| panic!("{program} {} --help: {e}", path.join(" ")));
        let help = parse_help(&text);
        for sub in &help.commands {
            let mut next = path.clone();
            next.push(sub.clone());
            todo.push(next);
        }
        tree.insert(path, help);
    }
    tree
}

#[test]
fn help_texts_are_read_whole() {
    let tree = command_tree("onejob");
    let show = &tree[&vec!["jobs".to_owned(), "find".to_owned()]];
    assert!(show.flags.contains("--owner") && show.flags.contains("--key"));
    assert!(tree[&Vec::new()].flags.contains("-V"));
    let console = &tree[&vec!["console".to_owned()]];
    assert!(
        console.flags.contains("--sign-ins-per-minute"),
        "{console:?}"
    );
    let mock = command_tree("onejob-mock-provider");
    assert!(mock[&Vec::new()].flags.contains("--replay"), "{mock:?}");
}
