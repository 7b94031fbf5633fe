//! A real browser for the console's tests: Debian's headless Chromium, driven
//! over the W3C WebDriver protocol by its ChromeDriver (packages `chromium` and
//! `chromium-driver`; `scripts/browsers` installs them, and `.ci/run` runs it;
//! `scripts/test` leaves these tests out, and says so, where they are missing).
//! The protocol is plain JSON over HTTP, so this speaks it with the
//! `reqwest` the tests already have: a session, navigation, finding elements,
//! typing, clicking, running a script, reading text and taking screenshots.

use std::io::Write;
use std::net::TcpStream;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};

/// The key a WebDriver element reference is sent under.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// What `scripts/browsers` installs, and where the tests look for it.
fn program(env: &str, default: &str) -> String {
    std::env::var(env).unwrap_or_else(|_| default.to_owned())
}

/// A headless Chromium and the ChromeDriver that drives it. [`Browser::quit`]
/// ends both; dropping it (a failed test) ends them too.
pub struct Browser {
    http: reqwest::Client,
    driver: String,
    session: String,
    process: Option<tokio::process::Child>,
    port: u16,
    profile: std::path::PathBuf,
}

/// Whether the ChromeDriver just started on `port` answers as ready, while it
/// still runs (another process could be answering on that port).
async fn ready(http: &reqwest::Client, port: u16, process: &mut tokio::process::Child) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        if process.try_wait().ok().flatten().is_some() {
            return false;
        }
        if let Ok(answer) = http
            .get(format!("http://127.0.0.1:{port}/status"))
            .send()
            .await
            && let Ok(status) = answer.json::<Value>().await
            && status["value"]["ready"] == true
        {
            return process.try_wait().ok().flatten().is_none();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Starts ChromeDriver on a free port: the port, and the process. A free port
/// is only free until someone takes it: if ChromeDriver could not have it (it
/// exits), it tries another.
async fn start_driver(http: &reqwest::Client, chromedriver: &str) -> (u16, tokio::process::Child) {
    let mut started = None;
    for _ in 0..5 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // Its own process group, so that ending it ends the Chromium it
        // started as well.
        let mut process = tokio::process::Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {chromedriver}: {e}"));
        if ready(http, port, &mut process).await {
            started = Some((port, process));
            break;
        }
        let _ = process.kill().await;
    }
    started.expect("chromedriver never answered on a port of its own")
}

/// Ends a process group: ChromeDriver and every Chromium process it started.
fn kill_group(process: &tokio::process::Child) {
    if let Some(pid) = process.id() {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", "--", &format!("-{pid}")])
            .stderr(Stdio::null())
            .status();
    }
}

/// An element of the current page.
#[derive(Clone, Debug)]
pub struct Element(String);

/// A WebDriver command that failed: its error code and message.
#[derive(Debug)]
pub struct Refused {
    pub error: String,
    pub message: String,
}

