//! What the operator's terminal is shown. Plain output passes through
//! [`Terminal`], which escapes every control character but the line feed and
//! the tab, so that nothing printed (a dead letter's headers, a provider's
//! text, a row another program wrote) can retitle the terminal, clear the
//! screen, write the clipboard or move the cursor over earlier lines. Fields
//! from outside are escaped whole as well, line feeds included
//! ([`crate::broker::escape_controls`]), so none can forge a line. `--json`
//! output does not pass through here: it stays exact JSON.

use std::io::Write;

/// A writer that escapes control characters (C0 but `\n` and `\t`, DEL, and
/// C1 as UTF-8) the way [`char::escape_unicode`] writes them: `\u{1b}`.
pub(crate) struct Terminal<W: Write> {
    inner: W,
    /// A `0xC2` byte held back: it starts a C1 control or a printable
    /// character, which the next byte says.
    held: bool,
}

impl<W: Write> Terminal<W> {
    /// Output to `inner`, escaped.
    pub(crate) fn new(inner: W) -> Terminal<W> {
        Terminal { inner, held: false }
    }
}

fn escaped(byte: u32, out: &mut Vec<u8>) {
    out.extend(format!("\\u{{{byte:x}}}").bytes());
}

impl<W: Write> Write for Terminal<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut clean = Vec::with_capacity(buf.len());
        for &b in buf {
            if std::mem::take(&mut self.held) {
                if (0x80..=0x9f).contains(&b) {
                    escaped(u32::from(b), &mut clean);
                    continue;
                }
                clean.push(0xc2);
            }
            match b {
                0xc2 => self.held = true,
                b'\n' | b'\t' => clean.push(b),
                0..=0x1f | 0x7f => escaped(u32::from(b), &mut clean),
                _ => clean.push(b),
            }
        }
        self.inner.write_all(&clean)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl<W: Write> Drop for Terminal<W> {
    fn drop(&mut self) {
        if self.held {
            let _ = self.inner.write_all(&[0xc2]);
        }
        let _ = self.inner.flush();
    }
}

/// `text` as [`Terminal`] would print it: a message of several lines keeps
/// them, and loses every other control character.
pub(crate) fn escape(text: &str) -> String {
    let mut out = Vec::new();
    {
        let mut terminal = Terminal::new(&mut out);
        let _ = terminal.write_all(text.as_bytes());
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_are_escaped_and_lines_and_text_kept() {
        assert_eq!(
            escape("a\u{1b}]0;t\u{7}b\r\nc\td\u{7f}\u{9b}é\u{a0}"),
            "a\\u{1b}]0;t\\u{7}b\\u{d}\nc\td\\u{7f}\\u{9b}é\u{a0}"
        );
    }

    #[test]
    fn a_c1_control_split_across_writes_is_escaped() {
        let mut out = Vec::new();
        {
            let mut t = Terminal::new(&mut out);
            t.write_all(b"x\xc2").unwrap();
            t.write_all(b"\x9by\xc2").unwrap();
            t.write_all(b"\xa9").unwrap();
        }
        assert_eq!(String::from_utf8(out).unwrap(), "x\\u{9b}y©");
    }
}
