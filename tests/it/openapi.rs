//! The OpenAPI document: checked in, current, and in agreement with the parser.

use fleetgate::completion::request::CompletionRequest;
use serde_json::{Value, json};

const CHECKED_IN: &str = "openapi/openapi.json";

fn generated() -> Value {
    serde_json::to_value(fleetgate::http::router::openapi_document()).unwrap()
}

/// Fails when the code's document and `openapi/openapi.json` differ. Run with
/// `UPDATE_OPENAPI=1` to rewrite the file after an intended change.
#[test]
fn checked_in_document_matches_the_code() {
    let pretty = fleetgate::http::router::openapi_document()
        .to_pretty_json()
        .unwrap()
        + "\n";
    if std::env::var_os("UPDATE_OPENAPI").is_some() {
        std::fs::write(CHECKED_IN, &pretty).unwrap();
    }
    let on_disk = std::fs::read_to_string(CHECKED_IN).unwrap_or_default();
    assert!(
        on_disk == pretty,
        "{CHECKED_IN} is out of date: run `UPDATE_OPENAPI=1 cargo test --test it openapi::` and commit it"
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
        let integer = schema["type"]
            .as_array()
            .is_some_and(|t| t.contains(&json!("integer")))
            || schema["type"] == "integer";
        // (bound, direction of the first value past it, is the bound itself allowed)
        let edges = [
            ("minimum", -1, true),
            ("exclusiveMinimum", 0, false),
            ("maximum", 1, true),
        ];
        for (key, direction, inclusive) in edges {
            let Some(bound) = schema.get(key) else {
                continue;
            };
            // max_tokens' schema bound sits above the output-work cap (32000), which
            // rejects the edge value itself.
            if inclusive && !(field == "max_tokens" && key == "maximum") {
                assert_accepts(field, bound.clone(), true);
            }
            assert_accepts(field, step(bound, direction, integer), false);
            checked += 1;
        }
    }
    assert!(checked >= 15, "only {checked} bounds found in the document");
}

/// The value `direction` steps past `bound`: ±1 for integers (exact, in i128), ±1e-6 for
/// floats; 0 gives the bound itself.
fn step(bound: &Value, direction: i128, integer: bool) -> Value {
    if integer {
        let exact: i128 = bound.to_string().parse().unwrap();
        serde_json::from_str(&(exact + direction).to_string()).unwrap()
    } else {
        json!(bound.as_f64().unwrap() + direction as f64 * 1e-6)
    }
}

fn assert_accepts(field: &str, value: Value, accepted: bool) {
    let mut body = json!({"prompt": "Hi", "max_tokens": 1});
    body[field] = value.clone();
    let bytes = body.to_string();
    let result = CompletionRequest::parse(bytes.as_bytes());
    assert_eq!(
        result.is_ok(),
        accepted,
        "{field} = {value}: {:?}",
        result.err()
    );
}

/// Every operation that needs a key or the admin token documents the 401 it answers
/// without one; every one that needs a key, the 503 `store_unavailable` of a key not in
/// memory while the store is away.
#[test]
fn every_protected_operation_documents_its_401() {
    let doc = generated();
    let mut protected = 0;
    let mut missing = Vec::new();
    for (path, operations) in doc["paths"].as_object().unwrap() {
        for (method, operation) in operations.as_object().unwrap() {
            let Some(security) = operation["security"].as_array().filter(|s| !s.is_empty()) else {
                continue;
            };
            protected += 1;
            let responses = &operation["responses"];
            if responses.get("401").is_none() {
                missing.push(format!("{method} {path}: 401"));
            }
            let by_key = security.iter().any(|s| s.get("bearer").is_some());
            let store_unavailable = responses["503"]["description"]
                .as_str()
                .is_some_and(|d| d.contains("`store_unavailable`"));
            if by_key && !store_unavailable {
                missing.push(format!("{method} {path}: 503 store_unavailable"));
            }
        }
    }
    assert!(
        protected >= 10,
        "only {protected} protected operations found"
    );
    assert!(missing.is_empty(), "not documented: {missing:?}");
}

/// The schema of a streamed 200 (`text/event-stream`) describes one server-sent event,
/// as OpenAPI 3.2's `itemSchema` does and as schema-driven tools read `schema` of a 3.1
/// event stream: an object whose `data` is a string. (It was `type: string`, which no
/// event matches: schemathesis reported every stream as violating the document.)
#[test]
fn the_stream_schema_describes_one_server_sent_event() {
    let doc = generated();
    let schema = &doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]
        ["schema"];
    let name = schema["$ref"]
        .as_str()
        .and_then(|r| r.strip_prefix("#/components/schemas/"))
        .unwrap_or_else(|| panic!("a reference to the event's schema: {schema}"));
    let event = &doc["components"]["schemas"][name];
    assert_eq!(event["type"], "object", "{event}");
    assert_eq!(event["properties"]["data"]["type"], "string", "{event}");
    assert_eq!(event["required"], json!(["data"]), "{event}");
}

/// Every operation on one key (`/admin/keys/{key}…`, by id or prefix) is linked from the
/// key `POST /admin/keys` creates, by the created key's `prefix`: a client, or a
/// stateful fuzzer, learns from the document what `{key}` takes.
#[test]
fn a_created_key_links_to_every_operation_on_it() {
    let doc = generated();
    let links = doc["paths"]["/admin/keys"]["post"]["responses"]["201"]["links"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    let key_view = &doc["components"]["schemas"]["KeyView"];
    assert!(
        key_view["required"]
            .as_array()
            .unwrap()
            .contains(&json!("prefix"))
    );
    let mut linked = 0;
    for (path, operations) in doc["paths"].as_object().unwrap() {
        if !path.contains("{key}") {
            continue;
        }
        for operation in operations.as_object().unwrap().values() {
            let id = operation["operationId"].as_str().unwrap();
            let link = links
                .values()
                .find(|link| link["operationId"] == id)
                .unwrap_or_else(|| panic!("no link from the created key to {id}"));
            assert_eq!(
                link["parameters"],
                json!({"key": "$response.body#/prefix"}),
                "{id}"
            );
            linked += 1;
        }
    }
    assert_eq!(linked, 5, "the five operations on one key");
}
