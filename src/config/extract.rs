//! The merged layers read into a [`Config`] with every problem serde finds said, not only
//! the first: serde stops at the first unknown key or wrong type, so after each one the
//! offending value is taken out (its default applies) or, for a missing required key, a
//! stand-in is put in, and the reading starts again. What was taken out or stood in is
//! remembered, so that validation's findings about those keys (which are about a value
//! the user did not write) are not said on top.

use figment::Figment;
use figment::error::Kind;
use figment::providers::Serialized;
use figment::value::{Dict, Num, Tag, Value};

use super::schema::Config;

/// Rounds of reading before giving up: each says one problem, and no real file has
/// this many.
const MAX_ROUNDS: usize = 500;

/// A problem serde found: the key (its path; an array element by its index) and what is
/// wrong.
#[derive(Debug)]
pub(super) struct Misfit {
    pub key: Vec<String>,
    pub message: String,
}

/// What reading gave: the config (`None` when even the repaired values could not be
/// read), the problems, and the keys whose values were replaced to go on.
pub(super) struct Extracted {
    pub config: Option<Config>,
    pub misfits: Vec<Misfit>,
    pub repaired: Vec<Vec<String>>,
}

/// Reads `figment`'s merged values into a [`Config`], saying every problem.
pub(super) fn extract(figment: &Figment) -> Extracted {
    let mut extracted = Extracted {
        config: None,
        misfits: Vec::new(),
        repaired: Vec::new(),
    };
    let mut value: Value = match figment.extract() {
        Ok(value) => value,
        Err(errors) => {
            let misfits = errors.into_iter().map(|e| {
                let key = e.path.clone();
                misfit(e, key)
            });
            extracted.misfits.extend(misfits);
            return extracted;
        }
    };
    // The stand-in tried at each key that was missing (an index into `stand_in`).
    let mut stand_ins: Vec<(Vec<String>, usize)> = Vec::new();
    for _ in 0..MAX_ROUNDS {
        let error = match Figment::from(Serialized::defaults(&value)).extract::<Config>() {
            Ok(config) => {
                extracted.config = Some(config);
                return extracted;
            }
            // serde's derive stops at its first error: one a round.
            Err(errors) => match errors.into_iter().next() {
                Some(error) => error,
                None => return extracted,
            },
        };
        let mut key = error.path.clone();
        if let Kind::MissingField(field) = &error.kind {
            key.push(field.to_string());
        }
        // A problem inside a stand-in is ours, not the user's.
        if !stand_ins.iter().any(|(at, _)| key.starts_with(at)) {
            extracted.misfits.push(misfit(error, key.clone()));
        }
        let tried = stand_ins.iter_mut().find(|(at, _)| *at == key);
        let placed = match tried {
            // Our own stand-in was of the wrong type: try the next.
            Some((_, tries)) => {
                *tries += 1;
                stand_in(*tries).is_some_and(|v| put(&mut value, &key, v))
            }
            None if take_out(&mut value, &key) => true,
            // Missing, or an element of an array (which is replaced, not removed: the
            // indices of the ones after it must stay those of the file).
            None => {
                stand_ins.push((key.clone(), 0));
                stand_in(0).is_some_and(|v| put(&mut value, &key, v))
            }
        };
        if !placed {
            return extracted;
        }
        if !extracted.repaired.contains(&key) {
            extracted.repaired.push(key);
        }
    }
    extracted
}

/// The stand-ins for a missing required key, tried in turn until one has its type.
fn stand_in(try_number: usize) -> Option<Value> {
    let tag = Tag::Default;
    Some(match try_number {
        0 => Value::String(tag, String::new()),
        1 => Value::Array(tag, Vec::new()),
        2 => empty_table(),
        3 => Value::Num(tag, Num::U64(0)),
        4 => Value::Bool(tag, false),
        _ => return None,
    })
}

fn empty_table() -> Value {
    Value::Dict(Tag::Default, Dict::new())
}

/// Removes the value at `key` from a table; `false` if it is not in one.
fn take_out(value: &mut Value, key: &[String]) -> bool {
    let Some((last, parent)) = key.split_last() else {
        return false;
    };
    match at(value, parent) {
        Some(Value::Dict(_, dict)) => dict.remove(last).is_some(),
        _ => false,
    }
}

/// Sets the value at `key` (in a table, or an array element that exists); `false` if
/// its parent is neither.
fn put(value: &mut Value, key: &[String], new: Value) -> bool {
    let Some((last, parent)) = key.split_last() else {
        return false;
    };
    match at(value, parent) {
        Some(Value::Dict(_, dict)) => {
            dict.insert(last.clone(), new);
            true
        }
        Some(Value::Array(_, items)) => {
            match last.parse::<usize>().ok().and_then(|i| items.get_mut(i)) {
                Some(item) => {
                    *item = new;
                    true
                }
                None => false,
            }
        }
        _ => false,
    }
}

/// The value at `key`, if there is one.
fn at<'v>(value: &'v mut Value, key: &[String]) -> Option<&'v mut Value> {
    key.iter().try_fold(value, |value, part| match value {
        Value::Dict(_, dict) => dict.get_mut(part),
        Value::Array(_, items) => part.parse::<usize>().ok().and_then(|i| items.get_mut(i)),
        _ => None,
    })
}

/// figment's error said as `key: problem` — without its doubled quoting of expected
/// names; the unknown key is named in the problem, with the table it sits in.
fn misfit(error: figment::Error, key: Vec<String>) -> Misfit {
    let path = &error.path;
    let message = match &error.kind {
        Kind::UnknownField(found, expected) => {
            let at = match path.split_last() {
                Some((_, parent)) if !parent.is_empty() => format!("in [{}]: ", dotted(parent)),
                _ => String::new(),
            };
            format!(
                "{at}unknown key `{found}`; expected one of: {}",
                expected.join(", ")
            )
        }
        Kind::UnknownVariant(found, expected) => format!(
            "{}: unknown value `{found}`; expected one of: {}",
            dotted(path),
            expected.join(", ")
        ),
        Kind::MissingField(field) if path.is_empty() => format!("missing key `{field}`"),
        Kind::MissingField(field) => format!("in [{}]: missing key `{field}`", dotted(path)),
        other if path.is_empty() => other.to_string(),
        other => format!("{}: {other}", dotted(path)),
    };
    Misfit { key, message }
}

/// A key as the user would write it: `models[0].upstreams[1].url`.
pub(super) fn dotted(key: &[String]) -> String {
    let mut said = String::new();
    for part in key {
        if part.parse::<usize>().is_ok() {
            said.push_str(&format!("[{part}]"));
        } else {
            if !said.is_empty() {
                said.push('.');
            }
            said.push_str(part);
        }
    }
    said
}
