//! Calling a provider's batch API: OpenAI's Files and Batches ([`openai`])
//! and Anthropic's Message Batches ([`anthropic`]). A batch of attempts is
//! sent as one, each line named by its attempt (`custom_id`) and built by
//! the kind's wire format as a live call's body is; its status is read; its
//! results are read back line by line, and each line is judged exactly as a
//! live answer of its kind is ([`super::answer::judge`]): the same output
//! contract, usage, request id, size limit and escaping.
//!
//! The transport is the live client's ([`super::Client`]): its timeouts,
//! its key, no redirect followed, and the dispatch phase. A send refused
//! before it left created nothing (`Refused`); one lost after it left may
//! have made a batch (`Unknown`), which is looked for by the metadata that
//! names onejob's own batch ([`BatchClient::find`]) before anything is sent
//! again. Addresses come from the provider's configuration only: a results
//! address the provider names is never followed.
//!
//! The client reports what the provider says and decides nothing: a result
//! whose `custom_id` names no line, or one given twice, is returned as it
//! came, for the settlement to drop or to settle once.
//!
//! Nothing outside its conformance suite calls it yet: the batch role that
//! will (issue 43) is the next step. The lint below fails the build once
//! something does, so that it is removed then.
#![cfg_attr(
    not(test),
    expect(
        dead_code,
        reason = "the batch role that calls it is issue 43's next step"
    )
)]

pub(crate) mod anthropic;
#[cfg(test)]
mod conformance;
pub(crate) mod openai;

use serde_json::Value;

use super::answer::{Answer, CallError, excerpt, judge};
use super::{Client, classify};
use crate::domain::AttemptId;
use crate::settings::config::{Operation, Provider, ProviderKind, Rendered};

/// The metadata key that names onejob's batch on a provider's batch.
pub(crate) const BATCH_METADATA: &str = "onejob_batch";

/// The most bytes one read of a batch (its status, or all its results) may
/// hold: a provider cannot make a worker hold more.
const MAX_READ_BYTES: usize = 512 << 20;

/// One request of a batch: the attempt it is, and the body a live call of
/// it would send.
#[derive(Clone, Debug)]
pub(crate) struct Line {
    pub(crate) attempt: AttemptId,
    pub(crate) body: Value,
}

/// Where a provider's batch stands.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum State {
    /// Still running (or cancelling): its results are not all there.
    Running,
    /// Ended: every line it ran has its result, and every other line is
    /// told as expired or cancelled.
    Ended,
    /// Refused whole before any line ran (OpenAI's `failed` at validation):
    /// why.
    Refused(String),
}

/// How one line ended, as the provider tells it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Outcome {
    /// It ran: its answer or its error, judged as a live call's.
    Ran(Result<Answer, CallError>),
    /// The batch's window ran out before it ran: no work, no charge.
    Expired,
    /// The batch was cancelled before it ran: no work, no charge.
    Cancelled,
}

/// One line of a batch's results.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct LineResult {
    /// As the provider gave it: an attempt id, unless the provider errs.
    pub(crate) custom_id: String,
    pub(crate) outcome: Outcome,
}

/// A client of one provider's batch API.
#[derive(Clone, Debug)]
pub(crate) struct BatchClient {
    client: Client,
}

impl BatchClient {
    /// A batch client for `provider`, on the live client's transport.
    pub(crate) fn new(provider: Provider) -> Result<BatchClient, CallError> {
        Ok(BatchClient {
            client: Client::new(provider)?,
        })
    }

    /// The provider.
    pub(crate) fn provider(&self) -> &Provider {
        &self.client.provider
    }

    /// The line of `attempt`: the body a live call of it would send.
    pub(crate) fn line(
        &self,
        attempt: AttemptId,
        operation: &Operation,
        rendered: &Rendered,
    ) -> Line {
        let body = self
            .client
            .wire
            .body(&self.client.provider, operation, rendered, None);
        Line { attempt, body }
    }

    /// Sends `lines` as one batch, named `batch` (onejob's id) where the kind
    /// keeps metadata; the provider's id of the batch.
    pub(crate) async fn submit(&self, batch: &str, lines: &[Line]) -> Result<String, CallError> {
        match self.provider().kind {
            ProviderKind::OpenAi => openai::submit(self, batch, lines).await,
            ProviderKind::Anthropic => anthropic::submit(self, lines).await,
        }
    }

    /// Where batch `id` stands.
    pub(crate) async fn state(&self, id: &str) -> Result<State, CallError> {
        match self.provider().kind {
            ProviderKind::OpenAi => openai::state(self, id).await,
            ProviderKind::Anthropic => anthropic::state(self, id).await,
        }
    }

