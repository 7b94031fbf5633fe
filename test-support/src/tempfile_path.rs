//! A test configuration written to a file for the CLI, removed again on drop.

/// A config file removed on drop.
pub struct TempConfig {
    pub path: std::path::PathBuf,
}

impl TempConfig {
    pub fn new(text: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "onejob-test-{}.toml",
            uuid::Uuid::now_v7().simple()
        ));
        std::fs::write(&path, text).expect("write test config");
        TempConfig { path }
    }
}

impl Drop for TempConfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
