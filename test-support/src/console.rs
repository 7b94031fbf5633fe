//! The console's test harness: a console served over real HTTP on a free
//! port, signed-in sessions, forms as a browser sends them, and a job blocked
//! on an unknown attempt.

use std::sync::Arc;
use std::time::Duration;

use onejob::domain::{JobId, JobStatus};
use onejob::edges::store::{Admission, Finished, Started, Store, Verdict};
use onejob::operator::console::{Console, Options};
use onejob::settings::config::Config;
use onejob::settings::token::Token;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_TYPE, COOKIE, SET_COOKIE};

use super::{P, TestEnv, config_for};

/// A console served on a free port of this machine.
pub struct Served {
    pub base: String,
    pub http: reqwest::Client,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn serve(env: &TestEnv, config: Arc<Config>, secure_cookies: bool) -> Served {
    serve_with(env, config, |o| o.secure_cookies = secure_cookies).await
}

/// [`serve`], with `change` made to the console's options first.
pub async fn serve_with(
    env: &TestEnv,
    config: Arc<Config>,
    change: impl FnOnce(&mut Options),
) -> Served {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let mut options = Options {
        amqp_url: env.amqp_url.clone(),
        session_ttl: Duration::from_secs(600),
        ..Options::default()
    };
    change(&mut options);
    let console = Console::new(env.store.clone(), config, options);
    let task = tokio::spawn(onejob::operator::console::serve(
        listener,
        console,
        std::future::pending(),
    ));
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    Served { base, http, task }
}

pub fn two_providers() -> String {
    config_for(
        &[
            P("primary", "http://127.0.0.1:9", ""),
            P("fallback", "http://127.0.0.1:9", ""),
        ],
        "",
    )
}

pub const FORM: &str = "application/x-www-form-urlencoded";

/// A form's fields as a browser sends them.
pub fn encode(fields: &[(&str, &str)]) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(fields)
        .finish()
}

/// A signed-in session: its cookie header and its form token.
pub struct Session {
    pub cookie: String,
    pub csrf: String,
}

impl Served {
    /// Posts `token` through the sign-in page's own form: its form token and
    /// the cookie that goes with it.
    pub async fn login(&self, token: &str) -> reqwest::Response {
        self.login_with(token, &[]).await
    }

