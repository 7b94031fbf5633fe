//! The operator console over real HTTP, on the real PostgreSQL and RabbitMQ:
//! sign-in takes operator tokens and nothing else, the session cookie's flags,
//! CSRF on actions, resolving an unknown with a reason (audited, the next
//! attempt planned and published), and the job list paged by keyset.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{P, TestEnv, config, config_for};
use onejob::config::Config;
use onejob::console::{Console, Options};
use onejob::domain::{AttemptStatus, JobId, JobStatus};
use onejob::store::{Admission, Finished, Started, Store, Verdict};
use onejob::token::Token;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_TYPE, COOKIE, LOCATION, SET_COOKIE};
use sqlx::Connection;

/// A console served on a free port of this machine.
struct Served {
    base: String,
    http: reqwest::Client,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(env: &TestEnv, config: Arc<Config>, secure_cookies: bool) -> Served {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let options = Options {
        amqp_url: env.amqp_url.clone(),
        secure_cookies,
        session_ttl: Duration::from_secs(600),
    };
    let console = Console::new(env.store.clone(), config, options);
    let task = tokio::spawn(onejob::console::serve(
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

fn text() -> String {
    config_for(
        &[
            P("primary", "http://127.0.0.1:9", ""),
            P("fallback", "http://127.0.0.1:9", ""),
        ],
        "",
    )
}

const FORM: &str = "application/x-www-form-urlencoded";

/// A form's fields as a browser sends them.
fn encode(fields: &[(&str, &str)]) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(fields)
        .finish()
}

/// A signed-in session: its cookie header and its form token.
struct Session {
    cookie: String,
    csrf: String,
}

impl Served {
    async fn login(&self, token: &str) -> reqwest::Response {
        self.http
            .post(format!("{}/login", self.base))
            .header(CONTENT_TYPE, FORM)
            .body(encode(&[("token", token)]))
            .send()
            .await
            .unwrap()
    }

    async fn sign_in(&self, store: &Store, operator: &str) -> Session {
        let token = Token::generate_operator();
        store.create_operator_token(operator, &token).await.unwrap();
        let answer = self.login(token.reveal()).await;
        assert_eq!(answer.status(), StatusCode::SEE_OTHER);
        let set = answer.headers()[SET_COOKIE].to_str().unwrap().to_owned();
        let cookie = set.split(';').next().unwrap().to_owned();
        let page = self.get(&cookie, "/").await;
        assert_eq!(page.0, StatusCode::OK, "{}", page.1);
        let csrf = field(&page.1, "csrf");
        Session { cookie, csrf }
    }

    async fn get(&self, cookie: &str, path: &str) -> (StatusCode, String) {
        let answer = self
            .http
            .get(format!("{}{path}", self.base))
            .header(COOKIE, cookie)
            .send()
            .await
            .unwrap();
        (answer.status(), answer.text().await.unwrap())
    }

    async fn post(&self, cookie: &str, path: &str, form: &[(&str, &str)]) -> reqwest::Response {
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

/// The value of the first hidden input named `name` in a page.
fn field(page: &str, name: &str) -> String {
    let marker = format!("name=\"{name}\" value=\"");
    let start = page
        .find(&marker)
        .unwrap_or_else(|| panic!("no {name} field in:\n{page}"))
        + marker.len();
    page[start..].split('"').next().unwrap().to_owned()
}

/// An attribute's value as the browser reads it (the templates escape `&`, `/`,
/// `=` and quotes).
fn unescape(html: &str) -> String {
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
async fn unknown_job(store: &Store, key: &str) -> (JobId, Started) {
    let new = common::new_job("acct_c", key, key);
    let (job_id, first) = (new.job_id, new.attempt_id);
    match store.admit(&[new]).await.unwrap().remove(0) {
        Admission::Created { publish, .. } => store.mark_published(&[publish.id]).await.unwrap(),
        other => panic!("expected created, got {other:?}"),
    }
    let s = store
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
    };
    store
        .finalize(&[timed_out], &common::give_up)
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
        store.job(job_id).await.unwrap().unwrap().status,
        JobStatus::Unknown
    );
    (job_id, s)
}

#[tokio::test]
async fn only_a_live_operator_token_signs_in() {
    let (config, _file) = config(&text());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;

    // A tenant's gateway token is refused, and says why.
    let tenant = Token::generate();
    env.store.create_token("acct_c", &tenant).await.unwrap();
    let answer = served.login(tenant.reveal()).await;
    assert_eq!(answer.status(), StatusCode::UNAUTHORIZED);
    assert!(answer.headers().get(SET_COOKIE).is_none());
    assert!(answer.text().await.unwrap().contains("tenant"));

    // So are an operator token nobody made, and garbage.
    for bad in [
        Token::generate_operator().reveal().to_owned(),
        "ojo_123".into(),
        String::new(),
    ] {
        let answer = served.login(&bad).await;
        assert_eq!(answer.status(), StatusCode::UNAUTHORIZED, "{bad:?}");
        assert!(answer.headers().get(SET_COOKIE).is_none());
    }

    // Without a session every page sends the browser to sign in.
    for path in ["/", "/jobs", "/unknowns"] {
        let answer = served
            .http
            .get(format!("{}{path}", served.base))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::SEE_OTHER, "{path}");
        assert_eq!(answer.headers()[LOCATION], "/login");
    }
    let forged = served.get("onejob_console=00ff", "/").await;
    assert_eq!(forged.0, StatusCode::SEE_OTHER);

    // An operator token signs in; the cookie is HttpOnly and SameSite=Strict,
    // and not Secure over plain HTTP.
    let token = Token::generate_operator();
    let id = env
        .store
        .create_operator_token("ada", &token)
        .await
        .unwrap();
    let answer = served.login(token.reveal()).await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    let set = answer.headers()[SET_COOKIE].to_str().unwrap().to_owned();
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict"),
        "{set}"
    );
    assert!(!set.contains("Secure"), "{set}");
    let cookie = set.split(';').next().unwrap().to_owned();
    let (status, page) = served.get(&cookie, "/").await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains("ada"), "the overview names the operator");

    // Behind TLS the cookie is Secure.
    let answer = served
        .http
        .post(format!("{}/login", served.base))
        .header("x-forwarded-proto", "https")
        .header(CONTENT_TYPE, FORM)
        .body(encode(&[("token", token.reveal())]))
        .send()
        .await
        .unwrap();
    assert!(
        answer.headers()[SET_COOKIE]
            .to_str()
            .unwrap()
            .contains("Secure")
    );

    // Revoking the token ends its sessions at once.
    env.store.revoke_operator_token(id).await.unwrap().unwrap();
    assert_eq!(served.get(&cookie, "/").await.0, StatusCode::SEE_OTHER);
    assert_eq!(
        served.login(token.reveal()).await.status(),
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test]
async fn an_action_without_its_csrf_token_is_refused_and_does_nothing() {
    let (config, _file) = config(&text());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let (job_id, s) = unknown_job(&env.store, "csrf-1").await;
    let session = served.sign_in(&env.store, "ada").await;
    let other = served.sign_in(&env.store, "bob").await;
    let path = format!("/attempts/{}/resolve", s.attempt_id);
    for csrf in [None, Some(""), Some("0123"), Some(other.csrf.as_str())] {
        let mut form = vec![
            ("as", "failed"),
            ("reason", "the provider says it never ran"),
        ];
        if let Some(c) = csrf {
            form.push(("csrf", c));
        }
        let answer = served.post(&session.cookie, &path, &form).await;
        assert_eq!(answer.status(), StatusCode::FORBIDDEN, "{csrf:?}");
        assert!(answer.text().await.unwrap().contains("CSRF"));
    }
    // Signing out needs it too.
    let answer = served.post(&session.cookie, "/logout", &[]).await;
    assert_eq!(answer.status(), StatusCode::FORBIDDEN);
    let job = env.store.job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Unknown, "nothing was resolved");
    assert_eq!(job.attempts.len(), 1);
    assert!(env.store.audit_of_job(job_id).await.unwrap().is_empty());
    // A reason is required as well.
    let answer = served
        .post(
            &session.cookie,
            &path,
            &[("as", "failed"), ("reason", " "), ("csrf", &session.csrf)],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        env.store.job(job_id).await.unwrap().unwrap().status,
        JobStatus::Unknown
    );
    // With its own token, signing out works and ends the session.
    let answer = served
        .post(&session.cookie, "/logout", &[("csrf", &session.csrf)])
        .await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert_eq!(
        served.get(&session.cookie, "/").await.0,
        StatusCode::SEE_OTHER
    );
}

#[tokio::test]
async fn an_operator_resolves_an_unknown_with_a_reason_and_the_next_attempt_appears() {
    let (config, _file) = config(&text());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let (job_id, s) = unknown_job(&env.store, "resolve-1").await;
    let session = served.sign_in(&env.store, "ada").await;

    // The unknowns page lists it, with its age and the provider's request id.
    let (status, page) = served.get(&session.cookie, "/unknowns").await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        page.contains(&s.attempt_id.to_string()) && page.contains("req_console_1"),
        "{page}"
    );

