//! Every fenced code block a reader may paste, in the README and the book:
//! each says what it is; `toml` is configuration the parser takes, `json` is
//! JSON, and every command line runs a command and flags that exist.

use clap::Parser;
use onejob::settings::config::{Config, EMBEDDED_DEFAULT};
use toml::{Table, Value};

use super::markdown::{Block, blocks, prose};
use super::programs::{PROGRAMS, help};
use super::shell::{command_lines, commands};
use super::{pages, read, root, shown};

/// The languages a block may say it is.
const LANGUAGES: [&str; 9] = [
    "text", "console", "sh", "bash", "toml", "json", "rust", "python", "yaml",
];

/// Every block of every page, with where it is.
fn every_block() -> Vec<(String, Block)> {
    pages()
        .iter()
        .flat_map(|p| {
            let name = shown(p);
            blocks(&read(p)).into_iter().map(move |b| (name.clone(), b))
        })
        .collect()
}

#[test]
fn every_block_says_what_it_is() {
    let wrong: Vec<String> = every_block()
        .into_iter()
        .filter(|(_, b)| !LANGUAGES.contains(&b.language()))
        .map(|(page, b)| format!("{page}:{}: a block marked {:?}", b.line, b.info))
        .collect();
    assert!(
        wrong.is_empty(),
        "mark each block with one of {LANGUAGES:?}:\n{}",
        wrong.join("\n")
    );
}

/// `fragment` laid over `base`, table by table.
fn merge(base: &mut Table, fragment: Table) {
    for (key, value) in fragment {
        match (base.get_mut(&key), value) {
            (Some(Value::Table(b)), Value::Table(f)) => merge(b, f),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// Whether a configuration names providers and operations, each operation
/// whole (with its prompt), as a file must.
fn is_whole(table: &Table) -> bool {
    let operations = table.get("operations").and_then(Value::as_table);
    table.contains_key("providers")
        && operations.is_some_and(|ops| {
            ops.values()
                .all(|op| op.as_table().is_some_and(|op| op.contains_key("prompt")))
        })
}

/// A `toml` block as configuration: a whole file when it is one
/// ([`is_whole`]), else a fragment laid over the embedded defaults.
fn check_toml(block: &Block) -> Result<(), String> {
    let table: Table = toml::from_str(&block.text).map_err(|e| format!("not TOML: {e}"))?;
    if block.has("cargo") {
        return Ok(());
    }
    let text = if is_whole(&table) {
        block.text.clone()
    } else {
        let mut base: Table = toml::from_str(EMBEDDED_DEFAULT).expect("the defaults parse");
        merge(&mut base, table);
        toml::to_string(&base).expect("TOML out")
    };
    Config::parse(&text, "the block")
        .map(drop)
        .map_err(|e| e.to_string())
}

#[test]
fn toml_blocks_parse_as_configuration() {
    let mut checked = 0;
    let mut wrong = Vec::new();
    for (page, block) in every_block() {
        if block.language() != "toml" {
            continue;
        }
        checked += 1;
        if let Err(e) = check_toml(&block) {
            wrong.push(format!("{page}:{}: {e}", block.line));
        }
    }
    assert!(checked >= 4, "only {checked} toml blocks found");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn json_blocks_parse() {
    let mut checked = 0;
    let mut wrong = Vec::new();
    for (page, block) in every_block() {
        if block.language() != "json" {
            continue;
        }
        checked += 1;
        if let Err(e) = serde_json::from_str::<serde_json::Value>(&block.text) {
            wrong.push(format!("{page}:{}: {e}", block.line));
        }
    }
    assert!(checked >= 4, "only {checked} json blocks found");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Whether one command, as its words, runs a command and flags that exist.
fn check_command(words: &[String]) -> Result<(), String> {
    let program = words[0].as_str();
    if program.starts_with("scripts/") {
        let path = root().join(program);
        let executable = std::fs::metadata(&path)
            .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0);
        return match executable {
            Ok(true) => Ok(()),
            Ok(false) => Err(format!("{program} is not executable")),
            Err(_) => Err(format!("{program} does not exist")),
        };
    }
    if !PROGRAMS.contains(&program) {
        return Ok(()); // another program: curl, psql, cargo, …
    }
    if program == "onejob" {
        // The CLI's own parser, required arguments and conflicts included.
        return match onejob::operator::cli::Cli::try_parse_from(words) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => Ok(()),
            Err(e) => Err(e.to_string()),
        };
    }
    help(program, &words[1..]).map(drop)
}

#[test]
fn shell_lines_name_commands_and_flags_that_exist() {
    let mut checked = 0;
    let mut wrong = Vec::new();
    for (page, block) in every_block() {
        if !["sh", "bash", "console"].contains(&block.language()) {
            continue;
        }
        for line in command_lines(block.language(), &block.text) {
            for words in commands(&line) {
                checked += 1;
                if let Err(e) = check_command(&words) {
                    let first = e.lines().next().unwrap_or_default().to_owned();
                    wrong.push(format!("{page}:{}: `{line}`: {first}", block.line));
                }
            }
        }
    }
    assert!(checked >= 40, "only {checked} commands found");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The targets of a page's Markdown links, with their lines.
fn links(page: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in prose(page) {
        for piece in line.split("](").skip(1) {
            if let Some(end) = piece.find(')') {
                out.push((n, piece[..end].to_owned()));
            }
        }
    }
    out
}

#[test]
fn the_readme_and_architecture_links_reach_files() {
    let mut wrong = Vec::new();
    for name in ["README.md", "ARCHITECTURE.md"] {
        for (n, target) in links(&read(&root().join(name))) {
            let path = target.split('#').next().unwrap_or_default();
            if target.contains("://") || path.is_empty() {
                continue;
            }
            if !root().join(path).exists() {
                wrong.push(format!("{name}:{n}: {target} does not exist"));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
