//! Signing in and the session: only a live operator token signs in, from the
//! console's own form; the cookie's flags; an action without its CSRF token
//! is refused and does nothing.

use crate::common::console::{
    FORM, Served, encode, field, serve, session_set, two_providers, unknown_job,
};
use crate::common::{TestEnv, config};
use onejob::domain::JobStatus;
use onejob::settings::token::Token;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_TYPE, LOCATION, SET_COOKIE};

#[tokio::test]
async fn only_a_live_operator_token_signs_in() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    tokens_not_an_operators_are_refused(&env, &served).await;

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
        .tokens()
        .create_operator_token("ada", &token, &onejob::edges::store::Actor::cli(None))
        .await
        .unwrap();
    let answer = served.login(token.reveal()).await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    let set = session_set(&answer).unwrap();
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
        .login_with(token.reveal(), &[("x-forwarded-proto", "https")])
        .await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert!(session_set(&answer).unwrap().contains("Secure"));

    // Revoking the token ends its sessions at once.
    env.store
        .tokens()
        .revoke_operator_token(id, &onejob::edges::store::Actor::cli(None))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(served.get(&cookie, "/").await.0, StatusCode::SEE_OTHER);
    assert_eq!(
        served.login(token.reveal()).await.status(),
        StatusCode::UNAUTHORIZED
    );
}

/// A tenant's gateway token is refused, and says why; so are an operator
/// token nobody made, and garbage.
async fn tokens_not_an_operators_are_refused(env: &TestEnv, served: &Served) {
    let tenant = Token::generate();
    env.store
        .tokens()
        .create_token("acct_c", &tenant, &onejob::edges::store::Actor::cli(None))
        .await
        .unwrap();
    let answer = served.login(tenant.reveal()).await;
    assert_eq!(answer.status(), StatusCode::UNAUTHORIZED);
    assert!(session_set(&answer).is_none());
    assert!(answer.text().await.unwrap().contains("tenant"));

    for bad in [
        Token::generate_operator().reveal().to_owned(),
        "ojo_123".into(),
        String::new(),
    ] {
        let answer = served.login(&bad).await;
        assert_eq!(answer.status(), StatusCode::UNAUTHORIZED, "{bad:?}");
        assert!(session_set(&answer).is_none());
    }
}

/// Login CSRF: a page of another site could post the sign-in form with the
/// attacker's own operator token and sign the victim's browser in as the
/// attacker (whose actions the victim would then take). The form carries a
/// token that matches a cookie only the console's own sign-in page sets.
#[tokio::test]
async fn a_sign_in_not_from_the_consoles_own_form_is_refused() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let token = Token::generate_operator();
    env.store
        .tokens()
        .create_operator_token("mallory", &token, &onejob::edges::store::Actor::cli(None))
        .await
        .unwrap();
    let sessions = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM operator_sessions")
            .fetch_one(env.store.pool())
            .await
            .unwrap()
    };

    let (cookie, field_value) = sign_in_form(&served).await;

    // Posted without the cookie (as from another site), with another form's
    // token, or with none: refused, and no session begins.
    for (cookie, form_token) in [
        (None, Some(field_value.as_str())),
        (Some(cookie.as_str()), Some(&"0".repeat(64)[..])),
        (Some(cookie.as_str()), None),
    ] {
        let answer = post_sign_in(&served, token.reveal(), cookie, form_token).await;
        assert_eq!(
            answer.status(),
            StatusCode::FORBIDDEN,
            "{cookie:?} {form_token:?}"
        );
        assert!(session_set(&answer).is_none(), "no session cookie");
        assert!(
            answer
                .text()
                .await
                .unwrap()
                .contains("reload the sign-in page")
        );
    }
    assert_eq!(sessions().await, 0);

    // The right pair, but the browser says another site's page posted it (a
    // sibling host can plant a cookie; it cannot make the browser say
    // same-origin): refused.
    let answer = served
        .http
        .post(format!("{}/login", served.base))
        .header(CONTENT_TYPE, FORM)
        .header(reqwest::header::COOKIE, &cookie)
        .header("sec-fetch-site", "same-site")
        .body(encode(&[
            ("token", token.reveal()),
            ("login_csrf", &field_value),
        ]))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::FORBIDDEN);
    assert_eq!(sessions().await, 0);

    // The console's own form signs in.
    let answer = served.login(token.reveal()).await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert_eq!(sessions().await, 1);
}

/// The sign-in page's own form: a field, and a cookie for /login alone. The
/// cookie (its name and value) and the field's value.
async fn sign_in_form(served: &Served) -> (String, String) {
    let page = served
        .http
        .get(format!("{}/login", served.base))
        .send()
        .await
        .unwrap();
    let set = page.headers()[SET_COOKIE].to_str().unwrap().to_owned();
    assert!(set.starts_with("onejob_login="), "{set}");
    for flag in ["HttpOnly", "SameSite=Strict", "Path=/login"] {
        assert!(set.contains(flag), "{flag} in {set}");
    }
    let cookie = set.split(';').next().unwrap().to_owned();
    let field_value = field(&page.text().await.unwrap(), "login_csrf");
    (cookie, field_value)
}

/// Posts the sign-in form with `token`, the form's token `form_token` and the
/// sign-in `cookie`, each only if given.
async fn post_sign_in(
    served: &Served,
    token: &str,
    cookie: Option<&str>,
    form_token: Option<&str>,
) -> reqwest::Response {
    let mut form = vec![("token", token)];
    if let Some(t) = form_token {
        form.push(("login_csrf", t));
    }
    let mut request = served
        .http
        .post(format!("{}/login", served.base))
        .header(CONTENT_TYPE, FORM)
        .body(encode(&form));
    if let Some(c) = cookie {
        request = request.header(reqwest::header::COOKIE, c);
    }
    request.send().await.unwrap()
}

#[tokio::test]
async fn an_action_without_its_csrf_token_is_refused_and_does_nothing() {
    let (config, _file) = config(&two_providers());
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
    // The right token, in a form the browser says another site's page sent
    // (a page cannot set Sec-Fetch-Site): refused too.
    for site in ["cross-site", "same-site"] {
        let answer = served
            .http
            .post(format!("{}{path}", served.base))
            .header(reqwest::header::COOKIE, &session.cookie)
            .header("sec-fetch-site", site)
            .header(CONTENT_TYPE, FORM)
            .body(encode(&[
                ("as", "failed"),
                ("reason", "from a sibling host"),
                ("csrf", &session.csrf),
            ]))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::FORBIDDEN, "{site}");
    }
    // Signing out needs it too.
    let answer = served.post(&session.cookie, "/logout", &[]).await;
    assert_eq!(answer.status(), StatusCode::FORBIDDEN);
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Unknown, "nothing was resolved");
    assert_eq!(job.attempts.len(), 1);
    assert!(env.store.audit().of_job(job_id).await.unwrap().is_empty());
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
        env.store.jobs().job(job_id).await.unwrap().unwrap().status,
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
