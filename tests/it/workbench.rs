//! The Workbench's and Loom's storage rules, on the store (both backends, with a test
//! clock: every time is passed in) and over HTTP (SQLite): another key sees nothing
//! (404), a change from a stale version is 409, recovery checkpoints expire after seven
//! days while saved items stay, a tree survives export and import, and a run the budget
//! would clamp is refused when the page asks for that. The PostgreSQL instances are
//! ignored by default; run them with
//! `TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/test cargo test --test it workbench:: -- --ignored`.

use std::sync::Arc;

use reqwest::Method;
use serde_json::{Value, json};

use crate::common::{Gateway, MODEL, expect_error};
use crate::store::TestDb;
use fleetgate::store::workbench::{
    Added, ItemChange, NewItem, NewNode, NodeFlags, Page, TreeNode, Versioned,
};
use fleetgate::store::{LimitOverrides, Store, StoreError};

/// The checkpoint lifetime the API reference promises.
const SEVEN_DAYS: i64 = 7 * 24 * 3600;
/// Some fixed moment, for the test clock.
const T0: i64 = 1_800_000_000;
/// No bound on a key's bytes (`abuse_storage` tests the bound).
const NO_BOUND: i64 = i64::MAX;
/// A first page long enough for every list here.
const EVERY: Page = Page {
    after: None,
    limit: 100,
};

backend_tests! {
    store: [
        checkpoints_expire_after_seven_days_and_saved_items_stay,
        another_key_sees_nothing,
        a_change_from_a_stale_version_is_refused,
        two_tabs_adding_nodes_lose_none,
        a_tree_keeps_its_shape_and_flags,
    ],
    url: [],
}

/// A new key's id.
async fn key(store: &dyn Store) -> i64 {
    store
        .create_key(
            "workbench",
            None,
            &fleetgate::key_secret::generate(),
            &LimitOverrides::default(),
        )
        .await
        .unwrap()
        .id
}

fn run(title: &str, expires_at: Option<i64>) -> NewItem<'_> {
    NewItem {
        kind: "run",
        title,
        content: r#"{"prompt":"Once upon a time"}"#,
        expires_at,
    }
}

/// A child of `parent_id` with `text` and no meta.
pub(crate) fn child(parent_id: i64, text: &str) -> NewNode<'_> {
    NewNode {
        parent_id,
        text,
        meta: "{}",
    }
}

fn root(text: &str) -> TreeNode<'_> {
    TreeNode {
        parent: None,
        text,
        meta: "{}",
        bookmarked: false,
        pruned: false,
    }
}

async fn checkpoints_expire_after_seven_days_and_saved_items_stay(store: Arc<dyn Store>) {
    let key = key(store.as_ref()).await;
    let wb = store.workbench();
    let checkpoint = wb
        .create_item(key, &run("unsaved", Some(T0 + SEVEN_DAYS)), NO_BOUND, T0)
        .await
        .unwrap();
    let rescued = wb
        .create_item(
            key,
            &run("saved later", Some(T0 + SEVEN_DAYS)),
            NO_BOUND,
            T0,
        )
        .await
        .unwrap();
    let saved = wb
        .create_item(key, &run("saved", None), NO_BOUND, T0)
        .await
        .unwrap();
    let save = ItemChange {
        version: 1,
        title: None,
        content: None,
        save: true,
    };
    let Versioned::Changed(rescued) = wb
        .update_item(key, rescued.id, &save, NO_BOUND, T0 + SEVEN_DAYS - 10)
        .await
        .unwrap()
    else {
        panic!("saving a live checkpoint")
    };
    assert_eq!(rescued.expires_at, None);

    let just_before = T0 + SEVEN_DAYS - 1;
    assert!(
        wb.item(key, checkpoint.id, just_before)
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(wb.sweep_checkpoints(just_before).await.unwrap(), 0);
    assert_eq!(wb.items(key, just_before, &EVERY).await.unwrap().len(), 3);

    // From the seventh day on the checkpoint is gone, even before a sweep deletes it.
    let expired = T0 + SEVEN_DAYS;
    assert_eq!(wb.item(key, checkpoint.id, expired).await.unwrap(), None);
    let titles: Vec<String> = wb
        .items(key, expired, &EVERY)
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.title)
        .collect();
    assert_eq!(titles, ["saved later", "saved"]);
    let change = ItemChange {
        version: 1,
        title: Some("too late"),
        content: None,
        save: true,
    };
    assert_eq!(
        wb.update_item(key, checkpoint.id, &change, NO_BOUND, expired)
            .await
            .unwrap(),
        Versioned::Missing
    );
    assert_eq!(wb.sweep_checkpoints(expired).await.unwrap(), 1);
    // A year on, the saved items are still there.
    let year = T0 + 365 * 24 * 3600;
    assert_eq!(wb.sweep_checkpoints(year).await.unwrap(), 0);
    assert!(wb.item(key, saved.id, year).await.unwrap().is_some());
    assert!(wb.item(key, rescued.id, year).await.unwrap().is_some());
}

