//! Reading Markdown as the book's pages use it: fenced code blocks with their
//! info strings, headings, and the rows of pipe tables.

/// One fenced code block.
#[derive(Clone, Debug)]
pub(crate) struct Block {
    /// The 1-based line of its opening fence.
    pub(crate) line: usize,
    /// The fence's info string, e.g. `toml` or `toml,cargo`.
    pub(crate) info: String,
    /// Its lines, the fence's indentation taken off.
    pub(crate) text: String,
}

impl Block {
    /// The language: the info string's first word.
    pub(crate) fn language(&self) -> &str {
        self.info
            .split([',', ' '])
            .next()
            .unwrap_or_default()
            .trim()
    }

    /// Whether the info string carries `attribute` after the language.
    pub(crate) fn has(&self, attribute: &str) -> bool {
        self.info.split([',', ' ']).skip(1).any(|a| a == attribute)
    }
}

/// Every fenced code block of a page, in order.
pub(crate) fn blocks(page: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<(usize, usize, String, Vec<String>)> = None;
    for (i, line) in page.lines().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        match &mut open {
            None if trimmed.starts_with("```") => {
                let info = trimmed.trim_start_matches('`').trim().to_owned();
                open = Some((i + 1, indent, info, Vec::new()));
            }
            None => {}
            Some(_) if trimmed.starts_with("```") && trimmed.trim_end_matches('`').is_empty() => {
                let (line, _, info, lines) = open.take().expect("an open block");
                out.push(Block {
                    line,
                    info,
                    text: lines.join("\n"),
                });
            }
            Some((_, indent, _, lines)) => {
                let cut = line.len().min(*indent);
                let cut = if line[..cut].trim().is_empty() {
                    cut
                } else {
                    0
                };
                lines.push(line[cut..].to_owned());
            }
        }
    }
    assert!(open.is_none(), "a code block is never closed");
    out
}

/// A page's lines outside code blocks, with their 1-based numbers.
pub(crate) fn prose(page: &str) -> Vec<(usize, &str)> {
    let mut inside = false;
    let mut out = Vec::new();
    for (i, line) in page.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            inside = !inside;
            continue;
        }
        if !inside {
            out.push((i + 1, line));
        }
    }
    out
}

/// A heading: its level and its text.
pub(crate) fn heading(line: &str) -> Option<(usize, &str)> {
    let level = line.chars().take_while(|c| *c == '#').count();
    (level > 0 && line[level..].starts_with(' ')).then(|| (level, line[level..].trim()))
}

/// The cells of a table row, or `None` for a line that is not one (or is the
/// header's rule).
pub(crate) fn row(line: &str) -> Option<Vec<&str>> {
    let line = line.trim();
    if !line.starts_with('|') || line.trim_matches(['|', '-', ' ', ':']).is_empty() {
        return None;
    }
    Some(line.trim_matches('|').split('|').map(str::trim).collect())
}

/// The text of every `code span` in `text`, in order.
pub(crate) fn code_spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// The section of a page that starts at the heading `title` and ends at the
/// next heading of the same level or higher.
pub(crate) fn section<'a>(page: &'a str, title: &str) -> &'a str {
    let mut start = None;
    let mut offset = 0;
    let mut inside = false;
    for line in page.split_inclusive('\n') {
        if line.trim_start().starts_with("```") {
            inside = !inside;
        }
        if !inside && let Some((level, text)) = heading(line.trim_end()) {
            match start {
                None if text == title => start = Some((offset + line.len(), level)),
                Some((from, at)) if level <= at => return &page[from..offset],
                _ => {}
            }
        }
        offset += line.len();
    }
    let (from, _) = start.unwrap_or_else(|| panic!("no heading {title:?}"));
    &page[from..]
}
