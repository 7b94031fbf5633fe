//! A test's configuration: the mock provider it steers, its providers in route
//! order, and the file the CLI reads.

use std::sync::Arc;

use onejob::mock::{MockHandle, MockOptions};
use onejob::settings::config::Config;

use super::tempfile_path;

/// A mock provider on a free port. Tests steer it: its `mock:` directives are
/// on.
pub async fn mock(options: MockOptions) -> MockHandle {
    let options = MockOptions {
        directives: true,
        ..options
    };
    onejob::mock::start("127.0.0.1:0".parse().expect("addr"), options)
        .await
        .expect("start mock provider")
}

/// One provider of a test configuration: its name, base URL, and extra TOML
/// lines (its kind is `openai` unless they name one).
pub struct P<'a>(pub &'a str, pub &'a str, pub &'a str);

/// A configuration for tests: short timeouts and backoff so conditions settle
/// fast, the providers in route order, one `summarize` operation with one golden
/// case, and `op_extra` lines added to the operation.
pub fn config_for(providers: &[P<'_>], op_extra: &str) -> String {
    let mut text = String::from(
        r#"
[worker]
retry_backoff = "200ms"
retry_backoff_max = "1s"
relay_interval = "100ms"
outbox_lease = "2s"
vanished_grace = "1s"
shutdown_grace = "5s"
"#,
    );
    for P(name, url, extra) in providers {
        let timeout = if extra.contains("timeout") {
            ""
        } else {
            "timeout = \"1s\"\n"
        };
        let kind = if extra.contains("kind =") {
            ""
        } else {
            "kind = \"openai\"\n"
        };
        text.push_str(&format!(
            "\n[providers.{name}]\n{kind}base_url = \"{url}\"\nmodel = \"mock-model\"\n{timeout}concurrency = 8\n{extra}\n"
        ));
    }
    let route: Vec<String> = providers.iter().map(|p| format!("{:?}", p.0)).collect();
    text.push_str(&format!(
        r#"
[operations.summarize]
system = "Answer with one JSON object only."
prompt = "Summarize: {{{{ text }}}}"
output_schema = {{ type = "object", required = ["summary"], additionalProperties = false, properties = {{ summary = {{ type = "string" }} }} }}
route = [{}]
max_attempts = 3
temperature = 0.0
{op_extra}

[[operations.summarize.cases]]
input = {{ text = "The quick brown fox jumps over the lazy dog." }}
"#,
        route.join(", ")
    ));
    text
}

/// A primary and a fallback, each with a 10 s timeout, and an operation that
/// hedges on the fallback after 300 ms of silence.
pub fn hedged_config(primary: &str, fallback: &str) -> String {
    config_for(
        &[
            P("primary", primary, "timeout = \"10s\""),
            P("fallback", fallback, "timeout = \"10s\""),
        ],
        "hedge_after = \"300ms\"",
    )
}

/// The usual test configuration: a primary and, if given, a fallback.
pub fn config_text(primary: &str, fallback: Option<&str>, extra: &str) -> String {
    match fallback {
        Some(url) => config_for(&[P("primary", primary, ""), P("fallback", url, "")], extra),
        None => config_for(&[P("primary", primary, "")], extra),
    }
}

/// Parses a test configuration, and writes it to a file for the CLI.
pub fn config(text: &str) -> (Arc<Config>, tempfile_path::TempConfig) {
    let config = Config::parse(text, "test").expect("test config parses");
    (Arc::new(config), tempfile_path::TempConfig::new(text))
}