    /// [`Served::login`], with `headers` on the sign-in's requests.
    pub async fn login_with(&self, token: &str, headers: &[(&str, &str)]) -> reqwest::Response {
        let mut map = reqwest::header::HeaderMap::new();
        for (k, v) in headers {
            map.insert(
                reqwest::header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        let page = self
            .http
            .get(format!("{}/login", self.base))
            .headers(map.clone())
            .send()
            .await
            .unwrap();
        let cookie = page.headers()[SET_COOKIE]
            .to_str()
            .unwrap()
            .split(';')
            .next()
            .unwrap()
            .to_owned();
        let form = field(&page.text().await.unwrap(), "login_csrf");
        self.http
            .post(format!("{}/login", self.base))
            .headers(map)
            .header(CONTENT_TYPE, FORM)
            .header(COOKIE, cookie)
            .body(encode(&[("token", token), ("login_csrf", &form)]))
            .send()
            .await
            .unwrap()
    }

    pub async fn sign_in(&self, store: &Store, operator: &str) -> Session {
        let token = Token::generate_operator();
        store
            .tokens()
            .create_operator_token(operator, &token, &onejob::edges::store::Actor::cli(None))
            .await
            .unwrap();
        let answer = self.login(token.reveal()).await;
        assert_eq!(answer.status(), StatusCode::SEE_OTHER);
        let set = session_set(&answer).expect("a session cookie");
        let cookie = set.split(';').next().unwrap().to_owned();
        let page = self.get(&cookie, "/").await;
        assert_eq!(page.0, StatusCode::OK, "{}", page.1);
        let csrf = field(&page.1, "csrf");
        Session { cookie, csrf }
    }

    pub async fn get(&self, cookie: &str, path: &str) -> (StatusCode, String) {
        let answer = self
            .http
            .get(format!("{}{path}", self.base))
            .header(COOKIE, cookie)
            .send()
            .await
            .unwrap();
        (answer.status(), answer.text().await.unwrap())
    }

    pub async fn post(&self, cookie: &str, path: &str, form: &[(&str, &str)]) -> reqwest::Response {
        self.http
            .post(format!("{}{path}", self.base))
            .header(COOKIE, cookie)
            .header(CONTENT_TYPE, FORM)
            .body(encode(form))
            .send()
            .await
            .unwrap()
    }
}

/// The session cookie a response sets (its whole `Set-Cookie` line), if any.
pub fn session_set(answer: &reqwest::Response) -> Option<String> {
    answer
        .headers()
        .get_all(SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with(&format!("{}=", onejob::operator::console::COOKIE)))
        .map(str::to_owned)
}

/// The value of the first hidden input named `name` in a page.
pub fn field(page: &str, name: &str) -> String {
    let marker = format!("name=\"{name}\" value=\"");
    let start = page
        .find(&marker)
        .unwrap_or_else(|| panic!("no {name} field in:\n{page}"))
        + marker.len();
    page[start..].split('"').next().unwrap().to_owned()
}

/// An attribute's value as the browser reads it (the templates escape `&`, `/`,
/// `=` and quotes).
pub fn unescape(html: &str) -> String {
    html.replace("&#x2f;", "/")
        .replace("&#x3d;", "=")
        .replace("&#x27;", "'")
        .replace("&quot;", "\"")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}

/// Admits a job for the primary, starts its attempt and times it out: the job
/// is `unknown`, waiting for an operator.
pub async fn unknown_job(store: &Store, key: &str) -> (JobId, Started) {
    let new = super::new_job("acct_c", key, key);
    let (job_id, first) = (new.job_id, new.attempt_id);
    match store.admission().admit(&[new]).await.unwrap().remove(0) {
        Admission::Created {
            publish: Some(publish),
            ..
        } => store.outbox().mark_published(&[publish.id]).await.unwrap(),
        other => panic!("expected created, got {other:?}"),
    }
    let s = store
        .settle()
        .start("primary", &[first], Duration::from_secs(30))
        .await
        .unwrap()
        .remove(0);
    let timed_out = Finished {
        attempt_id: s.attempt_id,
        job_id: s.job_id,
        version: s.version,
        provider_request_id: None,
        usage: None,
        verdict: Verdict::Unknown {
            error: "outcome_unknown: timed out after the request was sent".into(),
        },
        asked: None,
    };
    store
        .settle()
        .finalize(&[timed_out], &super::give_up)
        .await
        .unwrap();
    // A timeout has no answer to take a request id from; the provider's own
    // id (as a proxy's timeout page may name it) is what an operator looks up.
    sqlx::query("UPDATE attempts SET provider_request_id = 'req_console_1' WHERE id = $1")
        .bind(s.attempt_id.0)
        .execute(store.pool())
        .await
        .unwrap();
    assert_eq!(
        store.jobs().job(job_id).await.unwrap().unwrap().status,
        JobStatus::Unknown
    );
    (job_id, s)
}

/// Dead-letters an intent from `owner` with `key`, as the intake does with one
/// it refused: on the intents' dead-letter queue, with message id `id` and the
/// origin a replay sends it back to.
pub async fn dead_letter_intent(env: &TestEnv, id: &str, owner: &str, key: &str) {
    let body = serde_json::to_vec(&super::intent(owner, key, "replayed")).unwrap();
    dead_letter(env, id, &body, true).await;
}

/// Puts `body` on the intents' dead-letter queue as message `id`, with the
/// origin headers a replay needs when `origin`.
pub async fn dead_letter(env: &TestEnv, id: &str, body: &[u8], origin: bool) {
    let headers: &[(&str, &str)] = if origin {
        &[
            ("x-onejob-original-exchange", onejob::broker::EXCHANGE),
            ("x-onejob-original-routing-key", onejob::broker::INTENTS_KEY),
            ("x-onejob-error", "invalid: a test put it here"),
        ]
    } else {
        &[]
    };
    dead_letter_with(env, id, body, headers).await;
}

/// Puts `body` on the intents' dead-letter queue as message `id` with
/// `headers`, as anyone who can publish there could.
pub async fn dead_letter_with(env: &TestEnv, id: &str, body: &[u8], headers: &[(&str, &str)]) {
    use lapin::options::BasicPublishOptions;
    use lapin::types::{AMQPValue, FieldTable, LongString};

    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let mut table = FieldTable::default();
    for (k, v) in headers {
        table.insert((*k).into(), AMQPValue::LongString(LongString::from(*v)));
    }
    ch.basic_publish(
        onejob::broker::DLX.into(),
        onejob::broker::INTENTS_QUEUE.into(),
        BasicPublishOptions::default(),
        body,
        onejob::broker::json_properties()
            .with_message_id(id.into())
            .with_headers(table),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let _ = conn.close(200, "done".into()).await;
}
