//! The workspace's programs, as the tests run them: built beside the test
//! binary (`cargo build --workspace --bins`, as `scripts/test` does, builds
//! those of the other packages).

use std::path::PathBuf;

/// The folder the binaries are in.
pub fn bin_dir() -> PathBuf {
    std::path::Path::new(env!("CARGO_BIN_EXE_onejob"))
        .parent()
        .expect("the binaries' folder")
        .to_owned()
}

/// The program `name`'s binary; panics, saying how to build it, if it is
/// missing.
pub fn binary(name: &str) -> PathBuf {
    let bin = bin_dir().join(name);
    assert!(
        bin.exists(),
        "{} is missing: build it first (`cargo build --workspace --bins`, as scripts/test does)",
        bin.display()
    );
    bin
}

/// A program a test started, with the programs it started in turn (a script's,
/// say): killed on drop if it still runs, so that a failing test leaves
/// nothing running.
pub struct Program(pub std::process::Child);

impl Drop for Program {
    fn drop(&mut self) {
        if !matches!(self.0.try_wait(), Ok(None)) {
            return;
        }
        let parent = self.0.id().to_string();
        if let Ok(out) = std::process::Command::new("pgrep")
            .args(["-P", &parent])
            .output()
        {
            for child in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", child])
                    .status();
            }
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
