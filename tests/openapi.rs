//! The OpenAPI document: checked in, current, and in agreement with the parser.

use fleetgate::completion::request::CompletionRequest;
use serde_json::{Value, json};

const CHECKED_IN: &str = "openapi/openapi.json";

fn generated() -> Value {
    serde_json::to_value(fleetgate::openapi::document()).unwrap()
}

/// Fails when the code's document and `openapi/openapi.json` differ. Run with
/// `UPDATE_OPENAPI=1` to rewrite the file after an intended change.
#[test]
fn checked_in_document_matches_the_code() {
    let pretty = fleetgate::openapi::document().to_pretty_json().unwrap() + "\n";
    if std::env::var_os("UPDATE_OPENAPI").is_some() {
        std::fs::write(CHECKED_IN, &pretty).unwrap();
    }
    let on_disk = std::fs::read_to_string(CHECKED_IN).unwrap_or_default();
    assert!(
        on_disk == pretty,
        "{CHECKED_IN} is out of date: run `UPDATE_OPENAPI=1 cargo test --test openapi` and commit it"
    );
}

/// Every numeric bound the document publishes is the parser's bound: the edge value is
/// accepted and the first value past it is rejected for that field.
#[test]
fn published_bounds_are_the_parsers_bounds() {
    let doc = generated();
    let properties = doc["components"]["schemas"]["CompletionRequest"]["properties"]
        .as_object()
        .unwrap();
    let mut checked = 0;
    for (field, schema) in properties {
        let integer = schema["type"].as_array().is_some_and(|t| t.contains(&json!("integer")))
            || schema["type"] == "integer";
        let step = if integer { 1.0 } else { 1e-6 };
        let edges = [
            ("minimum", -step, true),
            ("exclusiveMinimum", 0.0, false),
            ("maximum", step, true),
        ];
        for (key, beyond, inclusive) in edges {
            let Some(bound) = schema.get(key).and_then(Value::as_f64) else { continue };
            // max_tokens' schema bound sits above the output-work cap (32000), which
            // rejects the edge value itself.
            if inclusive && !(field == "max_tokens" && key == "maximum") {
                assert_accepts(field, number(bound, integer), true);
            }
            assert_accepts(field, number(bound + beyond, integer), false);
            checked += 1;
        }
    }
    assert!(checked >= 15, "only {checked} bounds found in the document");
}

fn number(x: f64, integer: bool) -> Value {
    if integer {
        // i64::MAX as f64 rounds up to 2^63; keep the exact integer.
        if x >= 9.2e18 {
            return if x > 9_223_372_036_854_775_807.0 {
                serde_json::from_str("9223372036854775808").unwrap()
            } else {
                json!(i64::MAX)
            };
        }
        json!(x.round() as i64)
    } else {
        json!(x)
    }
}

fn assert_accepts(field: &str, value: Value, accepted: bool) {
    let mut body = json!({"prompt": "Hi", "max_tokens": 1});
    body[field] = value.clone();
    let bytes = body.to_string();
    let result = CompletionRequest::parse(bytes.as_bytes());
    assert_eq!(result.is_ok(), accepted, "{field} = {value}: {:?}", result.err());
}