async fn another_key_sees_nothing(store: Arc<dyn Store>) {
    let owner = key(store.as_ref()).await;
    let other = key(store.as_ref()).await;
    let wb = store.workbench();
    let item = wb
        .create_item(owner, &run("mine", None), NO_BOUND, T0)
        .await
        .unwrap();
    let (tree, nodes) = wb
        .create_tree(owner, "my tree", &[root("It was")], NO_BOUND, T0)
        .await
        .unwrap();
    let root_id = nodes[0].id;

    assert_eq!(wb.item(other, item.id, T0).await.unwrap(), None);
    assert!(wb.items(other, T0, &EVERY).await.unwrap().is_empty());
    let change = ItemChange {
        version: 1,
        title: Some("theirs"),
        content: None,
        save: false,
    };
    assert_eq!(
        wb.update_item(other, item.id, &change, NO_BOUND, T0)
            .await
            .unwrap(),
        Versioned::Missing
    );
    assert!(!wb.delete_item(other, item.id, T0).await.unwrap());
    assert_eq!(wb.tree(other, tree.id).await.unwrap(), None);
    assert!(wb.trees(other, &EVERY).await.unwrap().is_empty());
    assert_eq!(
        wb.add_node(other, tree.id, &child(root_id, " a dark"), NO_BOUND, T0)
            .await
            .unwrap(),
        Added::NoTree
    );
    let flags = NodeFlags {
        version: 1,
        bookmarked: Some(true),
        pruned: None,
    };
    assert_eq!(
        wb.set_node_flags(other, tree.id, root_id, &flags, T0)
            .await
            .unwrap(),
        Versioned::Missing
    );
    assert_eq!(
        wb.rename_tree(other, tree.id, 1, "theirs", T0)
            .await
            .unwrap(),
        Versioned::Missing
    );
    assert!(!wb.delete_tree(other, tree.id).await.unwrap());

    // The owner's records are untouched.
    let (kept, kept_nodes) = wb.tree(owner, tree.id).await.unwrap().unwrap();
    assert_eq!(kept.title, "my tree");
    assert_eq!(kept_nodes.len(), 1);
    assert!(!kept_nodes[0].bookmarked);
    assert_eq!(
        wb.item(owner, item.id, T0).await.unwrap().unwrap().title,
        "mine"
    );
}