impl Browser {
    /// Starts ChromeDriver on a free port and opens a headless Chromium
    /// session, 1280×1000, that waits up to 10 s for an element to appear.
    pub async fn start() -> Browser {
        let http = reqwest::Client::new();
        let chromedriver = program("ONEJOB_CHROMEDRIVER", "/usr/bin/chromedriver");
        let chromium = program("ONEJOB_CHROMIUM", "/usr/bin/chromium");
        for (what, path) in [("chromedriver", &chromedriver), ("chromium", &chromium)] {
            assert!(
                std::path::Path::new(path).exists(),
                "{what} is not at {path}: run scripts/browsers (it installs Debian's chromium \
                 and chromium-driver), or say where it is with ONEJOB_CHROMEDRIVER / ONEJOB_CHROMIUM"
            );
        }
        let (port, process) = start_driver(&http, &chromedriver).await;
        let driver = format!("http://127.0.0.1:{port}");
        // A profile of its own, removed when the browser ends: no cookie of
        // an earlier run is ever seen.
        let profile = std::env::temp_dir().join(format!(
            "onejob-chromium-{}-{port}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let mut browser = Browser {
            http,
            driver,
            session: String::new(),
            process: Some(process),
            port,
            profile: profile.clone(),
        };
        let created = browser
            .command(
                reqwest::Method::POST,
                "/session",
                json!({ "capabilities": { "alwaysMatch": {
                    "browserName": "chrome",
                    "goog:chromeOptions": {
                        "binary": chromium,
                        "args": [
                            "--headless=new", "--no-sandbox", "--disable-gpu",
                            "--disable-dev-shm-usage", "--window-size=1280,1000",
                            "--no-first-run", "--hide-scrollbars",
                            format!("--user-data-dir={}", profile.display()),
                        ],
                    },
                    "timeouts": { "implicit": 10_000, "pageLoad": 30_000, "script": 10_000 },
                }}}),
            )
            .await
            .unwrap_or_else(|e| panic!("chromedriver refused a session: {e:?}"));
        browser.session = created["sessionId"]
            .as_str()
            .expect("a session id")
            .to_owned();
        browser
    }

    /// Sends a command; its `value`, or the driver's refusal.
    async fn command(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Value,
    ) -> Result<Value, Refused> {
        let url = if path == "/session" {
            format!("{}{path}", self.driver)
        } else {
            format!("{}/session/{}{path}", self.driver, self.session)
        };
        let mut request = self.http.request(method.clone(), url);
        if method != reqwest::Method::GET && method != reqwest::Method::DELETE {
            request = request.json(&body);
        }
        let answer = request.send().await.map_err(|e| Refused {
            error: "no answer".into(),
            message: e.to_string(),
        })?;
        let ok = answer.status().is_success();
        let mut value: Value = answer.json().await.map_err(|e| Refused {
            error: "not JSON".into(),
            message: e.to_string(),
        })?;
        let value = value["value"].take();
        if ok {
            Ok(value)
        } else {
            Err(Refused {
                error: value["error"].as_str().unwrap_or("?").to_owned(),
                message: value["message"].as_str().unwrap_or("").to_owned(),
            })
        }
    }

    async fn must(&self, method: reqwest::Method, path: &str, body: Value) -> Value {
        self.command(method, path, body)
            .await
            .unwrap_or_else(|e| panic!("webdriver {path}: {e:?}"))
    }

    /// Opens `url` and waits for it to load.
    pub async fn goto(&self, url: &str) {
        self.must(reqwest::Method::POST, "/url", json!({ "url": url }))
            .await;
    }

    /// The current page's address.
    pub async fn url(&self) -> String {
        self.must(reqwest::Method::GET, "/url", Value::Null)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// The current page's title.
    pub async fn title(&self) -> String {
        self.must(reqwest::Method::GET, "/title", Value::Null)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// The first element `css` selects, waiting up to 10 s for it.
    pub async fn find(&self, css: &str) -> Element {
        self.try_find(css)
            .await
            .unwrap_or_else(|e| panic!("no element {css:?} on {}: {e:?}", self.url_now()))
    }

    /// The first element `css` selects, or why there is none.
    pub async fn try_find(&self, css: &str) -> Result<Element, Refused> {
        let found = self
            .command(
                reqwest::Method::POST,
                "/element",
                json!({ "using": "css selector", "value": css }),
            )
            .await?;
        Ok(Element(
            found[ELEMENT].as_str().unwrap_or_default().to_owned(),
        ))
    }

    /// Every element `css` selects now (no waiting).
    pub async fn find_all(&self, css: &str) -> Vec<Element> {
        self.must(
            reqwest::Method::POST,
            "/elements",
            json!({ "using": "css selector", "value": css }),
        )
        .await
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e[ELEMENT].as_str().map(|id| Element(id.to_owned())))
        .collect()
    }

    /// Clicks `element`.
    pub async fn click(&self, element: &Element) {
        self.must(
            reqwest::Method::POST,
            &format!("/element/{}/click", element.0),
            json!({}),
        )
        .await;
    }

    /// Types `text` into `element`.
    pub async fn type_into(&self, element: &Element, text: &str) {
        self.must(
            reqwest::Method::POST,
            &format!("/element/{}/value", element.0),
            json!({ "text": text }),
        )
        .await;
    }

    /// The rendered text of `element`.
    pub async fn text_of(&self, element: &Element) -> String {
        self.must(
            reqwest::Method::GET,
            &format!("/element/{}/text", element.0),
            Value::Null,
        )
        .await
        .as_str()
        .unwrap_or_default()
        .to_owned()
    }

    /// An attribute (or property) of `element`.
    pub async fn attribute(&self, element: &Element, name: &str) -> Option<String> {
        self.must(
            reqwest::Method::GET,
            &format!("/element/{}/attribute/{name}", element.0),
            Value::Null,
        )
        .await
        .as_str()
        .map(str::to_owned)
    }

    /// The rendered text of the first element `css` selects.
    pub async fn text(&self, css: &str) -> String {
        let element = self.find(css).await;
        self.text_of(&element).await
    }

    /// Waits (up to 30 s) until the page's body shows `needle`, and returns
    /// that text. A page still loading, or one replaced while it was read, is
    /// read again.
    pub async fn wait_for_text(&self, needle: &str) -> String {
        let mut last = String::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            let read = self
                .command(
                    reqwest::Method::POST,
                    "/execute/sync",
                    json!({
                        "script": "return document.body ? document.body.innerText : '';",
                        "args": [],
                    }),
                )
                .await;
            if let Ok(Value::String(text)) = read {
                if text.contains(needle) {
                    return text;
                }
                last = text;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the page never showed {needle:?}; it shows:\n{last}");
    }

    /// Runs `script` in the page with `args`; what it returns.
    pub async fn execute(&self, script: &str, args: Value) -> Value {
        self.must(
            reqwest::Method::POST,
            "/execute/sync",
            json!({ "script": script, "args": args }),
        )
        .await
    }

    /// The browser's cookies for the current page, as WebDriver lists them.
    pub async fn cookies(&self) -> Vec<Value> {
        self.must(reqwest::Method::GET, "/cookie", Value::Null)
            .await
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// A PNG of the viewport.
    pub async fn screenshot(&self) -> Vec<u8> {
        use base64::Engine as _;
        let encoded = self
            .must(reqwest::Method::GET, "/screenshot", Value::Null)
            .await;
        base64::engine::general_purpose::STANDARD
            .decode(encoded.as_str().unwrap_or_default())
            .expect("a screenshot in base64")
    }

    /// A PNG of the whole page, as tall as its content (the window is resized
    /// to fit it, up to 4,000 pixels, and back).
    pub async fn full_screenshot(&self) -> Vec<u8> {
        let height = self
            .execute(
                "return Math.ceil(document.documentElement.scrollHeight);",
                json!([]),
            )
            .await
            .as_u64()
            .unwrap_or(1000)
            .clamp(600, 4000);
        self.set_window(1280, height + 20).await;
        let png = self.screenshot().await;
        self.set_window(1280, 1000).await;
        png
    }

    async fn set_window(&self, width: u64, height: u64) {
        self.must(
            reqwest::Method::POST,
            "/window/rect",
            json!({ "width": width, "height": height }),
        )
        .await;
    }

    fn url_now(&self) -> String {
        format!("session {}", self.session)
    }

    /// Ends the session (Chromium exits) and stops ChromeDriver.
    pub async fn quit(mut self) {
        let _ = self.command(reqwest::Method::DELETE, "", Value::Null).await;
        self.session.clear();
        if let Some(mut p) = self.process.take() {
            kill_group(&p);
            let _ = p.kill().await;
        }
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

impl Drop for Browser {
    /// A test that failed before [`Browser::quit`]: end the session by a plain
    /// blocking request (no runtime to await on here), so Chromium exits with
    /// its driver, then end the driver's whole process group in any case.
    fn drop(&mut self) {
        if !self.session.is_empty()
            && let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port))
        {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let _ = write!(
                stream,
                "DELETE /session/{} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
                self.session
            );
            let _ = std::io::Read::read(&mut stream, &mut [0u8; 512]);
        }
        if let Some(p) = self.process.as_mut() {
            kill_group(p);
            let _ = p.start_kill();
        }
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}