    // The confirmation says what follows: the fallback is not qualified, so
    // the route rule tries the primary again after its backoff.
    let path = format!("/attempts/{}/resolve", s.attempt_id);
    let (status, page) = served
        .get(&session.cookie, &format!("{path}?as=failed"))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains("attempt #2 on primary"), "{page}");
    let csrf = field(&page, "csrf");
    assert_eq!(csrf, session.csrf);

    let answer = served
        .post(
            &session.cookie,
            &path,
            &[
                ("as", "failed"),
                ("reason", "provider confirms it never ran"),
                ("csrf", &csrf),
            ],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert_eq!(
        answer.headers()[LOCATION],
        format!("/jobs/{job_id}").as_str()
    );

    // The job runs again: attempt #2 is queued, and its message is on the
    // primary's queue.
    let job = env.store.job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Running, "no longer blocked");
    assert_eq!(job.attempts.len(), 2);
    assert_eq!(job.attempts[0].status, AttemptStatus::Failed);
    assert_eq!(job.attempts[1].status, AttemptStatus::Queued);
    assert_eq!(job.attempts[1].provider, "primary");
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    common::wait_for_depth(
        "the next attempt's message",
        Duration::from_secs(20),
        &ch,
        &onejob::broker::attempts_queue("primary"),
        1,
    )
    .await;

    // The job's page shows both attempts and the audit row.
    let (status, page) = served
        .get(&session.cookie, &format!("/jobs/{job_id}"))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains(&job.attempts[1].id.to_string()), "{page}");
    assert!(page.contains("provider confirms it never ran") && page.contains("operator:ada"));
    let audit = env.store.audit_of_job(job_id).await.unwrap();
    assert_eq!(audit.len(), 1);
    assert_eq!(audit[0].actor, "operator:ada");
    assert_eq!(audit[0].action, "attempt.resolve_failed");
    assert_eq!(audit[0].attempt_id, Some(s.attempt_id.0));
    assert_eq!(
        audit[0].detail["next_attempt"],
        serde_json::json!(job.attempts[1].id)
    );

    // Resolving it again is refused: it is not unknown any more.
    let answer = served
        .post(
            &session.cookie,
            &path,
            &[("as", "cancelled"), ("reason", "twice"), ("csrf", &csrf)],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::CONFLICT);
    assert_eq!(env.store.audit_of_job(job_id).await.unwrap().len(), 1);
}