async fn a_change_from_a_stale_version_is_refused(store: Arc<dyn Store>) {
    let key = key(store.as_ref()).await;
    let wb = store.workbench();
    let item = wb
        .create_item(key, &run("draft", None), NO_BOUND, T0)
        .await
        .unwrap();
    let from_v1 = |title| ItemChange {
        version: 1,
        title: Some(title),
        content: None,
        save: false,
    };
    let Versioned::Changed(first) = wb
        .update_item(key, item.id, &from_v1("tab one"), NO_BOUND, T0 + 1)
        .await
        .unwrap()
    else {
        panic!("the first change from version 1")
    };
    assert_eq!(first.version, 2);
    assert_eq!(
        wb.update_item(key, item.id, &from_v1("tab two"), NO_BOUND, T0 + 2)
            .await
            .unwrap(),
        Versioned::Stale { current: 2 }
    );
    assert_eq!(
        wb.item(key, item.id, T0 + 3).await.unwrap().unwrap().title,
        "tab one"
    );

    let (tree, nodes) = wb
        .create_tree(key, "t", &[root("Root")], NO_BOUND, T0)
        .await
        .unwrap();
    let node = nodes[0].id;
    let bookmark = NodeFlags {
        version: 1,
        bookmarked: Some(true),
        pruned: None,
    };
    let prune = NodeFlags {
        version: 1,
        bookmarked: None,
        pruned: Some(true),
    };
    let Versioned::Changed(bookmarked) = wb
        .set_node_flags(key, tree.id, node, &bookmark, T0)
        .await
        .unwrap()
    else {
        panic!("bookmarking from version 1")
    };
    assert_eq!((bookmarked.version, bookmarked.bookmarked), (2, true));
    assert_eq!(
        wb.set_node_flags(key, tree.id, node, &prune, T0)
            .await
            .unwrap(),
        Versioned::Stale { current: 2 }
    );
    let Versioned::Changed(renamed) = wb
        .rename_tree(key, tree.id, 1, "renamed", T0)
        .await
        .unwrap()
    else {
        panic!("renaming from version 1")
    };
    assert_eq!((renamed.title.as_str(), renamed.version), ("renamed", 2));
    assert_eq!(
        wb.rename_tree(key, tree.id, 1, "again", T0).await.unwrap(),
        Versioned::Stale { current: 2 }
    );
}

async fn two_tabs_adding_nodes_lose_none(store: Arc<dyn Store>) {
    let key = key(store.as_ref()).await;
    let wb = store.workbench();
    let (tree, nodes) = wb
        .create_tree(key, "shared", &[root("Root")], NO_BOUND, T0)
        .await
        .unwrap();
    let parent = nodes[0].id;
    let tab = |name: &'static str| {
        let store = Arc::clone(&store);
        async move {
            for i in 0..10 {
                let text = format!("{name} {i}");
                let added = store
                    .workbench()
                    .add_node(key, tree.id, &child(parent, &text), NO_BOUND, T0)
                    .await
                    .unwrap();
                assert!(matches!(added, Added::Node(_)), "{added:?}");
            }
        }
    };
    tokio::join!(tab("one"), tab("two"));
    let (_, nodes) = wb.tree(key, tree.id).await.unwrap().unwrap();
    assert_eq!(nodes.len(), 21);
    for name in ["one", "two"] {
        for i in 0..10 {
            let text = format!("{name} {i}");
            assert!(nodes.iter().any(|n| n.text == text), "{text} is kept");
        }
    }
    // A parent from another tree is refused.
    let (_, other_nodes) = wb
        .create_tree(key, "other", &[root("Other")], NO_BOUND, T0)
        .await
        .unwrap();
    assert_eq!(
        wb.add_node(key, tree.id, &child(other_nodes[0].id, "x"), NO_BOUND, T0)
            .await
            .unwrap(),
        Added::NoParent
    );
}

