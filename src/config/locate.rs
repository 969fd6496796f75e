//! Where a problem's key was set: the line (and column) of the TOML file that says it,
//! or the `FLEETGATE_*` variable that overrode it.

use std::collections::HashMap;
use std::ops::Range;

use toml_edit::{ImDocument, Item, Table, Value};

/// Environment variables that are read elsewhere and are not configuration keys.
pub(super) const ENV_NOT_CONFIG: &[&str] = &["config"];

/// The prefix of the variables that override the file's keys.
pub(super) const ENV_PREFIX: &str = "FLEETGATE_";

/// Where a key was set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// In the file, at this line and column (both from 1).
    Line { line: usize, column: usize },
    /// By this environment variable.
    Env(String),
    /// Nowhere the user wrote: a default, or a whole missing table.
    Unplaced,
}

/// The file's text, parsed with the positions of its keys, and the overriding variables.
pub(super) struct Places<'t> {
    text: &'t str,
    document: ImDocument<&'t str>,
    /// Each variable by the key it sets (`limits.share` for `FLEETGATE_LIMITS__SHARE`).
    env: HashMap<Vec<String>, String>,
}

impl<'t> Places<'t> {
    /// `text` parsed, with the `FLEETGATE_*` variables set now; a syntax error is said
    /// with where it is.
    pub fn new(text: &'t str) -> Result<Self, (Origin, String)> {
        let document = ImDocument::parse(text).map_err(|error| {
            let origin = error
                .span()
                .map_or(Origin::Unplaced, |span| line_of(text, span.start));
            let message = error.message().trim().replace('\n', "; ");
            (origin, format!("TOML syntax: {message}"))
        })?;
        // `vars_os`: `vars` panics on a variable that is not UTF-8 (of any name).
        let env = std::env::vars_os()
            .filter_map(|(name, _)| {
                let name = name.into_string().ok()?;
                let key = name.strip_prefix(ENV_PREFIX)?.to_lowercase();
                let config = !ENV_NOT_CONFIG.contains(&key.as_str());
                config.then(|| (key.split("__").map(str::to_owned).collect(), name))
            })
            .collect();
        Ok(Self {
            text,
            document,
            env,
        })
    }

    /// Where `key` (a path; an array element by its index) was set: by a variable that
    /// sets it or a table holding it, else the line that says it in the file, else the
    /// line of the nearest table around it that the file has.
    pub fn of(&self, key: &[String]) -> Origin {
        for end in (1..=key.len()).rev() {
            if let Some(name) = self.env.get(&key[..end]) {
                return Origin::Env(name.clone());
            }
        }
        match span_of(self.document.as_table(), key) {
            Some(span) => line_of(self.text, span.start),
            None => Origin::Unplaced,
        }
    }
}

/// The span of the deepest part of `key` that `table` has (the key itself where it is
/// written, a table by its header); `None` when not even the first part is there.
fn span_of(table: &Table, key: &[String]) -> Option<Range<usize>> {
    let (first, rest) = key.split_first()?;
    let (written, item) = table.get_key_value(first)?;
    let here = written.span().or_else(|| item.span());
    let deeper = match item {
        Item::Table(table) => span_of(table, rest),
        Item::ArrayOfTables(tables) => {
            let (index, rest) = rest.split_first()?;
            let table = tables.get(index.parse().ok()?)?;
            span_of(table, rest).or_else(|| table.span())
        }
        Item::Value(value) => value_span(value, rest),
        Item::None => None,
    };
    deeper.or(here)
}

/// The same within an inline value (an inline table or an array).
fn value_span(value: &Value, key: &[String]) -> Option<Range<usize>> {
    let (first, rest) = key.split_first()?;
    let (here, inner) = match value {
        Value::InlineTable(table) => {
            let (written, item) = table.get_key_value(first)?;
            (written.span(), item.as_value()?)
        }
        Value::Array(items) => {
            let item = items.get(first.parse().ok()?)?;
            (item.span(), item)
        }
        _ => return None,
    };
    value_span(inner, rest).or(here)
}

/// The line and column (from 1, in characters) of byte `offset` of `text`.
fn line_of(text: &str, offset: usize) -> Origin {
    let before = text.get(..offset).unwrap_or(text);
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    Origin::Line {
        line: before.matches('\n').count() + 1,
        column: before[line_start..].chars().count() + 1,
    }
}
