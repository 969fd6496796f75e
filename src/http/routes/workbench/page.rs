//! The Workbench API's lists a page at a time: `limit` (1 to 100, default 50) and
//! `cursor` (the previous page's `next_cursor`), answered as
//! `{"object":"list","data":[…],"has_more":…,"next_cursor":…}`, most recently changed
//! first. A cursor is the place of the page's last entry (its change time and id), so a
//! page never repeats or skips an entry that did not change meanwhile.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::store::workbench::{Cursor, Page};

/// Entries per page unless `limit` says otherwise, and the most.
const DEFAULT_LIMIT: u32 = 50;
const MAX_LIMIT: u32 = 100;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct PageParams {
    /// Entries per page, 1 to 100 (default 50).
    limit: Option<u32>,
    /// The previous page's `next_cursor`: the page after it.
    cursor: Option<String>,
}

/// A page of a list.
#[derive(Debug, Serialize, ToSchema)]
pub struct ListPage<T> {
    /// `list`.
    object: &'static str,
    /// The entries, most recently changed first, without their content.
    data: Vec<T>,
    /// Whether there is a page after this one.
    has_more: bool,
    /// Pass as `cursor` for the next page; `null` on the last page.
    next_cursor: Option<String>,
}

/// A page asked for: what to ask the store, and how many entries to answer with.
pub(super) struct Paging {
    /// One entry more than answered: whether it exists is `has_more`.
    pub(super) query: Page,
    limit: usize,
}

impl PageParams {
    pub(super) fn paging(&self) -> Result<Paging, ApiError> {
        let limit = self.limit.unwrap_or(DEFAULT_LIMIT);
        if !(1..=MAX_LIMIT).contains(&limit) {
            return Err(ApiError::invalid_param(
                "limit",
                format!("limit must be from 1 to {MAX_LIMIT} (got {limit})."),
            ));
        }
        let after = self.cursor.as_deref().map(parse_cursor).transpose()?;
        Ok(Paging {
            query: Page {
                after,
                limit: limit + 1,
            },
            limit: limit as usize,
        })
    }
}

impl Paging {
    /// The page of `rows` (as the store returned them for [`Paging::query`]), each
    /// shown by `view`; `place` is where a row stands in the list.
    pub(super) fn answer<R, T>(
        &self,
        mut rows: Vec<R>,
        place: impl Fn(&R) -> Cursor,
        view: impl FnMut(R) -> T,
    ) -> ListPage<T> {
        let has_more = rows.len() > self.limit;
        rows.truncate(self.limit);
        let next_cursor = rows.last().filter(|_| has_more).map(|row| {
            let cursor = place(row);
            format!("{}.{}", cursor.updated_at, cursor.id)
        });
        ListPage {
            object: "list",
            data: rows.into_iter().map(view).collect(),
            has_more,
            next_cursor,
        }
    }
}

/// A cursor as [`Paging::answer`] wrote it: `{updated_at}.{id}`.
fn parse_cursor(text: &str) -> Result<Cursor, ApiError> {
    let parsed = text.split_once('.').and_then(|(updated_at, id)| {
        Some(Cursor {
            updated_at: updated_at.parse().ok()?,
            id: id.parse().ok()?,
        })
    });
    parsed.ok_or_else(|| {
        ApiError::invalid_param(
            "cursor",
            "cursor must be the next_cursor of an earlier page of this list.",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::parse_cursor;
    use crate::store::workbench::Cursor;

    #[test]
    fn a_cursor_is_the_place_of_an_entry() {
        assert_eq!(
            parse_cursor("1800000000.42").unwrap(),
            Cursor {
                updated_at: 1_800_000_000,
                id: 42
            }
        );
        for bad in ["", "42", "a.b", "1.2.3", "1.", ".2"] {
            assert!(parse_cursor(bad).is_err(), "{bad}");
        }
    }
}
