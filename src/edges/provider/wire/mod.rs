//! The wire formats: what each kind of provider's API is asked and answers.
//!
//! A kind builds its request and reads its answer; it never sends, times,
//! limits, redirects or classifies anything. Those are the transport's
//! ([`super::Client`]), the same for every kind, so a guarantee kept for one
//! kind is kept for all: the dispatch phase (refused before sending:
//! `failed`; lost after: `unknown`), `unknown_statuses`, `Retry-After`,
//! `max_response_bytes`, no redirect followed, trace headers, and provider
//! text made storable and escaped. A new kind is a file here and a variant
//! of [`ProviderKind`]; it is done when the conformance suite
//! (`super::conformance`) passes for it.

pub(crate) mod anthropic;
pub(crate) mod openai;

use serde_json::Value;

use crate::settings::config::{Operation, Provider, ProviderKind, Rendered};

/// One kind's wire format.
pub(crate) trait Wire: Send + Sync {
    /// The path of a call, under the provider's `base_url`.
    fn path(&self) -> &'static str;

    /// A call's request body. `stored` is the metadata a call of a provider
    /// whose evidence is `stored` carries (only a kind that can list stored
    /// calls is ever given it).
    fn body(
        &self,
        provider: &Provider,
        operation: &Operation,
        rendered: &Rendered,
        stored: Option<Value>,
    ) -> Value;

    /// The request with the provider's API key, as this kind sends it, and
    /// any header every call of this kind carries.
    fn authorize(
        &self,
        request: reqwest::RequestBuilder,
        key: Option<&str>,
    ) -> reqwest::RequestBuilder;

    /// A successful answer's body read, or why it is not one of this kind's
    /// answers.
    fn read(&self, body: &[u8]) -> Result<Read, String>;

    /// What an error answer's body says was spent, if it says.
    fn error_usage(&self, body: &[u8]) -> Option<Value>;
}

/// What a successful answer holds, as the provider sent it (the transport
/// makes it storable).
#[derive(Debug, Default)]
pub(crate) struct Read {
    /// The answer's text; `None` when it has none.
    pub(crate) content: Option<String>,
    /// The provider's id of the answer.
    pub(crate) id: Option<String>,
    /// What the provider reports it spent.
    pub(crate) usage: Option<Value>,
}

/// The wire format of `kind`.
pub(crate) fn of(kind: ProviderKind) -> &'static dyn Wire {
    match kind {
        ProviderKind::OpenAi => &openai::OpenAi,
        ProviderKind::Anthropic => &anthropic::Anthropic,
    }
}