#[tokio::test]
async fn the_job_list_pages_by_keyset_with_its_filters() {
    let (config, _file) = config(&text());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let session = served.sign_in(&env.store, "ada").await;
    let mut db = sqlx::PgConnection::connect(&env.database_url)
        .await
        .unwrap();
    // 120 ended jobs (every 20th cancelled, 3 in 20 failed), newest first by id.
    common::fill_jobs(&mut db, "page-", 120, "mix", 60.0, 60.0, "summarize").await;
    let ids = |page: &str| -> Vec<String> {
        page.match_indices("href=\"/jobs/")
            .map(|(i, _)| page[i + 12..i + 48].to_owned())
            .collect()
    };
    let mut seen = Vec::new();
    let mut path = "/jobs".to_owned();
    let mut pages = 0;
    loop {
        let (status, page) = served.get(&session.cookie, &path).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        seen.extend(ids(&page));
        pages += 1;
        match page.find("id=\"next\" href=\"") {
            Some(i) => {
                let rest = &page[i + 16..];
                path = unescape(&rest[..rest.find('"').unwrap()]);
            }
            None => break,
        }
    }
    assert_eq!(pages, 3, "50 + 50 + 20");
    let mut expected: Vec<String> =
        sqlx::query_scalar("SELECT id::text FROM jobs ORDER BY id DESC")
            .fetch_all(&mut db)
            .await
            .unwrap();
    assert_eq!(seen, expected, "every job once, newest first");
    // A filter keeps to its jobs, and across pages.
    let (_, page) = served.get(&session.cookie, "/jobs?status=cancelled").await;
    expected =
        sqlx::query_scalar("SELECT id::text FROM jobs WHERE status = 'cancelled' ORDER BY id DESC")
            .fetch_all(&mut db)
            .await
            .unwrap();
    assert_eq!(ids(&page), expected);
    // Bad filters get their own errors.
    let (status, page) = served.get(&session.cookie, "/jobs?status=lost").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(page.contains("not a job status"));
    let (status, _) = served.get(&session.cookie, "/jobs?since=yesterday").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = served.get(&session.cookie, "/jobs/not-a-uuid").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn the_cli_makes_operator_tokens_and_audits_its_resolve_and_cancel() {
    let (config, file) = config(&text());
    let env = TestEnv::new(&config).await;

    // An operator token: printed once, ojo_, listed apart, revocable.
    let out = env.cli_ok(&file.path, &["tokens", "create", "--operator", "ada"]);
    let token = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(Token::parse_operator(&token).is_some(), "{token}");
    let out = env.cli_ok(&file.path, &["--json", "tokens", "list", "--operators"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed[0]["operator"], "ada");
    let out = env.cli_ok(&file.path, &["--json", "tokens", "list"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "[]",
        "tenant tokens are apart"
    );
    let id = listed[0]["id"].as_str().unwrap().to_owned();
    let out = env.cli_ok(&file.path, &["tokens", "revoke", &id]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("of operator ada revoked"));
    // Either kind must be said.
    let out = env.cli(&file.path, &["tokens", "create"]);
    assert_eq!(out.status.code(), Some(2));

    // Resolve and cancel with a reason: each leaves an audit row that `jobs
    // show` prints.
    let (job_id, s) = unknown_job(&env.store, "cli-1").await;
    let attempt = s.attempt_id.to_string();
    env.cli_ok(
        &file.path,
        &[
            "attempts",
            "resolve",
            &attempt,
            "--as",
            "failed",
            "--reason",
            "ticket OPS-42",
        ],
    );
    let job = job_id.to_string();
    env.cli_ok(
        &file.path,
        &["jobs", "cancel", &job, "--reason", "customer withdrew"],
    );
    let out = env.cli_ok(&file.path, &["--json", "jobs", "show", &job]);
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let audit = shown["audit"].as_array().unwrap();
    assert_eq!(audit.len(), 2, "{shown}");
    assert_eq!(audit[0]["action"], "attempt.resolve_failed");
    assert_eq!(audit[0]["reason"], "ticket OPS-42");
    assert_eq!(audit[0]["attempt_id"], attempt.as_str());
    assert_eq!(audit[1]["action"], "job.cancel");
    assert_eq!(audit[1]["reason"], "customer withdrew");
    assert!(audit[1]["actor"].as_str().unwrap().starts_with("cli:"));
    let out = env.cli_ok(&file.path, &["jobs", "show", &job]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("job.cancel") && text.contains("\"customer withdrew\""),
        "{text}"
    );
    // A refused action writes nothing.
    let out = env.cli(&file.path, &["jobs", "cancel", &job, "--reason", "again"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(env.store.audit_of_job(job_id).await.unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_browses_replays_and_purges_dead_letters() {
    use lapin::options::BasicPublishOptions;
    use lapin::types::{AMQPValue, FieldTable, LongString};

    let (config, _file) = config(&text());
    let env = TestEnv::new(&config).await;
    let fleet = env
        .fleet(config.clone(), vec![onejob::fleet::Role::Intake])
        .await;
    let served = serve(&env, config, false).await;
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let dlq = onejob::broker::dead_letter_queue(onejob::broker::INTENTS_QUEUE);
    // A good intent with its origin, dead-lettered, and a letter without one.
    let mut origin = FieldTable::default();
    for (k, v) in [
        ("x-onejob-original-exchange", onejob::broker::EXCHANGE),
        ("x-onejob-original-routing-key", onejob::broker::INTENTS_KEY),
        ("x-onejob-error", "invalid: a test put it here"),
    ] {
        origin.insert(k.into(), AMQPValue::LongString(LongString::from(v)));
    }
    let good = serde_json::to_vec(&common::intent("acct_d", "good", "replayed")).unwrap();
    for (id, body, headers) in [
        ("good-1", good, origin),
        ("orphan-1", b"{}".to_vec(), FieldTable::default()),
    ] {
        ch.basic_publish(
            onejob::broker::DLX.into(),
            onejob::broker::INTENTS_QUEUE.into(),
            BasicPublishOptions::default(),
            &body,
            onejob::broker::json_properties()
                .with_message_id(id.into())
                .with_headers(headers),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    assert_eq!(common::depth(&ch, &dlq).await, 2);
    let session = served.sign_in(&env.store, "ada").await;

    // Browsing shows both, with the reason, and consumes nothing.
    let (status, page) = served.get(&session.cookie, "/dead-letters").await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(
        page.contains("good-1") && page.contains("orphan-1"),
        "{page}"
    );
    assert!(page.contains("invalid: a test put it here"), "{page}");
    assert_eq!(common::depth(&ch, &dlq).await, 2);

    // Replay the good one: its link leads to a confirmation that says what
    // happens, and the form replays it.
    let start = page.find("class=\"replay-one\" href=\"").unwrap() + 25;
    let link = unescape(&page[start..start + page[start..].find('"').unwrap()]);
    assert!(link.contains("good-1"), "{link}");
    let (status, confirm) = served.get(&session.cookie, &link).await;
    assert_eq!(status, StatusCode::OK, "{confirm}");
    assert!(
        confirm.contains("Republish the dead letter good-1"),
        "{confirm}"
    );
    let form = [
        ("csrf", field(&confirm, "csrf")),
        ("queue", unescape(&field(&confirm, "queue"))),
        ("id", unescape(&field(&confirm, "id"))),
        ("reason", "the intake bug is fixed".to_owned()),
    ];
    let form: Vec<(&str, &str)> = form.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let answer = served
        .post(&session.cookie, "/dead-letters/replay", &form)
        .await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    let back = answer.headers()[LOCATION].to_str().unwrap().to_owned();
    assert!(
        back.contains("replayed=1") && back.contains("skipped=0"),
        "{back}"
    );
    common::wait_for(
        "the replayed intent's job",
        Duration::from_secs(20),
        || async { env.store.find_job("acct_d", "good").await.unwrap() },
    )
    .await;
    common::wait_for_depth("the orphan alone", Duration::from_secs(20), &ch, &dlq, 1).await;

    // Purging without the session's CSRF token does nothing; with it, the
    // queue is empty.
    let answer = served
        .post(
            &session.cookie,
            "/dead-letters/purge",
            &[("queue", &dlq), ("reason", "junk")],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::FORBIDDEN);
    assert_eq!(common::depth(&ch, &dlq).await, 1);
    let (_, confirm) = served
        .get(
            &session.cookie,
            &format!("/dead-letters/confirm?action=purge&queue={dlq}"),
        )
        .await;
    assert!(confirm.contains("Delete the 1 dead letter(s)"), "{confirm}");
    let answer = served
        .post(
            &session.cookie,
            "/dead-letters/purge",
            &[("queue", &dlq), ("reason", "junk"), ("csrf", &session.csrf)],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert_eq!(common::depth(&ch, &dlq).await, 0);

    // Both actions are audited, with who and why.
    let audit = env.store.audit_recent(10).await.unwrap();
    let actions: Vec<(&str, &str, &str)> = audit
        .iter()
        .map(|a| (a.action.as_str(), a.actor.as_str(), a.reason.as_str()))
        .collect();
    assert_eq!(
        actions,
        vec![
            ("dlq.purge", "operator:ada", "junk"),
            ("dlq.replay", "operator:ada", "the intake bug is fixed"),
        ]
    );
    assert_eq!(audit[1].detail["message_id"], "good-1");
    assert_eq!(audit[0].target.as_deref(), Some(dlq.as_str()));
    fleet.stop().await;
}

#[tokio::test]
async fn only_an_unknown_attempt_can_be_resolved_from_the_console() {
    let (config, _file) = config(&text());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let session = served.sign_in(&env.store, "ada").await;
    // An attempt in flight: resolving it would start a second provider call.
    let new = common::new_job("acct_c", "running-1", "running");
    let (job_id, first) = (new.job_id, new.attempt_id);
    env.store.admit(&[new]).await.unwrap();
    env.store
        .start("primary", &[first], Duration::from_secs(30))
        .await
        .unwrap();
    let path = format!("/attempts/{first}/resolve");
    let (status, _) = served
        .get(&session.cookie, &format!("{path}?as=failed"))
        .await;
    assert_eq!(status, StatusCode::CONFLICT);
    let answer = served
        .post(
            &session.cookie,
            &path,
            &[
                ("as", "failed"),
                ("reason", "hand-made"),
                ("csrf", &session.csrf),
            ],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::CONFLICT);
    let job = env.store.job(job_id).await.unwrap().unwrap();
    assert_eq!(job.attempts.len(), 1);
    assert_eq!(job.attempts[0].status, AttemptStatus::Started);
    assert!(env.store.audit_of_job(job_id).await.unwrap().is_empty());
}
