//! Loading and checking configuration text: defaults, every refusal, and
//! the messages that name the setting.

use std::time::Duration;

use super::*;

#[test]
fn embedded_defaults_load() {
    let c = Config::parse(EMBEDDED_DEFAULT, "embedded defaults").unwrap();
    assert!(c.operations.contains_key("summarize"));
    assert_eq!(c.operations["summarize"].route[0], "primary");
    assert_eq!(c.worker.delivery_limit, 5);
}

fn with(extra: &str) -> String {
    format!("{EMBEDDED_DEFAULT}\n{extra}")
}

#[test]
fn bad_settings_are_named() {
    let cases = [
        (with("[worker]\nbogus = 1"), "bogus"),
        (
            with("[worker]\nretry_backoff = \"soon\""),
            "worker.retry_backoff",
        ),
        (
            with("[worker]\ndelivery_limit = 0"),
            "worker.delivery_limit",
        ),
        (
            EMBEDDED_DEFAULT.replace("route = [\"primary\"]", "route = [\"nope\"]"),
            "operations.summarize.route[0]",
        ),
        (
            EMBEDDED_DEFAULT.replace("kind = \"openai\"", "kind = \"grpc\""),
            "providers.primary.kind",
        ),
        (
            EMBEDDED_DEFAULT.replace("http://127.0.0.1:8081/v1", "not a url"),
            "providers.primary.base_url",
        ),
        (
            EMBEDDED_DEFAULT.replace(
                "http://127.0.0.1:8081/v1",
                "http://u:secret@127.0.0.1:8081/v1",
            ),
            "providers.primary.base_url",
        ),
        (
            EMBEDDED_DEFAULT.replace("Summarize: {{ text }}", "Summarize: {{ text "),
            "operations.summarize.prompt",
        ),
        (
            EMBEDDED_DEFAULT.replace("type = \"object\"", "type = \"objekt\""),
            "operations.summarize.output_schema",
        ),
        (
            EMBEDDED_DEFAULT.replace("timeout = \"30s\"", "timeout = \"0s\""),
            "providers.primary.timeout",
        ),
    ];
    for (text, setting) in cases {
        let err = Config::parse(&text, "t").expect_err(setting).to_string();
        assert!(err.contains(setting), "{setting}: {err}");
        assert!(!err.contains("secret"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

/// Issue 9: a parse error names the line it is on, first, middle or last.
#[test]
fn parse_errors_name_their_own_line() {
    let lines: Vec<&str> = EMBEDDED_DEFAULT.lines().collect();
    let tail = format!("{EMBEDDED_DEFAULT}\nbogus =");
    let last = tail.lines().count();
    for (at, text) in [
        (1, format!("bogus = \n{EMBEDDED_DEFAULT}")),
        (5, {
            let mut l = lines.clone();
            l[4] = "[providers.primary";
            l.join("\n")
        }),
        (last, tail.clone()),
    ] {
        let err = Config::parse(&text, "t").unwrap_err().to_string();
        assert!(
            err.ends_with(&format!("(at line {at})")),
            "line {at}: {err}"
        );
    }
    assert_eq!(line_of("a\nb\nc", 0), 1);
    assert_eq!(line_of("a\nb\nc", 2), 2);
    assert_eq!(line_of("a\nb\nc", 99), 3);
}

#[test]
fn provider_limits_have_defaults_and_bounds() {
    let c = Config::parse(EMBEDDED_DEFAULT, "t").unwrap();
    let p = &c.providers["primary"];
    assert_eq!(p.max_retry_after, Duration::from_secs(600));
    assert_eq!(p.unknown_statuses, vec![504, 524]);
    assert_eq!(p.max_response_bytes, DEFAULT_MAX_RESPONSE_BYTES);
    let text = EMBEDDED_DEFAULT.replace(
        "model = \"mock-model\"",
        "model = \"mock-model\"\nmax_retry_after = \"1m\"\nunknown_statuses = []",
    );
    let c = Config::parse(&text, "t").unwrap();
    assert_eq!(
        c.providers["primary"].max_retry_after,
        Duration::from_secs(60)
    );
    assert!(c.providers["primary"].unknown_statuses.is_empty());
    for (extra, setting) in [
        (
            "unknown_statuses = [5040]",
            "providers.primary.unknown_statuses",
        ),
        (
            "max_response_bytes = 10",
            "providers.primary.max_response_bytes",
        ),
        (
            "max_retry_after = \"0s\"",
            "providers.primary.max_retry_after",
        ),
    ] {
        let text = EMBEDDED_DEFAULT.replace(
            "model = \"mock-model\"",
            &format!("model = \"mock-model\"\n{extra}"),
        );
        let err = Config::parse(&text, "t").unwrap_err().to_string();
        assert!(err.contains(setting), "{err}");
    }
}

/// The tuning settings have defaults that suit a small machine, and bounds
/// that name the setting.
#[test]
fn retention_has_defaults_overrides_and_bounds() {
    const DAY: u64 = 24 * 3600;
    let c = Config::parse(EMBEDDED_DEFAULT, "t").unwrap();
    let defaults = Retention {
        succeeded: Duration::from_secs(7 * DAY),
        failed: Duration::from_secs(30 * DAY),
        cancelled: Duration::from_secs(7 * DAY),
    };
    assert_eq!(c.retention, defaults);
    assert_eq!(c.operations["summarize"].retention, defaults);

    // [retention] over the defaults, and an operation's own table over that.
    let text = EMBEDDED_DEFAULT.replace(
        "[operations.summarize]",
        "[operations.summarize]\nretention = { failed = \"2d\" }",
    ) + "\n[retention]\nsucceeded = \"24h\"\n";
    let c = Config::parse(&text, "t").unwrap();
    assert_eq!(c.retention.succeeded, Duration::from_secs(DAY));
    assert_eq!(c.retention.failed, Duration::from_secs(30 * DAY));
    let op = c.operations["summarize"].retention;
    assert_eq!(
        (op.succeeded, op.failed, op.cancelled),
        (
            Duration::from_secs(DAY),
            Duration::from_secs(2 * DAY),
            Duration::from_secs(7 * DAY)
        )
    );

    for (bad, message) in [
        (
            "[retention]\nsucceeded = \"soon\"",
            "retention.succeeded: \"soon\" is not a duration",
        ),
        (
            "[retention]\nfailed = \"30m\"",
            "retention.failed: must be at least worker.outbox_retention (1h)",
        ),
        (
            "[retention]\ncancelled = \"3651days\"",
            "retention.cancelled: must be at most 3650 days",
        ),
        ("[retention]\nkept = \"1d\"", "unknown field `kept`"),
    ] {
        let e = Config::parse(&format!("{EMBEDDED_DEFAULT}\n{bad}\n"), "t")
            .unwrap_err()
            .to_string();
        assert!(e.contains(message), "{bad}: {e}");
    }
    let text = EMBEDDED_DEFAULT.replace(
        "[operations.summarize]",
        "[operations.summarize]\nretention = { succeeded = \"10m\" }",
    );
    let e = Config::parse(&text, "t").unwrap_err().to_string();
    assert!(
        e.contains("operations.summarize.retention.succeeded: must be at least"),
        "{e}"
    );
}

#[test]
fn tuning_has_defaults_and_bounds() {
    let c = Config::parse(EMBEDDED_DEFAULT, "t").unwrap();
    assert_eq!(c.worker.intake_prefetch, 256);
    assert_eq!(
        (
            c.worker.attempt_prefetch,
            c.worker.batch_size,
            c.worker.flush_interval,
            c.worker.pool_size
        ),
        (512, 128, Duration::from_millis(5), 8)
    );
    let with = |worker: &str| format!("[worker]\n{worker}\n{EMBEDDED_DEFAULT}");
    let c = Config::parse(
        &with("batch_size = 1000\nflush_interval = \"1s\"\npool_size = 2\nattempt_prefetch = 1"),
        "t",
    )
    .unwrap();
    assert_eq!(
        (
            c.worker.batch_size,
            c.worker.flush_interval,
            c.worker.pool_size
        ),
        (1000, Duration::from_secs(1), 2)
    );
    for (bad, message) in [
        ("batch_size = 0", "worker.batch_size: must be at least 1"),
        (
            "batch_size = 1001",
            "worker.batch_size: must be at most 1000",
        ),
        (
            "flush_interval = \"0ms\"",
            "worker.flush_interval: must be greater than zero",
        ),
        (
            "flush_interval = \"2s\"",
            "worker.flush_interval: must be at most 1s",
        ),
        ("pool_size = 1", "worker.pool_size: must be at least 2"),
        (
            "attempt_prefetch = 0",
            "worker.attempt_prefetch: must be at least 1",
        ),
        (
            "attempt_prefetch = 70000",
            "worker.attempt_prefetch: must be at most 65535",
        ),
        (
            "intake_prefetch = 70000",
            "worker.intake_prefetch: must be at most 65535",
        ),
        (
            "reply_queues = [\"onejob.attempts.primary\"]",
            "worker.reply_queues: \"onejob.attempts.primary\" is onejob's or the broker's own queue",
        ),
        (
            "reply_queues = [\"\"]",
            "worker.reply_queues: \"\": a queue name is 1 to 255 bytes",
        ),
    ] {
        let err = Config::parse(&with(bad), "t").unwrap_err().to_string();
        assert!(err.contains(message), "{bad}: {err}");
    }
}

/// No duration from configuration can make later time arithmetic overflow.
#[test]
fn durations_are_bounded() {
    for setting in [
        "retry_backoff_max",
        "relay_interval",
        "shutdown_grace",
        "stuck_after",
    ] {
        let err = Config::parse(&with(&format!("[worker]\n{setting} = \"9999y\"")), "t")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("worker.{setting}")) && err.contains("at most"),
            "{err}"
        );
    }
    let text = EMBEDDED_DEFAULT.replace("timeout = \"30s\"", "timeout = \"400days\"");
    let err = Config::parse(&text, "t").unwrap_err().to_string();
    assert!(err.contains("providers.primary.timeout"), "{err}");
}

/// Item 13 of issue 8: by default a stopping worker waits out the longest
/// provider call, so a deploy creates no unknowns; a shorter grace set by hand
/// is warned about.
#[test]
fn the_default_shutdown_grace_outlasts_the_longest_call() {
    let slow = EMBEDDED_DEFAULT.replace("timeout = \"30s\"", "timeout = \"2m\"");
    let c = Config::parse(&slow, "t").unwrap();
    assert!(
        c.worker.shutdown_grace > Duration::from_secs(120),
        "{:?}",
        c.worker.shutdown_grace
    );
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let c = Config::parse(
        &EMBEDDED_DEFAULT.replace("timeout = \"30s\"", "timeout = \"5s\""),
        "t",
    )
    .unwrap();
    assert_eq!(
        c.worker.shutdown_grace,
        Duration::from_secs(30),
        "never below 30s"
    );
    let short = format!("{slow}\n[worker]\nshutdown_grace = \"10s\"");
    let c = Config::parse(&short, "t").unwrap();
    assert_eq!(c.worker.shutdown_grace, Duration::from_secs(10));
    assert_eq!(c.warnings.len(), 1);
    assert!(
        c.warnings[0].contains("worker.shutdown_grace")
            && c.warnings[0].contains("providers.primary.timeout"),
        "{}",
        c.warnings[0]
    );
}

#[test]
fn admit_checks_operation_and_provider() {
    let c = Config::parse(EMBEDDED_DEFAULT, "t").unwrap();
    let mut i = Intent {
        owner_id: "o".into(),
        idempotency_key: "k".into(),
        operation: "summarize".into(),
        input: serde_json::from_str(r#"{"text":"fox"}"#).unwrap(),
        provider: None,
    };
    assert_eq!(c.admit(&i).unwrap().1, "primary");
    // An input the prompt cannot render from is refused at once.
    let bad = Intent {
        input: serde_json::from_str(r#"{"txt":"fox"}"#).unwrap(),
        ..i.clone()
    };
    let refused = c.admit(&bad).unwrap_err().to_string();
    assert!(
        refused.starts_with("bad_input: the input does not fit operation \"summarize\"")
            && refused.contains("text"),
        "{refused}"
    );
    i.provider = Some("elsewhere".into());
    assert!(matches!(
        c.admit(&i),
        Err(RejectReason::ProviderNotInRoute { .. })
    ));
    i.operation = "translate".into();
    assert!(matches!(
        c.admit(&i),
        Err(RejectReason::UnknownOperation(_))
    ));
}

#[test]
fn render_is_strict_and_output_is_checked() {
    let c = Config::parse(EMBEDDED_DEFAULT, "t").unwrap();
    let op = &c.operations["summarize"];
    let input: serde_json::Map<String, Value> = serde_json::from_str(r#"{"text":"fox"}"#).unwrap();
    assert_eq!(c.render(op, &input).unwrap().user, "Summarize: fox");
    let err = c.render(op, &Default::default()).unwrap_err();
    assert!(err.to_string().starts_with("template_error"), "{err}");

    op.check_output(r#"{"summary":"s"}"#).unwrap();
    let e = op.check_output("Sure! Here it is").unwrap_err().to_string();
    assert!(
        e.starts_with("contract_violation: content is not JSON"),
        "{e}"
    );
    let e = op
        .check_output(r#"{"summary":"s","extra":1}"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("contract_violation") && e.contains("extra"),
        "{e}"
    );
    let e = op.check_output(r#"{"summary":7}"#).unwrap_err().to_string();
    assert!(e.contains("/summary"), "{e}");
}

#[test]
fn a_contract_violation_names_the_offending_value_in_a_bounded_excerpt() {
    let c = Config::parse(EMBEDDED_DEFAULT, "t").unwrap();
    let op = &c.operations["summarize"];
    let huge = format!(r#"{{"summary":[{}1]}}"#, "1,".repeat(500_000));
    let e = op.check_output(&huge).unwrap_err().to_string();
    assert!(
        e.starts_with("contract_violation: at /summary"),
        "{}",
        &e[..100]
    );
    assert!(e.len() <= 600, "{} bytes", e.len());
    assert!(e.ends_with('…'), "cut, and says so");
    let extra = format!(r#"{{"summary":"s","{}":1}}"#, "k".repeat(100_000));
    let e = op.check_output(&extra).unwrap_err().to_string();
    assert!(e.len() <= 600, "{} bytes", e.len());
}

/// `evidence`, `evidence_delay`, `evidence_deadline` and `idempotency_header`
/// (contract section 7, Evidence): defaults, each kind, and each refusal named.
#[test]
fn evidence_settings_have_defaults_and_bounds() {
    let with_primary = |extra: &str| {
        EMBEDDED_DEFAULT.replace(
            "model = \"mock-model\"",
            &format!("model = \"mock-model\"\n{extra}"),
        )
    };
    let p = Config::parse(EMBEDDED_DEFAULT, "t").unwrap().providers["primary"].clone();
    assert_eq!(p.evidence.kind, EvidenceKind::None);
    assert_eq!(p.evidence.delay, DEFAULT_EVIDENCE_DELAY);
    assert_eq!(p.evidence.deadline, DEFAULT_EVIDENCE_DEADLINE);
    assert_eq!(p.idempotency_header.as_str(), "idempotency-key");
    for (text, kind) in [
        ("evidence = \"stored\"", EvidenceKind::Stored),
        (
            "evidence = \"idempotency_key\"",
            EvidenceKind::IdempotencyKey,
        ),
        ("evidence = \"none\"", EvidenceKind::None),
    ] {
        let c = Config::parse(&with_primary(text), "t").unwrap();
        assert_eq!(c.providers["primary"].evidence.kind, kind, "{text}");
    }
    let c = Config::parse(
        &with_primary(
            "evidence = \"stored\"\nevidence_delay = \"2s\"\nevidence_deadline = \"40s\"\n\
             idempotency_header = \"X-Request-Key\"",
        ),
        "t",
    )
    .unwrap();
    let p = &c.providers["primary"];
    assert_eq!(p.evidence.delay, Duration::from_secs(2));
    assert_eq!(p.evidence.deadline, Duration::from_secs(40));
    assert_eq!(p.idempotency_header.as_str(), "x-request-key");
    // A timeout past the default deadline moves the default, not the check.
    let c = Config::parse(
        &EMBEDDED_DEFAULT.replace("timeout = \"30s\"", "timeout = \"15m\""),
        "t",
    )
    .unwrap();
    assert_eq!(
        c.providers["primary"].evidence.deadline,
        Duration::from_secs(15 * 60 + 5)
    );
}

/// Each evidence setting that cannot work is refused, naming it.
#[test]
fn evidence_settings_that_cannot_work_are_named() {
    let with_primary = |extra: &str| {
        EMBEDDED_DEFAULT.replace(
            "model = \"mock-model\"",
            &format!("model = \"mock-model\"\n{extra}"),
        )
    };
    for (extra, setting, says) in [
        (
            "evidence = \"ledger\"",
            "evidence",
            "not a kind of evidence",
        ),
        (
            "evidence_delay = \"0s\"",
            "evidence_delay",
            "greater than zero",
        ),
        (
            "evidence_deadline = \"34s\"",
            "evidence_deadline",
            "at least timeout + evidence_delay (35s)",
        ),
        (
            "idempotency_header = \"two words\"",
            "idempotency_header",
            "not a header name",
        ),
        (
            "idempotency_header = \"Authorization\"",
            "idempotency_header",
            "needs for something else",
        ),
        (
            "idempotency_header = \"X-Api-Key\"",
            "idempotency_header",
            "needs for something else",
        ),
    ] {
        let err = Config::parse(&with_primary(extra), "t")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("providers.primary.{setting}")) && err.contains(says),
            "{extra}: {err}"
        );
    }
}

/// `kind`: each kind parses, and evidence its API cannot give is refused,
/// naming the setting and why.
#[test]
fn each_kind_parses_and_takes_only_the_evidence_its_api_gives() {
    let anthropic = |extra: &str| {
        EMBEDDED_DEFAULT.replace(
            "kind = \"openai\"",
            &format!("kind = \"anthropic\"\n{extra}"),
        )
    };
    let c = Config::parse(&anthropic(""), "t").unwrap();
    let p = &c.providers["primary"];
    assert_eq!(p.kind, ProviderKind::Anthropic);
    assert_eq!(p.evidence.kind, EvidenceKind::None);
    let c = Config::parse(&anthropic("evidence = \"idempotency_key\""), "t").unwrap();
    assert_eq!(
        c.providers["primary"].evidence.kind,
        EvidenceKind::IdempotencyKey
    );
    let err = Config::parse(&anthropic("evidence = \"stored\""), "t")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("providers.primary.evidence")
            && err.contains("kind \"anthropic\" cannot have evidence \"stored\""),
        "{err}"
    );
    // Its API takes a temperature of 0.0 to 1.0; OpenAI's up to 2.0.
    let hot = |text: String| text.replace("temperature = 0.0", "temperature = 1.5");
    assert!(Config::parse(&hot(EMBEDDED_DEFAULT.to_owned()), "t").is_ok());
    let err = Config::parse(&hot(anthropic("")), "t")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("operations.summarize.temperature") && err.contains("at most 1.0"),
        "{err}"
    );
    let err = Config::parse(
        &EMBEDDED_DEFAULT.replace("kind = \"openai\"", "kind = \"Anthropic\""),
        "t",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("expected \"openai\" or \"anthropic\""),
        "{err}"
    );
}