    /// Every result of ended batch `id`, in the order the provider gives them.
    pub(crate) async fn results(&self, id: &str) -> Result<Vec<LineResult>, CallError> {
        match self.provider().kind {
            ProviderKind::OpenAi => openai::results(self, id).await,
            ProviderKind::Anthropic => anthropic::results(self, id).await,
        }
    }

    /// Asks the provider to cancel batch `id`: the lines it has not run end
    /// cancelled. An ended batch is left as it is.
    pub(crate) async fn cancel(&self, id: &str) -> Result<(), CallError> {
        let path = match self.provider().kind {
            ProviderKind::OpenAi => format!("batches/{id}/cancel"),
            ProviderKind::Anthropic => format!("messages/batches/{id}/cancel"),
        };
        match self.send(self.post(&path)?).await {
            Ok(_) => Ok(()),
            // 409: it has ended already, which is what a cancel wants.
            Err(CallError::Rejected { message, .. }) if message.starts_with("HTTP 409") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The provider's id of the batch onejob named `batch`, when its send
    /// was lost: found by its metadata. None when the provider has no such
    /// batch (the send never made one). A kind that keeps no metadata on a
    /// batch (Anthropic's) cannot be asked: `Refused`, and the caller must
    /// not guess.
    pub(crate) async fn find(&self, batch: &str) -> Result<Option<String>, CallError> {
        match self.provider().kind {
            ProviderKind::OpenAi => openai::find(self, batch).await,
            ProviderKind::Anthropic => Err(CallError::Refused(
                "a Message Batch keeps no metadata: a batch whose creation was lost cannot be found by its name".into(),
            )),
        }
    }

    /// A request to `path` under the provider's `base_url`.
    fn url(&self, path: &str) -> Result<reqwest::Url, CallError> {
        self.client
            .provider
            .base_url
            .join(path)
            .map_err(|e| CallError::Refused(format!("bad url: {e}")))
    }

    fn get(&self, path: &str) -> Result<reqwest::RequestBuilder, CallError> {
        Ok(self.client.http.get(self.url(path)?))
    }

    fn post(&self, path: &str) -> Result<reqwest::RequestBuilder, CallError> {
        Ok(self.client.http.post(self.url(path)?))
    }

    /// Sends `request` with the provider's key, and reads the answer's body
    /// ([`MAX_READ_BYTES`] at most); an answer that is no success is
    /// `Rejected` with its status and an excerpt.
    async fn send(&self, request: reqwest::RequestBuilder) -> Result<Vec<u8>, CallError> {
        let mut response = self
            .client
            .authorized(request)?
            .send()
            .await
            .map_err(classify)?;
        let status = response.status().as_u16();
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(classify)? {
            if bytes.len() + chunk.len() > MAX_READ_BYTES {
                return Err(CallError::Unknown(format!(
                    "a batch read over {MAX_READ_BYTES} bytes was cut short"
                )));
            }
            bytes.extend_from_slice(&chunk);
        }
        if !(200..300).contains(&status) {
            return Err(CallError::Rejected {
                message: format!("HTTP {status}: {}", excerpt(&bytes)),
                retry_after: None,
                usage: None,
            });
        }
        Ok(bytes)
    }

    /// Sends `request` and reads its answer as JSON.
    async fn json(&self, request: reqwest::RequestBuilder) -> Result<Value, CallError> {
        let bytes = self.send(request).await?;
        serde_json::from_slice(&bytes).map_err(|e| CallError::Rejected {
            message: format!("not JSON ({e}): {}", excerpt(&bytes)),
            retry_after: None,
            usage: None,
        })
    }

    /// One line's answer (`body`, with the status the provider gives it),
    /// judged as a live answer is, its size limit included.
    fn judged(&self, status: u16, body: &Value) -> Result<Answer, CallError> {
        let bytes = body.to_string().into_bytes();
        let limit = self.client.provider.max_response_bytes;
        if bytes.len() > limit {
            return Err(CallError::Rejected {
                message: format!(
                    "answer_too_large: a batch line's answer over max_response_bytes ({limit} bytes)"
                ),
                retry_after: None,
                usage: None,
            });
        }
        judge(
            &self.client.provider,
            self.client.wire,
            status,
            None,
            &bytes,
        )
    }
}

/// JSONL's values, a line that is no JSON told as such.
fn jsonl(bytes: &[u8]) -> Vec<Result<Value, String>> {
    String::from_utf8_lossy(bytes)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l).map_err(|e| format!("a result line that is no JSON ({e})"))
        })
        .collect()
}

/// A line that cannot be read: its `custom_id` is not known, so it is
/// returned with none, for the caller to log.
fn unreadable(why: String) -> LineResult {
    LineResult {
        custom_id: String::new(),
        outcome: Outcome::Ran(Err(CallError::Rejected {
            message: why,
            retry_after: None,
            usage: None,
        })),
    }
}
