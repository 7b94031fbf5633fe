//! Clients that are slow or greedy: headers or a body that stop arriving are
//! cut off, and one owner cannot hold what another needs.

use std::time::Duration;

use futures_util::future::join_all;
use onejob_producer::gateway::GatewayOptions;
use reqwest::StatusCode;

use super::{SUMMARIZE, Served};
use crate::common::raw_http::{stalled, until_closed};
use crate::common::wait_for;

/// 300 connections that send half a request line and stop are each closed
/// once the header timeout passes, whatever the connection limit lets in at
/// once; and a client that sends whole requests is served, during and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_headers_are_cut_off_and_hold_no_connection() {
    let options = GatewayOptions {
        header_timeout: Duration::from_secs(1),
        max_connections: 64,
        ..GatewayOptions::default()
    };
    let s = Served::start_with(false, options).await;
    let mut slow = Vec::new();
    for _ in 0..300 {
        slow.push(stalled(&s.base, "POST /v1/jo").await);
    }
    let served = tokio::spawn({
        let http = s.http.clone();
        let url = format!("{}/healthz", s.base);
        async move { http.get(url).send().await.map(|r| r.status()) }
    });
    let closed = join_all(
        slow.iter_mut()
            .map(|c| tokio::time::timeout(Duration::from_secs(60), until_closed(c))),
    )
    .await;
    let open = closed.iter().filter(|c| c.is_err()).count();
    assert_eq!(open, 0, "{open} of 300 slow connections were never closed");
    assert_eq!(served.await.unwrap().unwrap(), StatusCode::OK);
    // A new connection: the client's kept-alive one is closed once idle past
    // the header timeout, as it should be.
    let fresh = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let after = fresh
        .get(format!("{}/healthz", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(after.status(), StatusCode::OK);
    s.stop().await;
}

/// A body that stops arriving is answered `408 request_timeout` once the body
/// timeout passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_body_that_stops_arriving_is_answered_408() {
    let options = GatewayOptions {
        body_timeout: Duration::from_secs(1),
        ..GatewayOptions::default()
    };
    let s = Served::start_with(false, options).await;
    let token = s.token("acct_slow");
    let mut c = stalled(
        &s.base,
        &format!(
            "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
             Idempotency-Key: k-slow\r\nContent-Type: application/json\r\n\
             Content-Length: 1000\r\n\r\n{{\"operation\""
        ),
    )
    .await;
    // Well before the 30 s default: the setting holds.
    let answer = tokio::time::timeout(Duration::from_secs(20), until_closed(&mut c))
        .await
        .expect("an answer");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");
    s.stop().await;
}

/// While one owner holds many slow requests open, another owner is served:
/// what one owner may hold at once (requests, and bytes declared in flight) is
/// bounded, and each refusal is counted for its owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_owner_cannot_starve_another() {
    // The process-wide cap is not what this test is about: it stays above the
    // 101 requests opened here, so that every refusal is the owner's. (Each
    // request holds a process-wide slot while its token is looked up; 100 at
    // once under a 64 cap met that cap first, a 503, when lookups were slow.)
    let options = GatewayOptions {
        max_in_flight: 256,
        max_in_flight_per_owner: 8,
        max_bytes_in_flight_per_owner: 64 << 10,
        body_timeout: Duration::from_secs(10),
        ..GatewayOptions::default()
    };
    let s = Served::start_with(true, options).await;
    let greedy = s.token("acct_greedy");
    let polite = s.token("acct_polite");
    let head = |key: usize, length: usize| {
        format!(
            "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {greedy}\r\n\
             Idempotency-Key: k-{key}\r\nContent-Type: application/json\r\n\
             Content-Length: {length}\r\n\r\n"
        )
    };
    // Seven requests that declare 8 KiB each and send nothing: 56 KiB of the
    // owner's 64 KiB held.
    let mut held = Vec::new();
    for key in 0..7 {
        held.push(stalled(&s.base, &head(key, 8 << 10)).await);
    }
    wait_for("the seven to be held", Duration::from_secs(30), || async {
        onejob::edges::metrics::render()
            .contains("onejob_gateway_in_flight 7")
            .then_some(())
    })
    .await;
    // One more of 16 KiB would pass the bytes budget, though it is under the
    // request limit: refused at once, with why.
    let mut big = stalled(&s.base, &head(7, 16 << 10)).await;
    let answer = tokio::time::timeout(Duration::from_secs(30), until_closed(&mut big))
        .await
        .expect("a refusal, not a wait");
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    assert!(answer.contains("bytes in flight"), "{answer}");

    // 93 small ones: one takes the owner's eighth place, the other 92 are
    // refused at once.
    let (answers, mut refusals) = tokio::sync::mpsc::unbounded_channel();
    for key in 100..193 {
        let mut c = stalled(&s.base, &head(key, 100)).await;
        let answers = answers.clone();
        tokio::spawn(async move {
            let answer = until_closed(&mut c).await;
            let _ = answers.send(answer);
            c
        });
    }
    for _ in 0..92 {
        let answer = tokio::time::timeout(Duration::from_secs(30), refusals.recv())
            .await
            .expect("92 refusals, not waits")
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
        assert!(answer.contains("too_many_requests"), "{answer}");
    }
    // Another owner is served meanwhile.
    let answer = s.post(Some(&polite), Some("k-polite"), SUMMARIZE).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");

    let metrics = onejob::edges::metrics::render();
    for reason in ["requests", "bytes"] {
        let line = format!(
            "onejob_gateway_refused_total{{owner=\"acct_greedy\",reason=\"{reason}_in_flight\"}}"
        );
        assert!(metrics.contains(&line), "{line} in:\n{metrics}");
    }
    assert!(!metrics.contains("owner=\"acct_polite\""), "{metrics}");
    drop(held);
    s.stop().await;
}

/// Past the process-wide cap on requests in flight, a request is answered
/// `503` at once, saying why, whoever sends it; once one in flight ends, the
/// next is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_the_process_wide_cap_a_request_is_answered_503_at_once() {
    let options = GatewayOptions {
        max_in_flight: 4,
        ..GatewayOptions::default()
    };
    let s = Served::start_with(true, options).await;
    let many = s.token("acct_many");
    let other = s.token("acct_other");
    let mut held = Vec::new();
    for key in 0..4 {
        let head = format!(
            "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {many}\r\n\
             Idempotency-Key: k-{key}\r\nContent-Type: application/json\r\n\
             Content-Length: 100\r\n\r\n"
        );
        held.push(stalled(&s.base, &head).await);
    }
    let in_flight = |n: usize| async move {
        onejob::edges::metrics::render()
            .contains(&format!("onejob_gateway_in_flight {n}\n"))
            .then_some(())
    };
    wait_for("the four to be held", Duration::from_secs(30), || {
        in_flight(4)
    })
    .await;
    let refused = tokio::time::timeout(
        Duration::from_secs(10),
        s.post(Some(&other), Some("k-other"), SUMMARIZE),
    )
    .await
    .expect("a refusal, not a wait");
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    assert!(
        refused
            .body
            .to_string()
            .contains("too many requests in flight"),
        "{refused:?}"
    );
    drop(held.pop());
    wait_for("one to end", Duration::from_secs(30), || in_flight(3)).await;
    let served = s.post(Some(&other), Some("k-other"), SUMMARIZE).await;
    assert_eq!(served.status, StatusCode::CREATED, "{served:?}");
    drop(held);
    s.stop().await;
}