async fn a_tree_keeps_its_shape_and_flags(store: Arc<dyn Store>) {
    let key = key(store.as_ref()).await;
    let wb = store.workbench();
    let nodes = [
        root("The"),
        TreeNode {
            parent: Some(0),
            text: " cat",
            meta: r#"{"tokens":[{"t":" cat","lp":-0.5}]}"#,
            bookmarked: true,
            pruned: false,
        },
        TreeNode {
            parent: Some(0),
            text: " dog",
            meta: "{}",
            bookmarked: false,
            pruned: true,
        },
        TreeNode {
            parent: Some(1),
            text: " sat",
            meta: "{}",
            bookmarked: false,
            pruned: false,
        },
    ];
    let (tree, written) = wb
        .create_tree(key, "cats", &nodes, NO_BOUND, T0)
        .await
        .unwrap();
    let (read_tree, read) = wb.tree(key, tree.id).await.unwrap().unwrap();
    assert_eq!(read_tree, tree);
    assert_eq!(read, written);
    assert_eq!(read[0].parent_id, None);
    assert_eq!(read[1].parent_id, Some(read[0].id));
    assert_eq!(read[2].parent_id, Some(read[0].id));
    assert_eq!(read[3].parent_id, Some(read[1].id));
    assert_eq!(
        (read[1].bookmarked, read[2].pruned, read[3].text.as_str()),
        (true, true, " sat")
    );
    assert_eq!(read[1].meta, r#"{"tokens":[{"t":" cat","lp":-0.5}]}"#);

    let orphan = TreeNode {
        parent: Some(5),
        ..root("x")
    };
    assert!(matches!(
        wb.create_tree(key, "bad", &[root("r"), orphan], NO_BOUND, T0)
            .await,
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(
        wb.create_tree(key, "bad", &[], NO_BOUND, T0).await,
        Err(StoreError::Invalid(_))
    ));
    assert_eq!(
        wb.trees(key, &EVERY).await.unwrap().len(),
        1,
        "nothing half-written"
    );
    assert!(wb.delete_tree(key, tree.id).await.unwrap());
    assert_eq!(wb.tree(key, tree.id).await.unwrap(), None);
}

// ---------------------------------------------------------------------------------------
// Over HTTP
// ---------------------------------------------------------------------------------------

impl Gateway {
    /// The answer to a request to the Workbench API as `key`, with a JSON body when one
    /// is given.
    pub(crate) async fn workbench(
        &self,
        method: reqwest::Method,
        key: &str,
        path: &str,
        body: Option<Value>,
    ) -> reqwest::Response {
        let request = self
            .client
            .request(method, format!("{}/v1/workbench{path}", self.url))
            .bearer_auth(key);
        match body {
            Some(body) => request.json(&body),
            None => request,
        }
        .send()
        .await
        .unwrap()
    }

    /// The JSON of a Workbench API answer with `status`.
    pub(crate) async fn workbench_json(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        status: u16,
    ) -> Value {
        let response = self.workbench(method, &self.key.clone(), path, body).await;
        assert_eq!(response.status().as_u16(), status, "{path}");
        response.json().await.unwrap()
    }
}

/// A tree `The` → ` cat` (bookmarked) → ` sat`, and ` dog` (pruned) beside ` cat`:
/// its id.
async fn grown_tree(gw: &Gateway) -> i64 {
    let tree = gw
        .workbench_json(
            Method::POST,
            "/trees",
            Some(json!({"title": "cats", "root_text": "The"})),
            201,
        )
        .await;
    let id = tree["tree"]["id"].as_i64().unwrap();
    let root = tree["nodes"][0]["id"].as_i64().unwrap();
    let cat = add_node(gw, id, root, " cat").await;
    let dog = add_node(gw, id, root, " dog").await;
    add_node(gw, id, cat["id"].as_i64().unwrap(), " sat").await;
    for (node, flag) in [(&cat, "bookmarked"), (&dog, "pruned")] {
        gw.workbench_json(
            Method::PATCH,
            &format!("/trees/{id}/nodes/{}", node["id"]),
            Some(json!({"version": 1, flag: true})),
            200,
        )
        .await;
    }
    id
}

/// Adds a child of `parent` whose meta gives its one token a probability of 0.84.
async fn add_node(gw: &Gateway, tree: i64, parent: i64, text: &str) -> Value {
    let meta = json!({"tokens": [{"t": text, "lp": -0.25}]});
    gw.workbench_json(
        Method::POST,
        &format!("/trees/{tree}/nodes"),
        Some(json!({"parent_id": parent, "text": text, "meta": meta})),
        201,
    )
    .await
}

#[tokio::test]
async fn another_key_gets_404_for_every_record_and_route() {
    let gw = Gateway::start().await;
    let tree = grown_tree(&gw).await;
    let item = gw
        .workbench_json(
            Method::POST,
            "/items",
            Some(json!({"kind": "prompt", "title": "p", "content": {"prompt": "Hi"}})),
            201,
        )
        .await["id"]
        .clone();
    let (_, other) = gw.create_key(LimitOverrides::default()).await;
    let attempts = [
        (Method::GET, format!("/trees/{tree}"), None),
        (Method::GET, format!("/trees/{tree}/export"), None),
        (
            Method::PATCH,
            format!("/trees/{tree}"),
            Some(json!({"version": 1, "title": "x"})),
        ),
        (
            Method::POST,
            format!("/trees/{tree}/nodes"),
            Some(json!({"parent_id": 1, "text": "x"})),
        ),
        (
            Method::PATCH,
            format!("/trees/{tree}/nodes/1"),
            Some(json!({"version": 1, "pruned": true})),
        ),
        (Method::DELETE, format!("/trees/{tree}"), None),
        (Method::GET, format!("/items/{item}"), None),
        (
            Method::PATCH,
            format!("/items/{item}"),
            Some(json!({"version": 1, "title": "x"})),
        ),
        (Method::DELETE, format!("/items/{item}"), None),
    ];
    for (method, path, body) in attempts {
        let response = gw.workbench(method.clone(), &other, &path, body).await;
        let body = expect_error(response, 404, "not_found").await;
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("No "),
            "{method} {path}: {body}"
        );
    }
    let lists = [("/trees", "trees"), ("/items", "items")];
    for (path, what) in lists {
        let response = gw.workbench(Method::GET, &other, path, None).await;
        assert_eq!(response.status(), 200);
        let list: Value = response.json().await.unwrap();
        assert_eq!(list["data"], json!([]), "the other key lists no {what}");
    }
    // Still all there for the owner.
    let view = gw
        .workbench_json(Method::GET, &format!("/trees/{tree}"), None, 200)
        .await;
    assert_eq!(view["nodes"].as_array().unwrap().len(), 4);
}

#[tokio::test]
async fn a_stale_version_is_409_in_the_envelope_and_changes_nothing() {
    let gw = Gateway::start().await;
    let tree = grown_tree(&gw).await;
    let view = gw
        .workbench_json(Method::GET, &format!("/trees/{tree}"), None, 200)
        .await;
    // ` cat` was bookmarked from version 1; a second tab still holds version 1.
    let cat = &view["nodes"][1];
    assert_eq!(
        (cat["text"].as_str(), cat["version"].as_i64()),
        (Some(" cat"), Some(2))
    );
    let response = gw
        .workbench(
            Method::PATCH,
            &gw.key,
            &format!("/trees/{tree}/nodes/{}", cat["id"]),
            Some(json!({"version": 1, "bookmarked": false})),
        )
        .await;
    let body = expect_error(response, 409, "version_conflict").await;
    assert_eq!(body["error"]["param"], "version");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("is at version 2, not 1"),
        "{body}"
    );
    let after = gw
        .workbench_json(Method::GET, &format!("/trees/{tree}"), None, 200)
        .await;
    assert_eq!(after["nodes"][1]["bookmarked"], true);
}

