//! OpenAI's Chat Completions (`POST {base_url}/chat/completions`), as any
//! OpenAI-compatible server speaks it: a bearer key, `messages` with a
//! system and a user message, the answer in `choices[0].message.content`,
//! `usage.prompt_tokens`/`completion_tokens`/`total_tokens`. Its evidence can
//! be `stored` (stored completions, listed by metadata: `super::super::stored`)
//! or `idempotency_key`.

use serde::Deserialize;
use serde_json::{Value, json};

use super::{Read, Wire};
use crate::settings::config::{Operation, Provider, Rendered};

/// The OpenAI wire format.
pub(crate) struct OpenAi;

#[derive(Deserialize)]
struct Completion {
    id: Option<String>,
    #[serde(default)]
    choices: Vec<Choice>,
    usage: Option<Value>,
}

#[derive(Deserialize)]
struct Choice {
    message: Message,
}

#[derive(Deserialize)]
struct Message {
    content: Option<String>,
}

impl Wire for OpenAi {
    fn path(&self) -> &'static str {
        "chat/completions"
    }

    fn body(
        &self,
        provider: &Provider,
        operation: &Operation,
        rendered: &Rendered,
        stored: Option<Value>,
    ) -> Value {
        let mut body = json!({
            "model": provider.model,
            "temperature": operation.temperature,
            "max_tokens": operation.max_tokens,
            "messages": [
                { "role": "system", "content": rendered.system },
                { "role": "user", "content": rendered.user },
            ],
        });
        if let Some(metadata) = stored {
            body["store"] = json!(true);
            body["metadata"] = metadata;
        }
        body
    }

    fn authorize(
        &self,
        request: reqwest::RequestBuilder,
        key: Option<&str>,
    ) -> reqwest::RequestBuilder {
        match key {
            Some(key) => request.bearer_auth(key),
            None => request,
        }
    }

    fn read(&self, body: &[u8]) -> Result<Read, String> {
        let completion: Completion =
            serde_json::from_slice(body).map_err(|e| format!("malformed completion ({e})"))?;
        Ok(Read {
            content: completion
                .choices
                .into_iter()
                .next()
                .and_then(|c| c.message.content),
            id: completion.id,
            usage: completion.usage,
        })
    }

    fn error_usage(&self, body: &[u8]) -> Option<Value> {
        serde_json::from_slice::<Completion>(body).ok()?.usage
    }
}
