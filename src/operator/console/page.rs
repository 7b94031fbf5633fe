//! Rendering: the compiled-in templates, a page or a failure as an answer,
//! the stylesheet, and the small formatting helpers pages share.

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use minijinja::{Environment, context};

use super::Console;
use super::failure::Failure;
use super::session::Operator;

/// The templates, compiled in. Names ending in `.html` are autoescaped.
pub(super) fn templates() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    for (name, text) in [
        ("base.html", include_str!("templates/base.html")),
        ("login.html", include_str!("templates/login.html")),
        ("overview.html", include_str!("templates/overview.html")),
        ("jobs.html", include_str!("templates/jobs.html")),
        ("job.html", include_str!("templates/job.html")),
        ("unknowns.html", include_str!("templates/unknowns.html")),
        ("confirm.html", include_str!("templates/confirm.html")),
        (
            "dead_letters.html",
            include_str!("templates/dead_letters.html"),
        ),
        (
            "confirm_dead_letters.html",
            include_str!("templates/confirm_dead_letters.html"),
        ),
        ("message.html", include_str!("templates/message.html")),
        ("providers.html", include_str!("templates/providers.html")),
        ("owners.html", include_str!("templates/owners.html")),
        (
            "confirm_qualify.html",
            include_str!("templates/confirm_qualify.html"),
        ),
    ] {
        env.add_template(name, text)
            .unwrap_or_else(|e| panic!("console template {name}: {e}"));
    }
    env
}

/// A place on the timeline (0 to 100 percent) in the half percents of its
/// `x` and `w` classes.
pub(super) fn half_percents(percent: f64) -> u32 {
    (percent.clamp(0.0, 100.0) * 2.0).round() as u32
}

/// The console's stylesheet, with the timeline's place and length classes.
pub(super) static STYLESHEET: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let mut css = include_str!("templates/console.css").to_owned();
    for n in 0..=200u32 {
        let percent = f64::from(n) / 2.0;
        css.push_str(&format!(
            ".x{n} {{ left: {percent}%; }} .w{n} {{ width: {percent}%; }}\n"
        ));
    }
    css
});

pub(super) async fn stylesheet() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        STYLESHEET.as_str(),
    )
        .into_response()
}

pub(super) async fn not_found(State(app): State<Console>) -> Response {
    app.message(
        None,
        Failure(StatusCode::NOT_FOUND, "There is no such page.".into()),
    )
}

/// A duration in seconds as people read it: `42s`, `3m 5s`, `2h 1m`, `4d 3h`.
pub(super) fn age(seconds: f64) -> String {
    let s = seconds.max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86400 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86400, s % 86400 / 3600),
    }
}

/// An empty form field is no filter.
pub(super) fn given(v: &Option<String>) -> Option<String> {
    v.as_deref()
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_owned)
}

impl Console {
    pub(super) fn render(&self, name: &str, ctx: minijinja::Value) -> Response {
        match self.0.pages.get_template(name).and_then(|t| t.render(ctx)) {
            Ok(html) => {
                ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], html).into_response()
            }
            Err(e) => {
                tracing::error!(error = %e, page = name, "console: a page failed to render");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the page failed to render",
                )
                    .into_response()
            }
        }
    }

    pub(super) fn message(&self, who: Option<&Operator>, failure: Failure) -> Response {
        let Failure(status, text) = failure;
        let mut page = self.render(
            "message.html",
            context! {
                title => status.canonical_reason().unwrap_or("Error"),
                operator => who.map(|o| o.name.clone()),
                csrf => who.map(|o| o.csrf.clone()),
                text,
            },
        );
        *page.status_mut() = status;
        page
    }
}