#[tokio::test]
async fn an_exported_tree_imports_back_whole() {
    let gw = Gateway::start().await;
    let tree = grown_tree(&gw).await;
    let export = gw
        .workbench_json(Method::GET, &format!("/trees/{tree}/export"), None, 200)
        .await;
    assert_eq!(export["format"], "fleetgate-loom/1");
    let imported = gw
        .workbench_json(Method::POST, "/trees/import", Some(export.clone()), 201)
        .await;
    let new_id = imported["tree"]["id"].as_i64().unwrap();
    assert_ne!(new_id, tree);
    let again = gw
        .workbench_json(Method::GET, &format!("/trees/{new_id}/export"), None, 200)
        .await;
    assert_eq!(shape(&again), shape(&export));
    assert_eq!(
        gw.workbench_json(Method::GET, "/trees", None, 200).await["data"]
            .as_array()
            .unwrap()
            .len(),
        2
    );

    // Not an export: refused, nothing imported.
    let mut orphan = export.clone();
    orphan["nodes"][3]["parent_id"] = json!(999_999);
    let mut wrong_format = export;
    wrong_format["format"] = json!("tapestry");
    for bad in [orphan, wrong_format, json!({"title": "x"})] {
        let response = gw
            .workbench(Method::POST, &gw.key, "/trees/import", Some(bad))
            .await;
        expect_error(response, 400, "invalid_request").await;
    }
    assert_eq!(
        gw.workbench_json(Method::GET, "/trees", None, 200).await["data"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
}

/// An export without its ids: each node's text, flags, meta and its parent's index.
fn shape(export: &Value) -> Vec<Value> {
    let nodes = export["nodes"].as_array().unwrap();
    let index = |id: &Value| nodes.iter().position(|n| &n["id"] == id);
    nodes
        .iter()
        .map(|n| {
            json!([
                n["text"],
                n["meta"],
                n["bookmarked"],
                n["pruned"],
                index(&n["parent_id"])
            ])
        })
        .collect()
}

/// A gateway whose `[workbench]` section is `settings`.
async fn with_workbench(settings: &str) -> Gateway {
    Gateway::start_with(
        mock_vllm::MockConfig::default(),
        &format!("[workbench]\n{settings}\n"),
    )
    .await
}

#[tokio::test]
async fn a_checkpoint_lives_as_long_as_configured_and_a_saved_item_stays() {
    // A lifetime of 0 s: a checkpoint has expired as soon as it is written.
    let gw = with_workbench("checkpoint_ttl_secs = 0").await;
    let checkpoint = gw
        .workbench_json(
            Method::POST,
            "/items",
            Some(json!({"kind": "run", "content": {"prompt": "a"}, "checkpoint": true})),
            201,
        )
        .await;
    assert!(checkpoint["expires_at"].is_i64());
    let response = gw
        .workbench(
            Method::GET,
            &gw.key,
            &format!("/items/{}", checkpoint["id"]),
            None,
        )
        .await;
    expect_error(response, 404, "not_found").await;

    let saved = gw
        .workbench_json(
            Method::POST,
            "/items",
            Some(json!({"kind": "run", "title": "keep", "content": {"prompt": "b"}})),
            201,
        )
        .await;
    assert_eq!(saved["expires_at"], Value::Null);
    let list = &gw.workbench_json(Method::GET, "/items", None, 200).await["data"];
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(list[0]["title"], "keep");
    let kept = gw
        .workbench_json(Method::GET, &format!("/items/{}", list[0]["id"]), None, 200)
        .await;
    assert_eq!(kept["content"], json!({"prompt": "b"}));
}

#[tokio::test]
async fn bad_workbench_input_is_a_clear_400() {
    let gw = Gateway::start().await;
    let cases = [
        ("/items", json!({"kind": "poem", "content": {}})),
        ("/items", json!({"kind": "run", "content": {}, "extra": 1})),
        (
            "/items",
            json!({"kind": "run", "content": {}, "title": "x".repeat(201)}),
        ),
        ("/trees", json!({"title": "no root"})),
        ("/trees", json!({"root_text": "nul \u{0000} inside"})),
    ];
    for (path, body) in cases {
        let response = gw
            .workbench(Method::POST, &gw.key, path, Some(body.clone()))
            .await;
        expect_error(response, 400, "invalid_request").await;
    }
    let tree = grown_tree(&gw).await;
    let response = gw
        .workbench(
            Method::POST,
            &gw.key,
            &format!("/trees/{tree}/nodes"),
            Some(json!({"parent_id": 999_999, "text": "x"})),
        )
        .await;
    let body = expect_error(response, 400, "invalid_request").await;
    assert_eq!(body["error"]["param"], "parent_id");
    let response = gw
        .workbench(Method::GET, &gw.key, "/trees/not-a-number", None)
        .await;
    expect_error(response, 400, "invalid_request").await;
}

/// What the Workbench and Loom send: a budget clamp is refused, not applied.
#[tokio::test]
async fn a_run_the_budget_would_clamp_is_refused_with_what_is_left_and_needed() {
    let gw = Gateway::start().await;
    let (_, key) = gw
        .create_key(LimitOverrides {
            monthly_budget: Some(100),
            ..LimitOverrides::default()
        })
        .await;
    let body = json!({"model": MODEL, "prompt": (1..=10).collect::<Vec<u32>>(), "max_tokens": 200})
        .to_string();
    let response = with_clamp(&gw, &key, &body, "refuse").await;
    assert_eq!(response.headers().get("x-acs-max-tokens-clamped"), None);
    let refused = expect_error(response, 429, "budget_exceeded").await;
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("has 100 left") && message.contains("the 210 this request needs"),
        "{message}"
    );
    assert!(gw.upstream_completions().is_empty(), "nothing ran");
    let usage = gw.usage(&key).await;
    assert_eq!(
        (usage["used"].as_u64(), usage["reserved"].as_u64()),
        (Some(0), Some(0))
    );

    // A run that fits runs; without the header the API clamps as before.
    let fits = json!({"model": MODEL, "prompt": (1..=10).collect::<Vec<u32>>(), "max_tokens": 20})
        .to_string();
    let response = with_clamp(&gw, &key, &fits, "refuse").await;
    assert_eq!(response.status(), 200);
    let response = gw.complete_as(&key, &body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.headers().contains_key("x-acs-max-tokens-clamped"));

    let response = with_clamp(&gw, &key, &fits, "sometimes").await;
    expect_error(response, 400, "invalid_request").await;
}

/// A completion sent with `X-Acs-Budget-Clamp: {clamp}`.
async fn with_clamp(gw: &Gateway, key: &str, body: &str, clamp: &str) -> reqwest::Response {
    gw.complete_as(key, body)
        .header("x-acs-budget-clamp", clamp)
        .send()
        .await
        .unwrap()
}

/// `GET path` with no key.
async fn without_key(gw: &Gateway, path: &str) -> reqwest::Response {
    gw.client
        .get(format!("{}{path}", gw.url))
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn the_pages_are_served_without_a_key_and_load_nothing_from_elsewhere() {
    let gw = Gateway::start().await;
    for page in ["/workbench", "/loom"] {
        let response = without_key(&gw, page).await;
        assert_eq!(response.status(), 200, "{page}");
        assert!(
            response.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/html")
        );
        let csp = response.headers()["content-security-policy"]
            .to_str()
            .unwrap()
            .to_owned();
        assert!(
            csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"),
            "{csp}"
        );
        let html = response.text().await.unwrap();
        let assets = html
            .split("\"/workbench/assets/")
            .skip(1)
            .map(|rest| rest.split('"').next().unwrap().to_owned())
            .collect::<Vec<_>>();
        assert!(!assets.is_empty(), "{page} uses its embedded assets");
        for asset in &assets {
            let response = without_key(&gw, &format!("/workbench/assets/{asset}")).await;
            assert_eq!(response.status(), 200, "{asset}");
            let text = response.text().await.unwrap();
            assert!(
                !text.contains("http://") && !text.contains("https://"),
                "{asset} names no other origin"
            );
        }
        assert!(!html.contains("http://") && !html.contains("https://"));
    }
    let response = without_key(&gw, "/workbench/assets/secret.txt").await;
    expect_error(response, 404, "not_found").await;
}

#[tokio::test]
async fn the_sweeper_deletes_expired_checkpoints_and_keeps_saved_items() {
    // Expiring two seconds on (whole seconds: at least one second after it is made), so a
    // sweep (one a second) never takes the checkpoint before the first read below.
    let gw = with_workbench("checkpoint_ttl_secs = 2\ncheckpoint_sweep_secs = 1").await;
    let (key_id, key) = gw.create_key(LimitOverrides::default()).await;
    for body in [
        json!({"kind": "run", "content": {}, "checkpoint": true}),
        json!({"kind": "run", "title": "kept", "content": {}}),
    ] {
        let response = gw.workbench(Method::POST, &key, "/items", Some(body)).await;
        assert_eq!(response.status(), 201);
    }
    // Read at time 0, every row is live: what is left is what the sweeper has not deleted.
    let rows = || gw.state.store().workbench().items(key_id, 0, &EVERY);
    assert_eq!(
        rows().await.unwrap().len(),
        2,
        "the expired checkpoint is still a row"
    );
    let swept = async {
        while rows().await.unwrap().len() > 1 {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), swept)
        .await
        .expect("a sweep within 10 s (one per second)");
    let kept = rows().await.unwrap();
    assert_eq!(kept[0].title, "kept");
}
