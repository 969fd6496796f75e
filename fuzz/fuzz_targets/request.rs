//! The body of `POST /v1/completions`, as any bytes, through what the handler runs on it
//! before it needs the fleet: `CompletionRequest::parse`, then `check_logprobs_cap` and
//! `upstream_body`.
//!
//! Checked: nothing panics; a refusal is a 400 `invalid_request` with a short message
//! (values are shown as excerpts, the body is never echoed); an accepted request keeps
//! the contract's bounds, and the body sent upstream is a JSON object that parses again
//! to the same request.

#![no_main]

use fleetgate::completion::request::{CompletionRequest, Prompt};
use fleetgate::contract::{LOGPROBS_LIMIT, MAX_OUTPUT_WORK, MAX_TOKENS_LIMIT};
use fleetgate::error::ApiError;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

/// The checkpoint name `upstream_body` writes as `model`; quotes and a backslash, so its
/// escaping is exercised too.
const SERVED: &str = r#"org/"served"\model"#;

/// Generous: the longest fixed message is about 300 bytes, plus excerpts of at most
/// 64 characters.
const MAX_MESSAGE_BYTES: usize = 1024;

fuzz_target!(|body: &[u8]| {
    match CompletionRequest::parse(body) {
        Ok(request) => accepted(&request),
        Err(err) => refused(&err),
    }
});

fn refused(err: &ApiError) {
    assert_eq!(err.status().as_u16(), 400, "{err:?}");
    let rendered = err.body();
    assert_eq!(rendered.code, "invalid_request");
    assert_eq!(rendered.kind, "invalid_request_error");
    assert!(
        !rendered.message.is_empty() && rendered.message.len() <= MAX_MESSAGE_BYTES,
        "message of {} bytes: {:?}",
        rendered.message.len(),
        rendered.message
    );
    if let Some(param) = &rendered.param {
        assert!(param.chars().count() <= 64, "param {param:?}");
    }
}

fn accepted(request: &CompletionRequest<'_>) {
    let _ = format!("{request:?}");
    if let Some(model) = request.model() {
        assert!(!model.is_empty());
    }

    // The bounds `parse` promises.
    let prompts = request.prompt_count();
    assert!(prompts >= 1);
    assert_eq!(request.prompt().token_upper_bounds().len() as u64, prompts);
    assert!((1..=16).contains(&request.n()));
    match request.max_tokens() {
        Some(max_tokens) => {
            assert!((1..=MAX_TOKENS_LIMIT).contains(&max_tokens));
            assert!(prompts * request.n() * max_tokens <= MAX_OUTPUT_WORK);
        }
        None => assert!(prompts == 1 && request.n() == 1),
    }
    if let Some(logprobs) = request.logprobs() {
        assert!(logprobs <= LOGPROBS_LIMIT);
        assert!(request.check_logprobs_cap(logprobs).is_ok());
        if let Some(below) = logprobs.checked_sub(1) {
            let err = request.check_logprobs_cap(below).err();
            assert!(err.is_some_and(|err| err.status().as_u16() == 400));
        }
    }
    if let Some(k) = request.prompt_logprobs() {
        assert!(k == -1 || (0..=100).contains(&k));
        assert!(!request.stream() || k == 0);
    }
    assert!(request.stream() || !request.include_usage());

    // As sent upstream, with and without an injected max_tokens.
    let (_, injected) = upstream_object(request, Some(MAX_TOKENS_LIMIT));
    assert_eq!(injected["max_tokens"], MAX_TOKENS_LIMIT);
    let (text, _) = upstream_object(request, None);
    let again = match CompletionRequest::parse(&text) {
        Ok(again) => again,
        Err(err) => panic!(
            "the upstream body is refused ({err:?}): {}",
            String::from_utf8_lossy(&text)
        ),
    };
    assert_same(request, &again);
}

/// `upstream_body`, as sent and as a JSON object, with the rewrites it promises checked.
fn upstream_object(
    request: &CompletionRequest<'_>,
    max_tokens: Option<u64>,
) -> (Vec<u8>, serde_json::Map<String, Value>) {
    let text = request.upstream_body(SERVED, max_tokens);
    let Ok(Value::Object(object)) = serde_json::from_slice::<Value>(&text) else {
        panic!(
            "the upstream body is not a JSON object: {}",
            String::from_utf8_lossy(&text)
        );
    };
    assert_eq!(object["model"], SERVED);
    assert!(
        object.values().all(|value| !value.is_null()),
        "a null is sent"
    );
    if request.stream() {
        assert_eq!(object["stream_options"]["include_usage"], true);
    }
    (text, object)
}

/// The request parsed back from its upstream body: the same, but for what
/// `upstream_body` rewrites (the model, `""` as `[""]`, streams asking for usage).
fn assert_same(sent: &CompletionRequest<'_>, again: &CompletionRequest<'_>) {
    let prompt = match sent.prompt() {
        Prompt::Text(text) if text.is_empty() => Prompt::TextBatch(vec![String::new()]),
        prompt => prompt.clone(),
    };
    assert_eq!(again.prompt(), &prompt);
    assert_eq!(again.model(), Some(SERVED));
    assert_eq!(again.max_tokens(), sent.max_tokens());
    assert_eq!(again.n(), sent.n());
    assert_eq!(again.stream(), sent.stream());
    assert_eq!(again.include_usage(), sent.stream());
    assert_eq!(again.logprobs(), sent.logprobs());
    assert_eq!(again.prompt_logprobs(), sent.prompt_logprobs());
    assert_eq!(again.add_special_tokens(), sent.add_special_tokens());
    assert_eq!(again.echo(), sent.echo());
}
