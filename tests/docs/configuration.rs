//! The configuration reference (`docs/src/reference/configuration.md`)
//! against the parser: every setting it names is accepted, every setting the
//! parser accepts is named in it, every default it gives as a value is the
//! one the parser applies, and every bound it gives a number is the parser's.
//!
//! The page names a table by a heading (`## [worker]`, `## [providers.NAME]`,
//! `### [[operations.NAME.cases]]`) and its settings in the first column of
//! the table under it, the default in the second, what it does in the third
//! (a number's bounds there, each a sentence of its own: `From 1 to 65535.`,
//! `At least 1.`, `At most 5.`, `Each from 100 to 599.`). Its first `toml`
//! block is the whole file, every setting given.

use std::collections::{BTreeMap, BTreeSet};

use onejob::settings::config::{Config, EMBEDDED_DEFAULT};
use toml::{Table, Value};

use super::markdown::{blocks, code_spans, heading, prose, row};

/// One setting the page names: its table (`providers.NAME`), its key, its
/// default cell, what it does, and its line.
#[derive(Debug)]
struct Setting {
    table: String,
    key: String,
    default: String,
    what: String,
    line: usize,
}

fn page() -> String {
    super::read(&super::book().join("reference/configuration.md"))
}

/// Every setting the page's tables name.
fn documented() -> Vec<Setting> {
    let page = page();
    let mut out = Vec::new();
    let mut table: Option<String> = None;
    for (n, line) in prose(&page) {
        if let Some((_, text)) = heading(line) {
            table = code_spans(text)
                .first()
                .filter(|t| t.starts_with('['))
                .map(|t| t.trim_matches(['[', ']']).to_owned());
            continue;
        }
        let (Some(table), Some(cells)) = (&table, row(line)) else {
            continue;
        };
        if let Some(key) = code_spans(cells[0]).first() {
            out.push(Setting {
                table: table.clone(),
                key: (*key).to_owned(),
                default: cells.get(1).copied().unwrap_or_default().to_owned(),
                what: cells.get(2).copied().unwrap_or_default().to_owned(),
                line: n,
            });
        }
    }
    assert!(out.len() > 40, "too few settings read: {out:?}");
    out
}

/// The tables of a configuration, by the page's names, in `config`: `NAME`
/// is the first provider and operation.
fn table_path(table: &str) -> Vec<String> {
    table
        .replace("providers.NAME", "providers.primary")
        .replace("operations.NAME", "operations.summarize")
        .split('.')
        .map(str::to_owned)
        .collect()
}

/// The table at `path` in `config` (`cases` is its first element), made if
/// it is missing.
fn table_at<'a>(config: &'a mut Table, path: &[String]) -> &'a mut Table {
    let mut at = config;
    for part in path {
        let value = at
            .entry(part.clone())
            .or_insert_with(|| Value::Table(Table::new()));
        at = match value {
            Value::Table(t) => t,
            Value::Array(items) => match items.first_mut() {
                Some(Value::Table(t)) => t,
                _ => panic!("{part}: not an array of tables"),
            },
            _ => panic!("{part}: not a table"),
        };
    }
    at
}

fn embedded() -> Table {
    toml::from_str(EMBEDDED_DEFAULT).expect("the embedded defaults parse as TOML")
}

fn parse(config: &Table) -> Result<Config, String> {
    let text = toml::to_string(config).expect("TOML out");
    Config::parse(&text, "test").map_err(|e| e.to_string())
}

