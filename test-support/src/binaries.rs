//! The workspace's programs, as the tests run them: built beside the test
//! binary (`cargo build --workspace --bins`, as `scripts/test` does, builds
//! those of the other packages).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

/// The workspace's root folder (scripts, benches' assets).
pub fn workspace() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("test-support/ sits in the workspace")
        .to_owned()
}

/// The folder the binaries are in: the profile's folder the running test or
/// benchmark was built into (`target/debug`, `target/release`), whose `deps/`
/// holds the test binary itself.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the running test's own path");
    let mut dir = exe.parent().expect("the test binary's folder").to_owned();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    dir
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

/// Whether `/readyz` on `port` answers 200.
pub fn ready(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    if stream
        .write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.starts_with("HTTP/1.1 200")
}

/// Waits until the program's `/readyz` on `port` answers 200 (it is up, its
/// signal handler too), or panics after 60 s.
pub fn listening(port: u16, child: &mut Child) {
    let began = Instant::now();
    while !ready(port) {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the program exited before it listened: {status}");
        }
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "/readyz on {port} is not ready after 60 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
