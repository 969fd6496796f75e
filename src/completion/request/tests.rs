//! One row per rule of the request contract (the strict validation of every field and
//! its bounds, as `docs/api.md` and the OpenAPI document state them), accepted and
//! rejected side; then the upstream body.

use super::*;

/// What a body should give: accepted, or a 400 `invalid_request` with this `param`
/// (`None` = no param) and a message containing this text.
#[derive(Debug, Clone, Copy)]
enum Expect {
    Ok,
    Err(Option<&'static str>, &'static str),
}

const fn ok() -> Expect {
    Expect::Ok
}

const fn rej(param: &'static str, message: &'static str) -> Expect {
    Expect::Err(Some(param), message)
}

const fn rej_no_param(message: &'static str) -> Expect {
    Expect::Err(None, message)
}

fn run(cases: &[(&str, Expect)]) {
    let mut failures = Vec::new();
    for (body, expect) in cases {
        let got = CompletionRequest::parse(body.as_bytes());
        let failure = match (expect, &got) {
            (Expect::Ok, Ok(_)) => None,
            (Expect::Ok, Err(err)) => Some(format!("expected Ok, got {err:?}")),
            (Expect::Err(..), Ok(req)) => Some(format!("expected an error, got Ok({req:?})")),
            (Expect::Err(want_param, want_msg), Err(err)) => match err {
                ApiError::InvalidRequest { message, param } => {
                    if param.as_deref() != *want_param {
                        Some(format!("param {param:?} != {want_param:?} ({message})"))
                    } else if !message.contains(want_msg) {
                        Some(format!("message {message:?} lacks {want_msg:?}"))
                    } else {
                        None
                    }
                }
                other => Some(format!("not an invalid_request: {other:?}")),
            },
        };
        if let Some(failure) = failure {
            failures.push(format!("{body}\n    {failure}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} rows failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

fn parse(body: &str) -> CompletionRequest<'_> {
    match CompletionRequest::parse(body.as_bytes()) {
        Ok(req) => req,
        Err(err) => panic!("{body} was rejected: {err}"),
    }
}

fn error(body: &str) -> (Option<String>, String) {
    match CompletionRequest::parse(body.as_bytes()) {
        Ok(req) => panic!("{body} was accepted: {req:?}"),
        Err(ApiError::InvalidRequest { message, param }) => (param.map(String::from), message),
        Err(other) => panic!("{body}: not an invalid_request: {other:?}"),
    }
}

#[test]
fn body_shape() {
    run(&[
        (r#"{"prompt":"hi"}"#, ok()),
        (" \n\t{\"prompt\":\"hi\"} \n", ok()),
        ("[]", rej_no_param("request body must be a JSON object")),
        (
            r#""hi""#,
            rej_no_param("request body must be a JSON object"),
        ),
        ("5", rej_no_param("request body must be a JSON object")),
        ("null", rej_no_param("request body must be a JSON object")),
        ("", rej_no_param("request body is not valid JSON")),
        ("   ", rej_no_param("request body is not valid JSON")),
        (
            r#"{"prompt":"hi",}"#,
            rej_no_param("request body is not valid JSON: trailing comma at line 1 column 16"),
        ),
        (
            r#"{"prompt":"hi"} x"#,
            rej_no_param("request body is not valid JSON"),
        ),
        (
            r#"{"prompt":"hi"}{}"#,
            rej_no_param("request body is not valid JSON"),
        ),
        (r#"{"prompt": 'hi'}"#, rej_no_param("line 1 column")),
        (
            "{\"prompt\":\n\"hi\"\n\"n\":1}",
            rej_no_param("line 3 column"),
        ),
        (
            r#"["prompt" "#,
            rej_no_param("request body is not valid JSON"),
        ),
        (
            r#"{"prompt":"hi","n":01}"#,
            rej_no_param("request body is not valid JSON"),
        ),
        (
            r#"{"prompt":"hi","n":NaN}"#,
            rej_no_param("request body is not valid JSON"),
        ),
    ]);
}

#[test]
fn malformed_json_is_not_echoed() {
    for body in [
        r#"{"prompt": "top secret text"#,
        r#"{"prompt": "top secret text", "n": tru}"#,
        r#""top secret text"#,
        "\"top secret text\" trailing",
    ] {
        let (_, message) = error(body);
        assert!(!message.contains("secret"), "{body} echoed: {message}");
    }
    let invalid_utf8 = b"{\"prompt\":\"\xff\xfe\"}";
    assert!(CompletionRequest::parse(invalid_utf8).is_err());
}

#[test]
fn keys_unknown_and_duplicate() {
    run(&[
        // Keys are compared decoded: an escaped name is the same field.
        (r#"{"\u0070rompt":"hi"}"#, ok()),
        (
            r#"{"extra_body":{"top_k":5},"prompt":"hi"}"#,
            rej("extra_body", "Unknown field 'extra_body'"),
        ),
        (
            r#"{"prompt":"hi","suffix":"x"}"#,
            rej("suffix", "Unknown field 'suffix'"),
        ),
        // Unknown even when null: the name itself is not accepted.
        (
            r#"{"prompt":"hi","suffix":null}"#,
            rej("suffix", "Unknown field 'suffix'"),
        ),
        (
            r#"{"prompt":"hi","best_of":1}"#,
            rej("best_of", "Unknown field 'best_of'"),
        ),
        (
            r#"{"prompt":"hi","logit_bias":{"1":2}}"#,
            rej("logit_bias", "Unknown field 'logit_bias'"),
        ),
        (
            r#"{"prompt":"hi","max_completion_tokens":5}"#,
            rej(
                "max_completion_tokens",
                "Unknown field 'max_completion_tokens'",
            ),
        ),
        (
            r#"{"prompt":"hi","ignore_eos":true}"#,
            rej("ignore_eos", "Unknown field"),
        ),
        // A name outside the known list cannot be a `&'static` param: message only.
        (
            r#"{"prompt":"hi","foo":1}"#,
            rej("foo", "Unknown field 'foo'"),
        ),
        (
            r#"{"Prompt":"hi"}"#,
            rej("Prompt", "Unknown field 'Prompt'"),
        ),
        (r#"{"prompt":"hi","":1}"#, rej("", "Unknown field ''")),
        (
            r#"{"prompt":"hi","a\"b":1}"#,
            rej("a\"b", r#"Unknown field 'a\"b'"#),
        ),
        (
            r#"{"prompt":"a","prompt":"b"}"#,
            rej("prompt", "duplicate field 'prompt'"),
        ),
        (
            r#"{"prompt":"a","n":1,"\u006e":2}"#,
            rej("n", "duplicate field 'n'"),
        ),
        (
            r#"{"prompt":"a","max_tokens":null,"max_tokens":5}"#,
            rej("max_tokens", "duplicate field 'max_tokens'"),
        ),
    ]);
}

#[test]
fn unknown_field_names_are_cut_short() {
    let long = "k".repeat(500);
    let body = format!(r#"{{"prompt":"hi","{long}":1}}"#);
    let (param, message) = error(&body);
    assert!(param.is_some_and(|p| p.len() < 80 && p.starts_with("kkk")));
    assert!(message.len() < 120, "{message}");
}

#[test]
fn nulls_mean_not_given() {
    run(&[
        (
            r#"{"prompt":"hi","model":null,"max_tokens":null,"n":null,"stop":null,
               "temperature":null,"top_p":null,"top_k":null,"min_p":null,
               "presence_penalty":null,"frequency_penalty":null,"repetition_penalty":null,
               "seed":null,"logprobs":null,"prompt_logprobs":null,"echo":null,"stream":null,
               "stream_options":null,"user":null,"add_special_tokens":null}"#,
            ok(),
        ),
        (r#"{"prompt":null}"#, rej("prompt", "prompt is required")),
        (r#"{}"#, rej("prompt", "prompt is required")),
        (
            r#"{"model":"llama-8b","max_tokens":5}"#,
            rej("prompt", "prompt is required"),
        ),
    ]);
    let req = parse(
        r#"{"prompt":"hi","model":null,"max_tokens":null,"n":null,"stream":null,
            "echo":null,"add_special_tokens":null,"logprobs":null,"prompt_logprobs":null}"#,
    );
    assert_eq!(req.model(), None);
    assert_eq!(req.max_tokens(), None);
    assert_eq!(req.n(), 1);
    assert!(!req.stream());
    assert!(!req.echo());
    assert!(req.add_special_tokens());
    assert_eq!(req.logprobs(), None);
    assert_eq!(req.prompt_logprobs(), None);
}

#[test]
fn model_and_user() {
    run(&[
        (r#"{"prompt":"hi","model":"llama-8b"}"#, ok()),
        (
            r#"{"prompt":"hi","model":""}"#,
            rej("model", "model must not be an empty string"),
        ),
        (
            r#"{"prompt":"hi","model":5}"#,
            rej("model", "model must be a string (got 5)"),
        ),
        (
            r#"{"prompt":"hi","model":true}"#,
            rej("model", "model must be a string (got true)"),
        ),
        (
            r#"{"prompt":"hi","model":["llama-8b"]}"#,
            rej("model", "model must be a string (got an array)"),
        ),
        (r#"{"prompt":"hi","user":"team-a"}"#, ok()),
        (r#"{"prompt":"hi","user":""}"#, ok()),
        (
            r#"{"prompt":"hi","user":5}"#,
            rej("user", "user must be a string (got 5)"),
        ),
        (
            r#"{"prompt":"hi","user":{"id":1}}"#,
            rej("user", "user must be a string (got an object)"),
        ),
        (
            r#"{"prompt":"hi","user":"\ud800"}"#,
            rej("user", "user must be valid Unicode text"),
        ),
    ]);
}

#[test]
fn prompt_forms() {
    run(&[
        // The four forms.
        (r#"{"prompt":"The capital of France is"}"#, ok()),
        (r#"{"prompt":["a","b"],"max_tokens":8}"#, ok()),
        (r#"{"prompt":[1,2,3]}"#, ok()),
        (r#"{"prompt":[[1,2],[3]],"max_tokens":8}"#, ok()),
        // Empty strings are accepted.
        (r#"{"prompt":""}"#, ok()),
        (r#"{"prompt":[""]}"#, ok()),
        (r#"{"prompt":["a",""],"max_tokens":8}"#, ok()),
        // Token ids: 0 ..= u32::MAX.
        (r#"{"prompt":[0,4294967295]}"#, ok()),
        (
            r#"{"prompt":[4294967296]}"#,
            rej(
                "prompt",
                "prompt[0] must be a token id, an integer between 0 and 4294967295 (got 4294967296)",
            ),
        ),
        (
            r#"{"prompt":[5,-1]}"#,
            rej(
                "prompt",
                "prompt[1] must be a token id, an integer between 0 and 4294967295 (got -1)",
            ),
        ),
        (
            r#"{"prompt":[1.0]}"#,
            rej("prompt", "prompt[0] must be a token id"),
        ),
        (
            r#"{"prompt":[1e2]}"#,
            rej("prompt", "prompt[0] must be a token id"),
        ),
        (
            r#"{"prompt":[99999999999999999999999]}"#,
            rej("prompt", "prompt[0] must be a token id"),
        ),
        (
            r#"{"prompt":[[1],[2,-3]],"max_tokens":8}"#,
            rej(
                "prompt",
                "prompt[1][1] must be a token id, an integer between 0 and 4294967295 (got -3)",
            ),
        ),
        // Empty lists.
        (
            r#"{"prompt":[]}"#,
            rej("prompt", "prompt must not be an empty list"),
        ),
        (
            r#"{"prompt":[[]]}"#,
            rej("prompt", "prompt[0] must not be an empty list of token ids"),
        ),
        (
            r#"{"prompt":[[1],[]],"max_tokens":8}"#,
            rej("prompt", "prompt[1] must not be an empty list of token ids"),
        ),
        // Mixed lists say which form was expected.
        (
            r#"{"prompt":[1,"two"]}"#,
            rej(
                "prompt",
                r#"prompt is an array of token ids, so prompt[1] must be a token id (an integer) too (got "two")"#,
            ),
        ),
        (
            r#"{"prompt":["a",[1]],"max_tokens":8}"#,
            rej(
                "prompt",
                "prompt is an array of strings (a batch of text prompts), so prompt[1] must be a string too (got an array)",
            ),
        ),
        (
            r#"{"prompt":["a",1],"max_tokens":8}"#,
            rej("prompt", "prompt[1] must be a string too (got 1)"),
        ),
        (
            r#"{"prompt":[1,[2]]}"#,
            rej(
                "prompt",
                "so prompt[1] must be a token id (an integer) too (got an array)",
            ),
        ),
        (
            r#"{"prompt":[[1],2],"max_tokens":8}"#,
            rej(
                "prompt",
                "so prompt[1] must be an array of token ids too (got 2)",
            ),
        ),
        (
            r#"{"prompt":[[1],["a"]],"max_tokens":8}"#,
            rej(
                "prompt",
                r#"prompt[1] is an array of token ids, so prompt[1][0] must be a token id (an integer) too (got "a")"#,
            ),
        ),
        (
            r#"{"prompt":[[[1]]]}"#,
            rej(
                "prompt",
                "prompt[0] is an array of token ids, so prompt[0][0] must be a token id",
            ),
        ),
        (
            r#"{"prompt":[null]}"#,
            rej(
                "prompt",
                "prompt must be a string, an array of strings, an array of token ids (integers) or an array of arrays of token ids (prompt[0] is null)",
            ),
        ),
        (r#"{"prompt":[true]}"#, rej("prompt", "(prompt[0] is true)")),
        (
            r#"{"prompt":[{"text":"a"}]}"#,
            rej("prompt", "(prompt[0] is an object)"),
        ),
        // Wrong type altogether; the value is described, never echoed.
        (
            r#"{"prompt":5}"#,
            rej(
                "prompt",
                "prompt must be a string, an array of strings, an array of token ids (integers) or an array of arrays of token ids (got 5)",
            ),
        ),
        (r#"{"prompt":true}"#, rej("prompt", "(got true)")),
        (
            r#"{"prompt":{"text":"secret"}}"#,
            rej("prompt", "(got an object)"),
        ),
    ]);
}

#[test]
fn prompt_values_and_counts() {
    let req = parse(r#"{"prompt":"caf\u00e9"}"#);
    assert_eq!(req.prompt(), &Prompt::Text("café".to_owned()));
    assert_eq!(req.prompt_count(), 1);

    let req = parse(r#"{"prompt":[1,2,3]}"#);
    assert_eq!(req.prompt(), &Prompt::Tokens(vec![1, 2, 3]));
    assert_eq!(req.prompt_count(), 1);

    let req = parse(r#"{"prompt":["a","",  "c"],"max_tokens":1}"#);
    let texts = vec!["a".to_owned(), String::new(), "c".to_owned()];
    assert_eq!(req.prompt(), &Prompt::TextBatch(texts));
    assert_eq!(req.prompt_count(), 3);

    let req = parse(r#"{"prompt":[[1],[2,4294967295]],"max_tokens":1}"#);
    assert_eq!(
        req.prompt(),
        &Prompt::TokenBatch(vec![vec![1], vec![2, u32::MAX]])
    );
    assert_eq!(req.prompt_count(), 2);

    // A batch of one is still a batch form, but one prompt: max_tokens may be omitted.
    assert_eq!(parse(r#"{"prompt":["only"]}"#).prompt_count(), 1);
    assert_eq!(parse(r#"{"prompt":[[7]]}"#).prompt_count(), 1);
}

#[test]
fn token_upper_bounds() {
    let bounds = |body: &str| parse(body).prompt().token_upper_bounds();
    assert_eq!(bounds(r#"{"prompt":""}"#), vec![1]);
    assert_eq!(bounds(r#"{"prompt":"héllo"}"#), vec![7]);
    assert_eq!(bounds(r#"{"prompt":"\ud83d\ude00"}"#), vec![5]);
    assert_eq!(
        bounds(r#"{"prompt":["a","bc",""],"max_tokens":1}"#),
        vec![2, 3, 1]
    );
    assert_eq!(bounds(r#"{"prompt":[1,2,3]}"#), vec![3]);
    assert_eq!(
        bounds(r#"{"prompt":[[1],[2,3]],"max_tokens":1}"#),
        vec![1, 2]
    );
}

#[test]
fn max_tokens() {
    run(&[
        (r#"{"prompt":"hi","max_tokens":1}"#, ok()),
        (r#"{"prompt":"hi","max_tokens":16}"#, ok()),
        (r#"{"prompt":"hi","max_tokens":null}"#, ok()),
        (
            r#"{"prompt":"hi","max_tokens":0}"#,
            rej("max_tokens", "max_tokens=0 is not supported"),
        ),
        (
            r#"{"prompt":"hi","max_tokens":0}"#,
            rej(
                "max_tokens",
                "prompt_logprobs with max_tokens=1 and echo=true",
            ),
        ),
        (
            r#"{"prompt":"hi","max_tokens":-1}"#,
            rej(
                "max_tokens",
                "max_tokens must be between 1 and 1000000 (got -1)",
            ),
        ),
        // The schema bound is checked before the output-work cap.
        (
            r#"{"prompt":"hi","max_tokens":1000001}"#,
            rej(
                "max_tokens",
                "max_tokens must be between 1 and 1000000 (got 1000001)",
            ),
        ),
        (
            r#"{"prompt":"hi","max_tokens":1000000}"#,
            rej(
                "max_tokens",
                "1 × 1 × 1000000 = 1000000 exceeds the limit of 32000",
            ),
        ),
        // Too large for any integer type: a bound error, not "must be an integer".
        (
            r#"{"prompt":"hi","max_tokens":99999999999999999999999}"#,
            rej(
                "max_tokens",
                "max_tokens must be between 1 and 1000000 (got 99999999999999999999999)",
            ),
        ),
        (
            r#"{"prompt":"hi","max_tokens":"16"}"#,
            rej("max_tokens", r#"max_tokens must be an integer (got "16")"#),
        ),
        (
            r#"{"prompt":"hi","max_tokens":16.0}"#,
            rej("max_tokens", "max_tokens must be an integer (got 16.0)"),
        ),
        (
            r#"{"prompt":"hi","max_tokens":1e3}"#,
            rej("max_tokens", "max_tokens must be an integer (got 1e3)"),
        ),
        (
            r#"{"prompt":"hi","max_tokens":1.5}"#,
            rej("max_tokens", "must be an integer"),
        ),
        (
            r#"{"prompt":"hi","max_tokens":true}"#,
            rej("max_tokens", "max_tokens must be an integer (got true)"),
        ),
        (
            r#"{"prompt":"hi","max_tokens":[16]}"#,
            rej("max_tokens", "max_tokens must be an integer (got an array)"),
        ),
    ]);
}

#[test]
fn n() {
    run(&[
        (r#"{"prompt":"hi","n":1}"#, ok()),
        (r#"{"prompt":"hi","n":16,"max_tokens":1}"#, ok()),
        (
            r#"{"prompt":"hi","n":17,"max_tokens":1}"#,
            rej("n", "n must be between 1 and 16 (got 17)"),
        ),
        (
            r#"{"prompt":"hi","n":0}"#,
            rej("n", "n must be between 1 and 16 (got 0)"),
        ),
        (
            r#"{"prompt":"hi","n":-1}"#,
            rej("n", "n must be between 1 and 16 (got -1)"),
        ),
        (
            r#"{"prompt":"hi","n":1.5}"#,
            rej("n", "n must be an integer (got 1.5)"),
        ),
        (
            r#"{"prompt":"hi","n":2.0}"#,
            rej("n", "n must be an integer (got 2.0)"),
        ),
        (
            r#"{"prompt":"hi","n":1E0}"#,
            rej("n", "n must be an integer (got 1E0)"),
        ),
        (
            r#"{"prompt":"hi","n":"2"}"#,
            rej("n", r#"n must be an integer (got "2")"#),
        ),
        (
            r#"{"prompt":"hi","n":true}"#,
            rej("n", "n must be an integer (got true)"),
        ),
    ]);
}

#[test]
fn seed() {
    run(&[
        (r#"{"prompt":"hi","seed":0}"#, ok()),
        (r#"{"prompt":"hi","seed":42}"#, ok()),
        (r#"{"prompt":"hi","seed":9223372036854775807}"#, ok()),
        (
            r#"{"prompt":"hi","seed":9223372036854775808}"#,
            rej(
                "seed",
                "seed must be between 0 and 9223372036854775807 (got 9223372036854775808)",
            ),
        ),
        (
            r#"{"prompt":"hi","seed":18446744073709551616}"#,
            rej("seed", "seed must be between 0 and 9223372036854775807"),
        ),
        (
            r#"{"prompt":"hi","seed":-1}"#,
            rej(
                "seed",
                "seed must be between 0 and 9223372036854775807 (got -1)",
            ),
        ),
        (
            r#"{"prompt":"hi","seed":-9223372036854775809}"#,
            rej(
                "seed",
                "seed must be between 0 and 9223372036854775807 (got -9223372036854775809)",
            ),
        ),
        (
            r#"{"prompt":"hi","seed":1e3}"#,
            rej("seed", "seed must be an integer (got 1e3)"),
        ),
        (
            r#"{"prompt":"hi","seed":1.0}"#,
            rej("seed", "seed must be an integer"),
        ),
        (
            r#"{"prompt":"hi","seed":"1"}"#,
            rej("seed", "seed must be an integer"),
        ),
        (
            r#"{"prompt":"hi","seed":false}"#,
            rej("seed", "seed must be an integer (got false)"),
        ),
    ]);
}

#[test]
fn top_k() {
    run(&[
        (r#"{"prompt":"hi","top_k":-1}"#, ok()),
        (r#"{"prompt":"hi","top_k":1}"#, ok()),
        (r#"{"prompt":"hi","top_k":50}"#, ok()),
        (r#"{"prompt":"hi","top_k":9223372036854775807}"#, ok()),
        (
            r#"{"prompt":"hi","top_k":0}"#,
            rej(
                "top_k",
                "top_k must be -1 (disabled) or between 1 and 9223372036854775807 (got 0)",
            ),
        ),
        (
            r#"{"prompt":"hi","top_k":-2}"#,
            rej("top_k", "top_k must be -1 (disabled) or between 1 and"),
        ),
        (
            r#"{"prompt":"hi","top_k":9223372036854775808}"#,
            rej("top_k", "(got 9223372036854775808)"),
        ),
        (
            r#"{"prompt":"hi","top_k":5.0}"#,
            rej("top_k", "top_k must be an integer (got 5.0)"),
        ),
        (
            r#"{"prompt":"hi","top_k":"5"}"#,
            rej("top_k", "top_k must be an integer"),
        ),
        (
            r#"{"prompt":"hi","top_k":true}"#,
            rej("top_k", "top_k must be an integer (got true)"),
        ),
    ]);
}

#[test]
fn logprobs() {
    run(&[
        (r#"{"prompt":"hi","logprobs":0}"#, ok()),
        (r#"{"prompt":"hi","logprobs":5}"#, ok()),
        (r#"{"prompt":"hi","logprobs":100}"#, ok()),
        (
            r#"{"prompt":"hi","logprobs":101}"#,
            rej("logprobs", "logprobs must be between 0 and 100 (got 101)"),
        ),
        (
            r#"{"prompt":"hi","logprobs":-1}"#,
            rej("logprobs", "logprobs must be between 0 and 100 (got -1)"),
        ),
        (
            r#"{"prompt":"hi","logprobs":true}"#,
            rej("logprobs", "logprobs must be an integer (got true)"),
        ),
        (
            r#"{"prompt":"hi","logprobs":"5"}"#,
            rej("logprobs", r#"logprobs must be an integer (got "5")"#),
        ),
        (
            r#"{"prompt":"hi","logprobs":5.0}"#,
            rej("logprobs", "logprobs must be an integer (got 5.0)"),
        ),
    ]);
}

#[test]
fn logprobs_model_cap() {
    let cap = |body: &str, max: u32| parse(body).check_logprobs_cap(max);
    assert!(cap(r#"{"prompt":"hi"}"#, 0).is_ok());
    assert!(cap(r#"{"prompt":"hi","logprobs":null}"#, 0).is_ok());
    assert!(cap(r#"{"prompt":"hi","logprobs":0}"#, 0).is_ok());
    assert!(cap(r#"{"prompt":"hi","logprobs":20}"#, 20).is_ok());
    match cap(r#"{"prompt":"hi","logprobs":21}"#, 20) {
        Err(ApiError::InvalidRequest { message, param }) => {
            assert_eq!(param.as_deref(), Some("logprobs"));
            assert!(message.contains("logprobs must be at most 20"), "{message}");
            assert!(message.contains("(got 21)"), "{message}");
        }
        other => panic!("expected invalid_request, got {other:?}"),
    }
}

#[test]
fn prompt_logprobs() {
    run(&[
        (r#"{"prompt":"hi","prompt_logprobs":-1}"#, ok()),
        (r#"{"prompt":"hi","prompt_logprobs":0}"#, ok()),
        (r#"{"prompt":"hi","prompt_logprobs":100}"#, ok()),
        (
            r#"{"prompt":"hi","prompt_logprobs":-2}"#,
            rej(
                "prompt_logprobs",
                "prompt_logprobs must be -1 (full vocabulary) or between 0 and 100 (got -2)",
            ),
        ),
        (
            r#"{"prompt":"hi","prompt_logprobs":101}"#,
            rej("prompt_logprobs", "(got 101)"),
        ),
        (
            r#"{"prompt":"hi","prompt_logprobs":true}"#,
            rej(
                "prompt_logprobs",
                "prompt_logprobs must be an integer (got true)",
            ),
        ),
        (
            r#"{"prompt":"hi","prompt_logprobs":"1"}"#,
            rej("prompt_logprobs", "must be an integer"),
        ),
        (
            r#"{"prompt":"hi","prompt_logprobs":1.0}"#,
            rej("prompt_logprobs", "must be an integer"),
        ),
        // Not with stream, except 0.
        (r#"{"prompt":"hi","stream":true,"prompt_logprobs":0}"#, ok()),
        (
            r#"{"prompt":"hi","stream":false,"prompt_logprobs":5}"#,
            ok(),
        ),
        (
            r#"{"prompt":"hi","stream":true,"prompt_logprobs":5}"#,
            rej(
                "prompt_logprobs",
                "prompt_logprobs must be 0 or omitted with stream: true (got 5)",
            ),
        ),
        (
            r#"{"prompt":"hi","prompt_logprobs":-1,"stream":true}"#,
            rej("prompt_logprobs", "with stream: true (got -1)"),
        ),
    ]);
}

#[test]
fn float_fields() {
    run(&[
        // temperature 0..=100; a JSON integer is accepted.
        (r#"{"prompt":"hi","temperature":0}"#, ok()),
        (r#"{"prompt":"hi","temperature":0.0}"#, ok()),
        (r#"{"prompt":"hi","temperature":1}"#, ok()),
        (r#"{"prompt":"hi","temperature":0.7}"#, ok()),
        (r#"{"prompt":"hi","temperature":100}"#, ok()),
        (r#"{"prompt":"hi","temperature":1e2}"#, ok()),
        (
            r#"{"prompt":"hi","temperature":100.0001}"#,
            rej(
                "temperature",
                "temperature must be between 0 and 100 (got 100.0001)",
            ),
        ),
        (
            r#"{"prompt":"hi","temperature":200}"#,
            rej(
                "temperature",
                "temperature must be between 0 and 100 (got 200)",
            ),
        ),
        (
            r#"{"prompt":"hi","temperature":-0.1}"#,
            rej("temperature", "(got -0.1)"),
        ),
        (
            r#"{"prompt":"hi","temperature":1e400}"#,
            rej("temperature", "(got 1e400)"),
        ),
        (
            r#"{"prompt":"hi","temperature":"1"}"#,
            rej("temperature", r#"temperature must be a number (got "1")"#),
        ),
        (
            r#"{"prompt":"hi","temperature":true}"#,
            rej("temperature", "temperature must be a number (got true)"),
        ),
        // top_p in (0, 1].
        (r#"{"prompt":"hi","top_p":1}"#, ok()),
        (r#"{"prompt":"hi","top_p":1.0}"#, ok()),
        (r#"{"prompt":"hi","top_p":1e-1}"#, ok()),
        (r#"{"prompt":"hi","top_p":0.0001}"#, ok()),
        (
            r#"{"prompt":"hi","top_p":0}"#,
            rej(
                "top_p",
                "top_p must be greater than 0 and at most 1 (got 0)",
            ),
        ),
        (r#"{"prompt":"hi","top_p":0.0}"#, rej("top_p", "(got 0.0)")),
        (
            r#"{"prompt":"hi","top_p":1.01}"#,
            rej(
                "top_p",
                "top_p must be greater than 0 and at most 1 (got 1.01)",
            ),
        ),
        (
            r#"{"prompt":"hi","top_p":-0.5}"#,
            rej("top_p", "(got -0.5)"),
        ),
        (
            r#"{"prompt":"hi","top_p":"0.5"}"#,
            rej("top_p", "top_p must be a number"),
        ),
        (
            r#"{"prompt":"hi","top_p":false}"#,
            rej("top_p", "top_p must be a number (got false)"),
        ),
        // min_p 0..=1.
        (r#"{"prompt":"hi","min_p":0}"#, ok()),
        (r#"{"prompt":"hi","min_p":0.05}"#, ok()),
        (r#"{"prompt":"hi","min_p":1}"#, ok()),
        (
            r#"{"prompt":"hi","min_p":1.5}"#,
            rej("min_p", "min_p must be between 0 and 1 (got 1.5)"),
        ),
        (
            r#"{"prompt":"hi","min_p":-0.01}"#,
            rej("min_p", "(got -0.01)"),
        ),
        (
            r#"{"prompt":"hi","min_p":true}"#,
            rej("min_p", "min_p must be a number"),
        ),
        // presence / frequency penalties -2..=2.
        (r#"{"prompt":"hi","presence_penalty":-2}"#, ok()),
        (r#"{"prompt":"hi","presence_penalty":2}"#, ok()),
        (r#"{"prompt":"hi","presence_penalty":0.5}"#, ok()),
        (
            r#"{"prompt":"hi","presence_penalty":2.5}"#,
            rej(
                "presence_penalty",
                "presence_penalty must be between -2 and 2 (got 2.5)",
            ),
        ),
        (
            r#"{"prompt":"hi","presence_penalty":-2.01}"#,
            rej("presence_penalty", "(got -2.01)"),
        ),
        (
            r#"{"prompt":"hi","presence_penalty":"0"}"#,
            rej("presence_penalty", "presence_penalty must be a number"),
        ),
        (r#"{"prompt":"hi","frequency_penalty":-2.0}"#, ok()),
        (r#"{"prompt":"hi","frequency_penalty":2}"#, ok()),
        (
            r#"{"prompt":"hi","frequency_penalty":2.0001}"#,
            rej(
                "frequency_penalty",
                "frequency_penalty must be between -2 and 2 (got 2.0001)",
            ),
        ),
        (
            r#"{"prompt":"hi","frequency_penalty":-3}"#,
            rej("frequency_penalty", "(got -3)"),
        ),
        (
            r#"{"prompt":"hi","frequency_penalty":true}"#,
            rej(
                "frequency_penalty",
                "frequency_penalty must be a number (got true)",
            ),
        ),
        // repetition_penalty in (0, 2].
        (r#"{"prompt":"hi","repetition_penalty":1.1}"#, ok()),
        (r#"{"prompt":"hi","repetition_penalty":2}"#, ok()),
        (r#"{"prompt":"hi","repetition_penalty":0.01}"#, ok()),
        (
            r#"{"prompt":"hi","repetition_penalty":0}"#,
            rej(
                "repetition_penalty",
                "repetition_penalty must be greater than 0 and at most 2 (got 0)",
            ),
        ),
        (
            r#"{"prompt":"hi","repetition_penalty":2.1}"#,
            rej("repetition_penalty", "(got 2.1)"),
        ),
        (
            r#"{"prompt":"hi","repetition_penalty":-1}"#,
            rej("repetition_penalty", "(got -1)"),
        ),
        (
            r#"{"prompt":"hi","repetition_penalty":"1.1"}"#,
            rej("repetition_penalty", "repetition_penalty must be a number"),
        ),
    ]);
}

#[test]
fn booleans() {
    run(&[
        (r#"{"prompt":"hi","echo":true}"#, ok()),
        (r#"{"prompt":"hi","echo":false}"#, ok()),
        (
            r#"{"prompt":"hi","echo":1}"#,
            rej("echo", "echo must be a boolean (got 1)"),
        ),
        (
            r#"{"prompt":"hi","echo":"true"}"#,
            rej("echo", r#"echo must be a boolean (got "true")"#),
        ),
        (r#"{"prompt":"hi","stream":true}"#, ok()),
        (r#"{"prompt":"hi","stream":false}"#, ok()),
        (
            r#"{"prompt":"hi","stream":"true"}"#,
            rej("stream", r#"stream must be a boolean (got "true")"#),
        ),
        (
            r#"{"prompt":"hi","stream":1}"#,
            rej("stream", "stream must be a boolean (got 1)"),
        ),
        (r#"{"prompt":"hi","add_special_tokens":false}"#, ok()),
        (r#"{"prompt":"hi","add_special_tokens":true}"#, ok()),
        (
            r#"{"prompt":"hi","add_special_tokens":"false"}"#,
            rej(
                "add_special_tokens",
                r#"add_special_tokens must be a boolean (got "false")"#,
            ),
        ),
        (
            r#"{"prompt":"hi","add_special_tokens":0}"#,
            rej("add_special_tokens", "(got 0)"),
        ),
    ]);
    let req = parse(r#"{"prompt":"hi","echo":true,"stream":true,"add_special_tokens":false}"#);
    assert!(req.echo());
    assert!(req.stream());
    assert!(!req.add_special_tokens());
}

#[test]
fn stop() {
    run(&[
        (r#"{"prompt":"hi","stop":"\n"}"#, ok()),
        (r#"{"prompt":"hi","stop":["a"]}"#, ok()),
        (r#"{"prompt":"hi","stop":["a","b","c","d"]}"#, ok()),
        (r#"{"prompt":"hi","stop":[]}"#, ok()),
        (
            r#"{"prompt":"hi","stop":["a","b","c","d","e"]}"#,
            rej("stop", "stop must have at most 4 entries (got 5)"),
        ),
        (
            r#"{"prompt":"hi","stop":""}"#,
            rej("stop", "stop must not contain an empty string"),
        ),
        (
            r#"{"prompt":"hi","stop":["a",""]}"#,
            rej("stop", "stop must not contain an empty string"),
        ),
        (
            r#"{"prompt":"hi","stop":[1]}"#,
            rej("stop", "stop[0] must be a string (got 1)"),
        ),
        (
            r#"{"prompt":"hi","stop":["a",null]}"#,
            rej("stop", "stop[1] must be a string (got null)"),
        ),
        (
            r#"{"prompt":"hi","stop":5}"#,
            rej(
                "stop",
                "stop must be a string or an array of strings (got 5)",
            ),
        ),
        (
            r#"{"prompt":"hi","stop":{"a":1}}"#,
            rej("stop", "(got an object)"),
        ),
        (r#"{"prompt":"hi","stop":true}"#, rej("stop", "(got true)")),
        // Strings vLLM could not decode are refused here, not passed on.
        (
            r#"{"prompt":"hi","stop":"\ud800"}"#,
            rej("stop", "stop must be valid Unicode text"),
        ),
        (
            r#"{"prompt":"hi","stop":["a","x\udfff"]}"#,
            rej("stop", "stop[1] must be valid Unicode text"),
        ),
        (r#"{"prompt":"hi","stop":["\ud83d\ude00"]}"#, ok()),
    ]);
}

#[test]
fn stream_options() {
    run(&[
        (
            r#"{"prompt":"hi","stream":true,"stream_options":{"include_usage":true}}"#,
            ok(),
        ),
        (r#"{"prompt":"hi","stream":true,"stream_options":{}}"#, ok()),
        (
            r#"{"prompt":"hi","stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}"#,
            ok(),
        ),
        // Null stream_options is "not given", so fine without stream.
        (r#"{"prompt":"hi","stream_options":null}"#, ok()),
        (
            r#"{"prompt":"hi","stream":true,"stream_options":{"include_usage":true,"foo":1}}"#,
            rej("stream_options", "Unknown field 'stream_options.foo'"),
        ),
        (
            r#"{"prompt":"hi","stream":true,"stream_options":{"include_usage":"yes"}}"#,
            rej(
                "stream_options.include_usage",
                r#"stream_options.include_usage must be a boolean (got "yes")"#,
            ),
        ),
        (
            r#"{"prompt":"hi","stream":true,"stream_options":{"include_usage":null}}"#,
            rej(
                "stream_options.include_usage",
                "must be a boolean (got null)",
            ),
        ),
        (
            r#"{"prompt":"hi","stream":true,"stream_options":{"continuous_usage_stats":1}}"#,
            rej(
                "stream_options.continuous_usage_stats",
                "stream_options.continuous_usage_stats must be a boolean (got 1)",
            ),
        ),
        (
            r#"{"prompt":"hi","stream":true,"stream_options":{"include_usage":true,"include_usage":false}}"#,
            rej(
                "stream_options",
                "duplicate field 'stream_options.include_usage'",
            ),
        ),
        (
            r#"{"prompt":"hi","stream":true,"stream_options":[]}"#,
            rej(
                "stream_options",
                "stream_options must be an object (got an array)",
            ),
        ),
        (
            r#"{"prompt":"hi","stream":true,"stream_options":true}"#,
            rej(
                "stream_options",
                "stream_options must be an object (got true)",
            ),
        ),
        // Only with stream: true.
        (
            r#"{"prompt":"hi","stream_options":{"include_usage":true}}"#,
            rej(
                "stream_options",
                "stream_options is only allowed with stream: true",
            ),
        ),
        (
            r#"{"prompt":"hi","stream":false,"stream_options":{}}"#,
            rej(
                "stream_options",
                "stream_options is only allowed with stream: true",
            ),
        ),
        (
            r#"{"prompt":"hi","stream":null,"stream_options":{}}"#,
            rej(
                "stream_options",
                "stream_options is only allowed with stream: true",
            ),
        ),
    ]);
}

#[test]
fn include_usage_as_vllm_applies_it() {
    let usage = |body: &str| parse(body).include_usage();
    assert!(!usage(r#"{"prompt":"hi"}"#));
    assert!(!usage(r#"{"prompt":"hi","stream":true}"#));
    assert!(!usage(
        r#"{"prompt":"hi","stream":true,"stream_options":null}"#
    ));
    assert!(usage(
        r#"{"prompt":"hi","stream":true,"stream_options":{}}"#
    ));
    assert!(usage(
        r#"{"prompt":"hi","stream":true,"stream_options":{"continuous_usage_stats":true}}"#
    ));
    assert!(usage(
        r#"{"prompt":"hi","stream":true,"stream_options":{"include_usage":true}}"#
    ));
    assert!(!usage(
        r#"{"prompt":"hi","stream":true,"stream_options":{"include_usage":false}}"#
    ));
}

#[test]
fn max_tokens_required_for_batch_or_n() {
    const REQUIRED: &str = "max_tokens is required when sending a batch of prompts or n > 1";
    run(&[
        (r#"{"prompt":"hi"}"#, ok()),
        (r#"{"prompt":[1,2,3]}"#, ok()),
        (r#"{"prompt":["only"]}"#, ok()),
        (r#"{"prompt":"hi","n":1}"#, ok()),
        (r#"{"prompt":["a","b"]}"#, rej("max_tokens", REQUIRED)),
        (
            r#"{"prompt":["a","b"],"max_tokens":null}"#,
            rej("max_tokens", REQUIRED),
        ),
        (r#"{"prompt":[[1],[2]]}"#, rej("max_tokens", REQUIRED)),
        (r#"{"prompt":"hi","n":2}"#, rej("max_tokens", REQUIRED)),
        (r#"{"prompt":["a","b"],"max_tokens":4}"#, ok()),
        (r#"{"prompt":"hi","n":2,"max_tokens":4}"#, ok()),
    ]);
}

#[test]
fn output_work_cap() {
    run(&[
        (r#"{"prompt":"hi","max_tokens":32000}"#, ok()),
        (
            r#"{"prompt":"hi","max_tokens":32001}"#,
            rej(
                "max_tokens",
                "prompt_count × n × max_tokens = 1 × 1 × 32001 = 32001 exceeds the limit of 32000",
            ),
        ),
        (r#"{"prompt":["a","b"],"max_tokens":16000}"#, ok()),
        (
            r#"{"prompt":["a","b"],"max_tokens":16001}"#,
            rej(
                "max_tokens",
                "prompt_count × n × max_tokens = 2 × 1 × 16001 = 32002 exceeds the limit of 32000",
            ),
        ),
        (
            r#"{"prompt":["a","b"],"n":4,"max_tokens":8000}"#,
            rej(
                "max_tokens",
                "prompt_count × n × max_tokens = 2 × 4 × 8000 = 64000 exceeds the limit of 32000",
            ),
        ),
        (r#"{"prompt":["a","b"],"n":4,"max_tokens":4000}"#, ok()),
        (r#"{"prompt":"hi","n":16,"max_tokens":2000}"#, ok()),
        (
            r#"{"prompt":"hi","n":16,"max_tokens":2001}"#,
            rej("max_tokens", "1 × 16 × 2001 = 32016"),
        ),
        (r#"{"prompt":[[1],[2],[3]],"max_tokens":10666}"#, ok()),
        (
            r#"{"prompt":[[1],[2],[3]],"max_tokens":10667}"#,
            rej("max_tokens", "3 × 1 × 10667 = 32001"),
        ),
    ]);
    // A batch of 32000 one-token prompts at max_tokens 1 is exactly at the cap.
    let batch = vec!["[1]"; 32_000].join(",");
    assert!(
        CompletionRequest::parse(format!(r#"{{"prompt":[{batch}],"max_tokens":1}}"#).as_bytes())
            .is_ok()
    );
    let batch = vec!["[1]"; 32_001].join(",");
    let (param, message) = error(&format!(r#"{{"prompt":[{batch}],"max_tokens":1}}"#));
    assert_eq!(param.as_deref(), Some("max_tokens"));
    assert!(message.contains("32001 × 1 × 1 = 32001"), "{message}");
}

#[test]
fn received_values_are_rendered_briefly() {
    let long = "x".repeat(500);
    let (_, message) = error(&format!(r#"{{"prompt":"hi","max_tokens":"{long}"}}"#));
    assert!(
        message.contains(&format!("(got \"{}…\")", "x".repeat(40))),
        "{message}"
    );
    assert!(message.len() < 120, "{message}");

    let digits = "9".repeat(300);
    let (_, message) = error(&format!(r#"{{"prompt":"hi","seed":{digits}}}"#));
    assert!(
        message.contains(&format!("(got {}…)", "9".repeat(40))),
        "{message}"
    );

    // Escapes in a received string are shown escaped, not raw.
    let (_, message) = error(r#"{"prompt":"hi","echo":"a\nb"}"#);
    assert!(message.contains(r#"(got "a\nb")"#), "{message}");

    // A wrong-typed prompt is never echoed.
    let (_, message) = error(r#"{"prompt":{"secret":"text"}}"#);
    assert!(!message.contains("secret"), "{message}");
}

#[test]
fn accessors() {
    let req = parse(
        r#"{"model":"llama-8b","prompt":["a","b"],"max_tokens":8,"n":3,"logprobs":5,
            "prompt_logprobs":-1,"echo":true,"add_special_tokens":false}"#,
    );
    assert_eq!(req.model(), Some("llama-8b"));
    assert_eq!(req.prompt_count(), 2);
    assert_eq!(req.max_tokens(), Some(8));
    assert_eq!(req.n(), 3);
    assert!(!req.stream());
    assert!(!req.include_usage());
    assert_eq!(req.logprobs(), Some(5));
    assert_eq!(req.prompt_logprobs(), Some(-1));
    assert!(req.echo());
    assert!(!req.add_special_tokens());

    let req = parse(r#"{"prompt":"hi"}"#);
    assert_eq!(req.model(), None);
    assert_eq!(req.max_tokens(), None);
    assert_eq!(req.n(), 1);
    assert!(!req.echo());
    assert!(req.add_special_tokens());
}

#[test]
fn debug_never_shows_the_prompt() {
    let req = parse(r#"{"prompt":"top secret text","stop":"classified"}"#);
    let shown = format!("{req:?}");
    assert!(!shown.contains("secret"), "{shown}");
    assert!(!shown.contains("classified"), "{shown}");
    assert!(shown.contains("Text(15 bytes)"), "{shown}");
}

// ---------------------------------------------------------------------------------
// upstream_body

fn upstream(body: &str, served: &str, max_tokens: Option<u64>) -> String {
    let out = parse(body).upstream_body(served, max_tokens);
    // Always a valid JSON object.
    let value: serde_json::Value = match serde_json::from_slice(&out) {
        Ok(value) => value,
        Err(err) => panic!(
            "upstream body is not JSON ({err}): {}",
            String::from_utf8_lossy(&out)
        ),
    };
    assert!(value.is_object());
    match String::from_utf8(out) {
        Ok(s) => s,
        Err(err) => panic!("upstream body is not UTF-8: {err}"),
    }
}

#[test]
fn upstream_keeps_order_and_number_text() {
    assert_eq!(
        upstream(
            r#"{"prompt":"hi","temperature":0.30000000000000004,"seed":9223372036854775807,"top_p":1e-1,"model":"llama-8b","max_tokens":16,"min_p":5E-2,"presence_penalty":-0.0,"frequency_penalty":1.000000000000000000001,"top_k":-1}"#,
            "meta-llama/Llama-3.1-8B",
            None,
        ),
        r#"{"prompt":"hi","temperature":0.30000000000000004,"seed":9223372036854775807,"top_p":1e-1,"model":"meta-llama/Llama-3.1-8B","max_tokens":16,"min_p":5E-2,"presence_penalty":-0.0,"frequency_penalty":1.000000000000000000001,"top_k":-1}"#,
    );
}

#[test]
fn upstream_model_rewritten_or_inserted_first() {
    assert_eq!(
        upstream(r#"{"prompt":"hi","max_tokens":4}"#, "org/model", None),
        r#"{"model":"org/model","prompt":"hi","max_tokens":4}"#,
    );
    assert_eq!(
        upstream(r#"{"prompt":"hi","model":null,"n":1}"#, "org/model", None),
        r#"{"prompt":"hi","model":"org/model","n":1}"#,
    );
    assert_eq!(
        upstream(
            r#"{"prompt":"hi","model":"alias"}"#,
            r#"we"ird\model"#,
            None
        ),
        r#"{"prompt":"hi","model":"we\"ird\\model"}"#,
    );
}

#[test]
fn upstream_drops_nulls() {
    assert_eq!(
        upstream(
            r#"{"prompt":"hi","n":null,"stop":null,"max_tokens":null,"stream_options":null,"echo":false,"user":null}"#,
            "m",
            None,
        ),
        r#"{"model":"m","prompt":"hi","echo":false}"#,
    );
}

#[test]
fn upstream_max_tokens_injected() {
    // Absent: appended last.
    assert_eq!(
        upstream(r#"{"prompt":"hi","temperature":0}"#, "m", Some(32000)),
        r#"{"model":"m","prompt":"hi","temperature":0,"max_tokens":32000}"#,
    );
    // Null: replaced in place.
    assert_eq!(
        upstream(r#"{"max_tokens":null,"prompt":"hi"}"#, "m", Some(100)),
        r#"{"model":"m","max_tokens":100,"prompt":"hi"}"#,
    );
    // Given (e.g. clamped to a budget): replaced in place.
    assert_eq!(
        upstream(r#"{"prompt":"hi","max_tokens":500,"n":1}"#, "m", Some(20)),
        r#"{"model":"m","prompt":"hi","max_tokens":20,"n":1}"#,
    );
    // None: the client's value stays.
    assert_eq!(
        upstream(r#"{"prompt":"hi","max_tokens":500}"#, "m", None),
        r#"{"model":"m","prompt":"hi","max_tokens":500}"#,
    );
}

#[test]
fn upstream_empty_prompt_becomes_a_list() {
    assert_eq!(
        upstream(r#"{"prompt":""}"#, "m", Some(5)),
        r#"{"model":"m","prompt":[""],"max_tokens":5}"#
    );
    assert_eq!(
        upstream(r#"{"prompt":[""]}"#, "m", None),
        r#"{"model":"m","prompt":[""]}"#
    );
    assert_eq!(
        upstream(r#"{"prompt":" "}"#, "m", None),
        r#"{"model":"m","prompt":" "}"#
    );
    assert_eq!(
        upstream(r#"{"prompt":["a",""],"max_tokens":2}"#, "m", None),
        r#"{"model":"m","prompt":["a",""],"max_tokens":2}"#,
    );
}

#[test]
fn upstream_preserves_string_text() {
    let body = r#"{"prompt":"caf\u00e9 \"q\" \\ \n\t ✓ \ud83d\ude00 <|begin_of_text|>","stop":["\u0000","  two  spaces "],"user":"ü\/x"}"#;
    assert_eq!(
        upstream(body, "m", None),
        r#"{"model":"m","prompt":"caf\u00e9 \"q\" \\ \n\t ✓ \ud83d\ude00 <|begin_of_text|>","stop":["\u0000","  two  spaces "],"user":"ü\/x"}"#,
    );
}

#[test]
fn upstream_is_compact() {
    let body = "{ \"prompt\" : [ [1, 2] ,\n [3] ] ,\r\n\t\"stop\" : [ \"a b\" , \"c\\\" d\" ],\n \"max_tokens\" : 4 ,\
                \"stream\" : true , \"stream_options\" : { \"include_usage\" : true } }";
    assert_eq!(
        upstream(body, "m", None),
        r#"{"model":"m","prompt":[[1,2],[3]],"stop":["a b","c\" d"],"max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}"#,
    );
}

#[test]
fn upstream_writes_escaped_keys_plainly() {
    assert_eq!(
        upstream(r#"{"\u0070rompt":"hi","m\u0061x_tokens":3}"#, "m", None),
        r#"{"model":"m","prompt":"hi","max_tokens":3}"#,
    );
}

#[test]
fn upstream_streams_always_ask_for_usage() {
    assert_eq!(
        upstream(r#"{"prompt":"hi","stream":true}"#, "m", Some(5)),
        r#"{"model":"m","prompt":"hi","stream":true,"max_tokens":5,"stream_options":{"include_usage":true}}"#,
    );
    assert_eq!(
        upstream(
            r#"{"prompt":"hi","stream":true,"stream_options":{"continuous_usage_stats":true, "include_usage":false},"max_tokens":3}"#,
            "m",
            None
        ),
        r#"{"model":"m","prompt":"hi","stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true},"max_tokens":3}"#,
    );
    assert_eq!(
        upstream(
            r#"{"prompt":"hi","stream":false,"max_tokens":3}"#,
            "m",
            None
        ),
        r#"{"model":"m","prompt":"hi","stream":false,"max_tokens":3}"#,
    );
}