#[test]
fn every_setting_the_reference_names_is_accepted() {
    let page = page();
    let example = blocks(&page)
        .into_iter()
        .find(|b| b.language() == "toml")
        .expect("a toml block with the whole file");
    let mut example: Table = toml::from_str(&example.text).expect("the whole file parses");
    Config::parse(&toml::to_string(&example).unwrap(), "example")
        .unwrap_or_else(|e| panic!("the page's whole file: {e}"));
    let mut wrong = Vec::new();
    for s in documented() {
        let path = table_path(&s.table);
        let Some(value) = table_at(&mut example, &path).get(&s.key).cloned() else {
            wrong.push(format!(
                "configuration.md:{}: the whole file does not give {}.{}",
                s.line, s.table, s.key
            ));
            continue;
        };
        let mut config = embedded();
        table_at(&mut config, &path).insert(s.key.clone(), value);
        if let Err(e) = parse(&config) {
            wrong.push(format!(
                "configuration.md:{}: {}.{} is refused: {e}",
                s.line, s.table, s.key
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The settings the parser accepts in one table, as its refusal of an unknown
/// one lists them.
fn accepted(path: &[String]) -> BTreeSet<String> {
    let mut config = embedded();
    if path
        == [
            "operations".to_owned(),
            "summarize".into(),
            "retention".into(),
        ]
    {
        table_at(&mut config, &path[..2]).insert("retention".into(), Value::Table(Table::new()));
    }
    table_at(&mut config, path).insert("no_such_setting".into(), Value::Integer(1));
    let error = parse(&config).expect_err("an unknown setting is refused");
    let (_, expected) = error
        .split_once("expected")
        .unwrap_or_else(|| panic!("{path:?}: {error}"));
    code_spans(expected)
        .into_iter()
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_setting_the_parser_accepts_is_in_the_reference() {
    let mut named: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for s in documented() {
        named.entry(s.table).or_default().insert(s.key);
    }
    // The top level's tables are the page's sections; an operation's own
    // `retention` table takes what `[retention]` does.
    let sections: BTreeSet<String> = named
        .keys()
        .map(|t| t.split('.').next().unwrap_or_default().to_owned())
        .collect();
    let retention = named["retention"].clone();
    let mut wrong = Vec::new();
    for (table, names) in [
        ("", sections),
        ("worker", named["worker"].clone()),
        ("retention", retention.clone()),
        ("owners", named["owners"].clone()),
        ("providers.NAME", named["providers.NAME"].clone()),
        ("operations.NAME", named["operations.NAME"].clone()),
        ("operations.NAME.retention", retention),
        (
            "operations.NAME.cases",
            named["operations.NAME.cases"].clone(),
        ),
    ] {
        let path: Vec<String> = if table.is_empty() {
            Vec::new()
        } else {
            table_path(table)
        };
        let accepted = accepted(&path);
        for key in accepted.symmetric_difference(&names) {
            let how = match accepted.contains(key) {
                true => "accepted by the parser but not in configuration.md",
                false => "in configuration.md but not accepted by the parser",
            };
            wrong.push(format!("[{table}] {key}: {how}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// What the parser made of one table, as text to compare.
fn parsed(config: &Config, table: &str) -> String {
    let op = &config.operations["summarize"];
    match table {
        "worker" => format!("{:?}", config.worker),
        "retention" => format!("{:?}", config.retention),
        "owners" => format!("{:?}", config.owners),
        "providers.NAME" => format!("{:?}", config.providers["primary"]),
        "operations.NAME" => format!(
            "{:?} {} {} {:?} {:?} {:?} {}",
            op.route,
            op.max_attempts,
            op.temperature,
            op.hedge_after,
            op.retention,
            op.cases,
            op.output_schema
        ),
        "operations.NAME.cases" => format!("{:?}", op.cases),
        other => panic!("no comparison for [{other}]"),
    }
}

#[test]
fn the_defaults_the_reference_gives_are_the_parsers() {
    let mut wrong = Vec::new();
    let mut compared = 0;
    for s in documented() {
        // Only a default given as one value (`5`, `"1s"`, `[504, 524]`).
        let spans = code_spans(&s.default);
        let whole = spans.len() == 1 && s.default == format!("`{}`", spans[0]);
        let Ok(value) = toml::from_str::<Table>(&format!("v = {}", spans.first().unwrap_or(&"")))
        else {
            continue;
        };
        if !whole {
            continue;
        }
        let path = table_path(&s.table);
        let mut without = embedded();
        table_at(&mut without, &path).remove(&s.key);
        let mut with = without.clone();
        table_at(&mut with, &path).insert(s.key.clone(), value["v"].clone());
        let (a, b) = (parse(&without), parse(&with));
        let (Ok(a), Ok(b)) = (&a, &b) else {
            wrong.push(format!("configuration.md:{}: {a:?} / {b:?}", s.line));
            continue;
        };
        compared += 1;
        if parsed(a, &s.table) != parsed(b, &s.table) {
            wrong.push(format!(
                "configuration.md:{}: {}.{} defaults to something else than {}",
                s.line, s.table, s.key, s.default
            ));
        }
    }
    assert!(compared > 25, "only {compared} defaults compared");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A number as the page writes a bound: `65535`, `2.0`, `10^15`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Number {
    Whole(i64),
    Fraction(f64),
}

/// The number at the start of `text`, and the text after it. A number
/// spelled out again in parentheses after it (`10^15 (1000000000000000)`)
/// must be the same.
fn number(text: &str) -> Option<(Number, &str)> {
    let end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '^'))
        .unwrap_or(text.len());
    // A sentence's full stop is not the number's.
    let written = text[..end].trim_end_matches('.');
    let rest = &text[written.len()..];
    let whole = |digits: &str| digits.parse::<i64>().ok();
    let n = match written.split_once('^') {
        Some((base, exp)) => Number::Whole(whole(base)?.checked_pow(exp.parse().ok()?)?),
        None if written.contains('.') => Number::Fraction(written.parse().ok()?),
        None => Number::Whole(whole(written)?),
    };
    if let Some((inner, _)) = rest.strip_prefix(" (").and_then(|r| r.split_once(')'))
        && inner.bytes().all(|b| b.is_ascii_digit())
        && whole(inner).map(Number::Whole) != Some(n)
    {
        return None;
    }
    Some((n, rest))
}

/// Which side of the accepted values a bound is on.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Side {
    Least,
    Most,
}

/// The bounds a row's text gives its number, each from a sentence of its
/// own: `From A to B.` (or `From A (what A means) to B`), `At least A.`,
/// `At most B.`, `Each from A to B.` (every item of a list). A sentence that
/// begins with a bound's words and a number but cannot be read is an error,
/// not a row without bounds.
fn bounds(what: &str) -> Result<Vec<(Side, Number)>, String> {
    let mut out = Vec::new();
    for (at, _) in what.char_indices() {
        if at > 0 && !what[..at].ends_with(". ") {
            continue;
        }
        let sentence = &what[at..];
        let unreadable = || format!("cannot read the bounds in {sentence:?}");
        let list = sentence.strip_prefix("Each ").unwrap_or(sentence);
        if let Some(rest) = list.strip_prefix("From ").or(list.strip_prefix("from ")) {
            // `From the call's start`: not a bound.
            let Some((least, rest)) = number(rest) else {
                continue;
            };
            let rest = match rest.strip_prefix(" (") {
                Some(r) => r.split_once(") ").ok_or_else(unreadable)?.1,
                None => rest.trim_start(),
            };
            let rest = rest.strip_prefix("to ").ok_or_else(unreadable)?;
            let (most, _) = number(rest).ok_or_else(unreadable)?;
            out.extend([(Side::Least, least), (Side::Most, most)]);
        } else if let Some(rest) = sentence.strip_prefix("At least ")
            && let Some((least, _)) = number(rest)
        {
            out.push((Side::Least, least));
        } else if let Some(rest) = sentence.strip_prefix("At most ")
            && let Some((most, _)) = number(rest)
        {
            out.push((Side::Most, most));
        }
    }
    Ok(out)
}

/// Whether `value` is a number or a list of numbers.
fn numeric(value: &Value) -> bool {
    match value {
        Value::Integer(_) | Value::Float(_) => true,
        Value::Array(items) => !items.is_empty() && items.iter().all(numeric),
        _ => false,
    }
}

/// The float just past `x` on the refused side of a bound.
fn past(x: f64, side: Side) -> f64 {
    match side {
        Side::Least => x.next_down(),
        Side::Most => x.next_up(),
    }
}

#[test]
fn every_bound_the_reference_gives_a_number_is_the_parsers() {
    let page = page();
    let example = blocks(&page)
        .into_iter()
        .find(|b| b.language() == "toml")
        .expect("a toml block with the whole file");
    let mut example: Table = toml::from_str(&example.text).expect("the whole file parses");
    let mut wrong = Vec::new();
    let mut checked = 0;
    for s in documented() {
        let path = table_path(&s.table);
        let Some(given) = table_at(&mut example, &path).get(&s.key).cloned() else {
            continue;
        };
        if !numeric(&given) {
            continue;
        }
        let at = format!("configuration.md:{}: {}.{}", s.line, s.table, s.key);
        let found = match bounds(&s.what) {
            Ok(found) if found.is_empty() => {
                wrong.push(format!("{at}: a number, and its row gives no bound"));
                continue;
            }
            Ok(found) => found,
            Err(e) => {
                wrong.push(format!("{at}: {e}"));
                continue;
            }
        };
        let list = matches!(given, Value::Array(_));
        let with = |v: Value| {
            let v = if list { Value::Array(vec![v]) } else { v };
            let mut config = embedded();
            table_at(&mut config, &path).insert(s.key.clone(), v);
            parse(&config)
        };
        // A setting that takes fractions is held to the nearest float past
        // its bound; one that takes whole numbers, to the next whole number.
        let fractions = with(Value::Float(0.5)).is_ok();
        for (side, bound) in found {
            let (value, beyond) = match (bound, fractions) {
                (Number::Whole(n), false) => {
                    let beyond = match side {
                        Side::Least => n - 1,
                        Side::Most => n + 1,
                    };
                    (Value::Integer(n), Value::Integer(beyond))
                }
                (Number::Whole(n), true) => {
                    let x = n as f64;
                    (Value::Float(x), Value::Float(past(x, side)))
                }
                (Number::Fraction(x), true) => (Value::Float(x), Value::Float(past(x, side))),
                (Number::Fraction(x), false) => {
                    wrong.push(format!(
                        "{at}: the bound {x} is a fraction, and the setting takes whole numbers"
                    ));
                    continue;
                }
            };
            checked += 1;
            if let Err(e) = with(value.clone()) {
                wrong.push(format!(
                    "{at}: {value}, the bound the page gives ({side:?}), is refused: {e}"
                ));
            }
            if with(beyond.clone()).is_ok() {
                wrong.push(format!(
                    "{at}: {beyond}, just past the bound {value} the page gives ({side:?}), is accepted"
                ));
            }
        }
    }
    assert!(checked > 20, "only {checked} bounds checked");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
