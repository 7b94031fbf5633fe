//! Reading the shell lines of the pages as a shell would split them: quotes,
//! escapes, comments, pipes and lists, and the commands inside `$( … )`.
//! Enough of the POSIX shell for what the pages hold, not all of it.

/// The commands a code block runs: for `console`, the lines after a `$ `
/// prompt; for `sh` and `bash`, every line. A line ending in `\` goes on on
/// the next.
pub(crate) fn command_lines(language: &str, text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut pending: Option<String> = None;
    for line in text.lines() {
        let line = match (&mut pending, language) {
            (Some(p), _) => {
                p.push(' ');
                p.push_str(line.trim());
                p.clone()
            }
            (None, "console") => match line.strip_prefix("$ ") {
                Some(command) => command.to_owned(),
                None => continue,
            },
            (None, _) => line.to_owned(),
        };
        match line.strip_suffix('\\') {
            Some(head) => pending = Some(head.trim_end().to_owned()),
            None => {
                pending = None;
                if !line.trim().is_empty() {
                    out.push(line);
                }
            }
        }
    }
    out
}

/// The simple commands of one line, each as its words (quotes removed), the
/// commands of every `$( … )` included; a `$( … )` in a word stands as
/// `$(…)` there. Leading assignments and `export` are dropped, as are
/// redirections.
pub(crate) fn commands(line: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut words: Vec<String> = Vec::new();
    let chars: Vec<char> = line.chars().collect();
    let mut i = 0;
    let mut word: Option<String> = None;
    let end_command = |words: &mut Vec<String>, out: &mut Vec<Vec<String>>| {
        let command = strip_assignments(std::mem::take(words));
        if !command.is_empty() {
            out.push(command);
        }
    };
    while i < chars.len() {
        let c = chars[i];
        match c {
            ' ' | '\t' => {
                words.extend(word.take());
                i += 1;
            }
            '#' if word.is_none() => break,
            '|' | ';' | '&' => {
                words.extend(word.take());
                end_command(&mut words, &mut out);
                i += 1;
            }
            '>' | '<' => {
                // A redirection: drop it and its target.
                if let Some(w) = &word
                    && w.chars().all(|c| c.is_ascii_digit())
                {
                    word = None;
                }
                words.extend(word.take());
                i += 1;
                while i < chars.len() && matches!(chars[i], '>' | '&' | ' ') {
                    i += 1;
                }
                while i < chars.len() && chars[i] != ' ' {
                    i += 1;
                }
            }
            '\'' => {
                let close = find(&chars, i + 1, '\'');
                word.get_or_insert_default().extend(&chars[i + 1..close]);
                i = close + 1;
            }
            '"' => {
                i = double_quoted(&chars, i + 1, word.get_or_insert_default(), &mut out);
            }
            '\\' => {
                word.get_or_insert_default().extend(chars.get(i + 1));
                i += 2;
            }
            '$' if chars.get(i + 1) == Some(&'(') => {
                i = substitution(&chars, i + 2, &mut out);
                word.get_or_insert_default().push_str("$(…)");
            }
            _ => {
                word.get_or_insert_default().push(c);
                i += 1;
            }
        }
    }
    words.extend(word.take());
    end_command(&mut words, &mut out);
    out
}

/// The index of the next `c` from `from`; panics if there is none.
fn find(chars: &[char], from: usize, c: char) -> usize {
    (from..chars.len())
        .find(|&j| chars[j] == c)
        .unwrap_or_else(|| panic!("unclosed {c} in {}", chars.iter().collect::<String>()))
}

/// Reads a double-quoted string from `from` (after its quote) into `word`;
/// returns the index after its closing quote.
fn double_quoted(
    chars: &[char],
    mut i: usize,
    word: &mut String,
    out: &mut Vec<Vec<String>>,
) -> usize {
    while i < chars.len() {
        match chars[i] {
            '"' => return i + 1,
            '\\' if matches!(chars.get(i + 1), Some('"' | '\\' | '$' | '`')) => {
                word.push(chars[i + 1]);
                i += 2;
            }
            '$' if chars.get(i + 1) == Some(&'(') => {
                i = substitution(chars, i + 2, out);
                word.push_str("$(…)");
            }
            c => {
                word.push(c);
                i += 1;
            }
        }
    }
    panic!("unclosed \" in {}", chars.iter().collect::<String>())
}

/// Reads a `$( … )` whose text starts at `from`, adds its commands to `out`,
/// and returns the index after its closing parenthesis.
fn substitution(chars: &[char], from: usize, out: &mut Vec<Vec<String>>) -> usize {
    let (mut depth, mut quote, mut i) = (1, None, from);
    while i < chars.len() {
        match (quote, chars[i]) {
            (None, '\'' | '"') => quote = Some(chars[i]),
            (Some(q), c) if c == q => quote = None,
            (None, '(') => depth += 1,
            (None, ')') => {
                depth -= 1;
                if depth == 0 {
                    let inner: String = chars[from..i].iter().collect();
                    out.extend(commands(&inner));
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    panic!("unclosed $( in {}", chars.iter().collect::<String>())
}

/// A simple command without its leading `NAME=value` assignments, or nothing
/// when it is only assignments (or `export` of them).
fn strip_assignments(words: Vec<String>) -> Vec<String> {
    let is_assignment = |w: &String| {
        w.split_once('=').is_some_and(|(name, _)| {
            !name.is_empty()
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !name.starts_with(|c: char| c.is_ascii_digit())
        })
    };
    let rest: Vec<String> = words.into_iter().skip_while(is_assignment).collect();
    if rest.first().is_some_and(|w| w == "export") {
        return Vec::new();
    }
    rest
}

#[test]
fn the_shell_reader_splits_as_a_shell_does() {
    let got = commands(
        r#"TOKEN=$(onejob tokens create --owner acct_42) curl -s "a b" -H 'x: "y"' \$z # note"#,
    );
    assert_eq!(
        got,
        vec![
            vec!["onejob", "tokens", "create", "--owner", "acct_42"],
            vec!["curl", "-s", "a b", "-H", "x: \"y\"", "$z"],
        ]
    );
    let got = commands(r#"export PATH="$(scripts/bin-dir):$PATH" && ls 2>/dev/null | grep -q x"#);
    assert_eq!(
        got,
        vec![vec!["scripts/bin-dir"], vec!["ls"], vec!["grep", "-q", "x"]]
    );
    let lines = command_lines("console", "$ a \\\n  b\noutput\n$ c");
    assert_eq!(lines, vec!["a b", "c"]);
}
