//! The `fleetgate keys …` commands: what they do to the store and what they print.

use serde_json::json;

use crate::keys;
use crate::store::{KeyRecord, Store};

/// Creates a key. Text output ends with the secret alone on the last line, so scripts
/// can take it with `tail -n1`; `--json` prints one object with it as `secret`.
pub async fn create_key(
    store: &dyn Store,
    name: &str,
    email: Option<&str>,
    as_json: bool,
) -> anyhow::Result<String> {
    let key = keys::generate();
    let record = store.create_key(name, email, &key).await?;
    let secret = key.secret.expose();
    Ok(if as_json {
        let mut value = record_json(&record);
        value["secret"] = json!(secret);
        value.to_string()
    } else {
        format!(
            "Created key {} (id {}, name {:?}). The secret is shown only now:\n{secret}",
            record.prefix, record.id, record.name
        )
    })
}

pub async fn list_keys(store: &dyn Store, as_json: bool) -> anyhow::Result<String> {
    let records = store.list_keys().await?;
    if as_json {
        let list: Vec<_> = records.iter().map(record_json).collect();
        return Ok(serde_json::Value::Array(list).to_string());
    }
    let mut out = format!(
        "{:<6} {:<14} {:<8} {:<24} {}",
        "ID", "PREFIX", "STATE", "NAME", "EMAIL"
    );
    for r in &records {
        let state = if r.is_active() { "active" } else { "revoked" };
        out.push_str(&format!(
            "\n{:<6} {:<14} {:<8} {:<24} {}",
            r.id,
            r.prefix,
            state,
            r.name,
            r.email.as_deref().unwrap_or("-")
        ));
    }
    Ok(out)
}

pub async fn revoke_key(store: &dyn Store, id_or_prefix: &str) -> anyhow::Result<String> {
    match store.revoke_key(id_or_prefix).await? {
        Some(record) => Ok(format!("Revoked key {} (id {}).", record.prefix, record.id)),
        None => anyhow::bail!("no key with id or prefix '{id_or_prefix}'"),
    }
}

fn record_json(record: &KeyRecord) -> serde_json::Value {
    json!({
        "id": record.id,
        "name": record.name,
        "email": record.email,
        "prefix": record.prefix,
        "created_at": record.created_at,
        "revoked_at": record.revoked_at,
        "active": record.is_active(),
    })
}
