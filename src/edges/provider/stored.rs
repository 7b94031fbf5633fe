//! Stored completions (`evidence = "stored"`, OpenAI's kind): the metadata
//! every stored call carries, and the listing an unknown call's answer is
//! looked up in (contract section 7, Evidence).

use serde_json::{Value, json};

use super::answer::{Answer, CallError, judge};
use super::{Client, without_url};
use crate::domain::{AttemptId, JobId};
use crate::settings::config::ProviderKind;

impl Client {
    /// What the provider stored of `attempt`'s call (`evidence = "stored"`):
    /// its completions listed by the attempt's metadata, page after page
    /// (`limit`, `after`, until `has_more` is false), and one taken only if
    /// its metadata names this attempt of this job (of no job: a
    /// qualification's call). `Ok(None)` only when the whole listing was read
    /// and none is stored; `Some` holds the completion judged as a live
    /// answer is; `Err` when the provider could not be asked, or the listing
    /// could not be read to its end (look again later).
    pub(crate) async fn stored(
        &self,
        attempt: AttemptId,
        job: Option<JobId>,
    ) -> Result<Option<Result<Answer, CallError>>, String> {
        if self.provider.kind != ProviderKind::OpenAi {
            return Err(format!(
                "provider {} is of a kind that keeps no stored calls",
                self.provider.name
            ));
        }
        let want = evidence_metadata(attempt, job);
        let mut after: Option<String> = None;
        for _ in 0..MAX_LIST_PAGES {
            let page = self.stored_page(attempt, after.as_deref()).await?;
            let found = page["data"].as_array().into_iter().flatten().find(|c| {
                c["metadata"]["onejob_attempt"] == want["onejob_attempt"]
                    && c["metadata"]["onejob_job"] == want["onejob_job"]
            });
            if let Some(c) = found {
                let body = serde_json::to_vec(c).unwrap_or_default();
                return Ok(Some(judge(&self.provider, self.wire, 200, None, &body)));
            }
            match page["has_more"] {
                Value::Bool(false) => return Ok(None),
                Value::Bool(true) => {}
                _ => {
                    return Err(
                        "the list of stored completions says no has_more: whether it was read to its end is not known"
                            .into(),
                    );
                }
            }
            let next = page["last_id"]
                .as_str()
                .or_else(|| page["data"].as_array()?.last()?["id"].as_str())
                .filter(|id| after.as_deref() != Some(*id))
                .ok_or(
                    "the list of stored completions has more, but names no last_id to go on after",
                )?;
            after = Some(next.to_owned());
        }
        Err(format!(
            "the list of stored completions runs past {MAX_LIST_PAGES} pages; not read to its end"
        ))
    }

    /// One page of `attempt`'s stored completions, after the completion
    /// `after` (the first page without).
    async fn stored_page(&self, attempt: AttemptId, after: Option<&str>) -> Result<Value, String> {
        let mut url = self
            .provider
            .base_url
            .join("chat/completions")
            .map_err(|e| format!("bad url: {e}"))?;
        {
            let mut query = url.query_pairs_mut();
            query
                .append_pair("metadata[onejob_attempt]", &attempt.to_string())
                .append_pair("limit", &LIST_PAGE.to_string());
            if let Some(after) = after {
                query.append_pair("after", after);
            }
        }
        let request = self
            .authorized(self.http.get(url))
            .map_err(|e| e.to_string())?;
        let mut response = request.send().await.map_err(|e| without_url(&e))?;
        let status = response.status();
        if !status.is_success() {
            return Err(format!(
                "listing stored completions answered HTTP {}",
                status.as_u16()
            ));
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| without_url(&e))? {
            if bytes.len() + chunk.len() > self.provider.max_response_bytes {
                return Err("the list of stored completions is over max_response_bytes".into());
            }
            bytes.extend_from_slice(&chunk);
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| format!("the list of stored completions is not JSON: {e}"))
    }
}

/// Stored completions asked for in one page of a listing (OpenAI's most).
const LIST_PAGE: usize = 100;
/// Pages of one listing read at most: past them the listing is not read to
/// its end, and nothing is concluded from it.
const MAX_LIST_PAGES: usize = 20;

/// The metadata a stored call carries (contract section 7, Evidence): the
/// attempt, and its job when it has one (a qualification run's calls have
/// none).
pub(crate) fn evidence_metadata(attempt: AttemptId, job: Option<JobId>) -> Value {
    let mut metadata = json!({ "onejob_attempt": attempt.to_string() });
    if let Some(job) = job {
        metadata["onejob_job"] = json!(job.to_string());
    }
    metadata
}
