//! What one key can keep in the store (issue #33, "storage per key"): the Workbench's
//! bytes per key (items, trees, nodes) and the request bytes of a key's pending jobs are
//! bounded, going over is a 4xx with nothing written; lists come a page at a time with
//! metadata only; a tree import is bounded and written in batches, so that another key's
//! write goes through while it runs. Small bounds keep the tests fast. The store's
//! accounting runs on both backends; the PostgreSQL instance is ignored by default, run
//! it with `TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/test cargo test --test it
//! abuse_storage:: -- --ignored`.

use std::sync::Arc;
use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};

use crate::common::{Gateway, MODEL, expect_error};
use crate::store::TestDb;
use crate::workbench::child;
use fleetgate::store::workbench::{ItemChange, NewItem, Page, ROW_BYTES, TreeNode};
use fleetgate::store::{LimitOverrides, Store, StoreError};

backend_tests! {
    store: [a_keys_bytes_are_counted_on_every_write_and_delete],
    url: [],
}

/// Some fixed moment, for the test clock.
const T0: i64 = 1_800_000_000;

/// A new key's id.
async fn new_key(store: &dyn Store) -> i64 {
    let secret = fleetgate::key_secret::generate();
    let limits = LimitOverrides::default();
    store
        .create_key("bytes", None, &secret, &limits)
        .await
        .unwrap()
        .id
}

/// A node of a tree being written: the root when `parent` is `None`.
fn node(parent: Option<usize>, text: &str) -> TreeNode<'_> {
    TreeNode {
        parent,
        text,
        meta: "{}",
        bookmarked: false,
        pruned: false,
    }
}

async fn a_keys_bytes_are_counted_on_every_write_and_delete(store: Arc<dyn Store>) {
    let (key, other) = (new_key(&*store).await, new_key(&*store).await);
    let wb = store.workbench();
    let bound = 10_000;
    // Bytes of UTF-8, not characters: "é" is two.
    let checkpoint = NewItem {
        kind: "run",
        title: "ab",
        content: r#"{"p":"é"}"#,
        expires_at: Some(T0 + 10),
    };
    let item = wb.create_item(key, &checkpoint, bound, T0).await.unwrap();
    assert_eq!(wb.stored_bytes(key).await.unwrap(), ROW_BYTES + 2 + 10);
    let grow = ItemChange {
        version: 1,
        title: Some("abcd"),
        content: None,
        save: false,
    };
    wb.update_item(key, item.id, &grow, bound, T0)
        .await
        .unwrap();
    assert_eq!(wb.stored_bytes(key).await.unwrap(), ROW_BYTES + 4 + 10);
    // Over the bound: refused whole.
    let big = format!(r#"{{"p":"{}"}}"#, "x".repeat(bound as usize));
    let over = NewItem {
        content: &big,
        expires_at: None,
        ..checkpoint
    };
    assert!(matches!(
        wb.create_item(key, &over, bound, T0).await,
        Err(StoreError::QuotaExceeded { limit: 10_000, .. })
    ));
    assert_eq!(wb.stored_bytes(key).await.unwrap(), ROW_BYTES + 14);
    // A tree: its title and every node's text and meta, and each row.
    let (tree, nodes) = wb
        .create_tree(
            key,
            "t",
            &[node(None, "abc"), node(Some(0), "de")],
            bound,
            T0,
        )
        .await
        .unwrap();
    let before_tree = ROW_BYTES + 14;
    let tree_bytes = (ROW_BYTES + 1) + (ROW_BYTES + 5) + (ROW_BYTES + 4);
    assert_eq!(
        wb.stored_bytes(key).await.unwrap(),
        before_tree + tree_bytes
    );
    wb.add_node(key, tree.id, &child(nodes[0].id, "fgh"), bound, T0)
        .await
        .unwrap();
    let with_tree = before_tree + tree_bytes + ROW_BYTES + 5;
    assert_eq!(wb.stored_bytes(key).await.unwrap(), with_tree);
    wb.rename_tree(key, tree.id, 1, "tree", T0).await.unwrap();
    assert_eq!(wb.stored_bytes(key).await.unwrap(), with_tree + 3);
    assert_eq!(wb.stored_bytes(other).await.unwrap(), 0);
    // A tree over the bound in its second batch (500 nodes of 106 bytes each): the
    // first is taken back.
    let texts: Vec<String> = (0..1_200).map(|i| format!("{:04}", i % 10_000)).collect();
    let chain: Vec<TreeNode<'_>> = texts
        .iter()
        .enumerate()
        .map(|(i, text)| node(i.checked_sub(1), text))
        .collect();
    assert!(matches!(
        wb.create_tree(key, "long", &chain, with_tree + 3 + 60_000, T0)
            .await,
        Err(StoreError::QuotaExceeded { .. })
    ));
    let every = Page {
        after: None,
        limit: 10,
    };
    assert_eq!(wb.trees(key, &every).await.unwrap().len(), 1);
    assert_eq!(wb.stored_bytes(key).await.unwrap(), with_tree + 3);
    // Deletes give the bytes back: a tree with its nodes, a checkpoint by the sweeper.
    assert!(wb.delete_tree(key, tree.id).await.unwrap());
    assert_eq!(wb.stored_bytes(key).await.unwrap(), before_tree);
    assert_eq!(wb.sweep_checkpoints(T0 + 10).await.unwrap(), 1);
    assert_eq!(wb.stored_bytes(key).await.unwrap(), 0);
}

/// The Workbench's byte bound per key in these tests.
const BOUND: &str = "[workbench]\nmax_bytes_per_key = 65536\nmax_import_nodes = 100\n";
/// Bounds everything a test waits for.
const WAIT: Duration = Duration::from_secs(30);

/// A run item holding `bytes` bytes of prompt.
fn run_of(bytes: usize) -> Value {
    json!({"kind": "run", "title": "big", "content": {"prompt": "x".repeat(bytes)}})
}

/// An export of a chain of `count` nodes, each with `text`.
fn chain(count: usize, text: &str) -> Value {
    let nodes: Vec<Value> = (0..count)
        .map(|i| json!({"id": i, "parent_id": i.checked_sub(1), "text": text}))
        .collect();
    json!({"format": "fleetgate-loom/1", "title": "chain", "nodes": nodes})
}

/// Every entry of a Workbench list, following `next_cursor` with pages of `limit`.
async fn every_page(gw: &Gateway, path: &str, limit: u32) -> Vec<Value> {
    let mut entries = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let query = match &cursor {
            Some(cursor) => format!("{path}?limit={limit}&cursor={cursor}"),
            None => format!("{path}?limit={limit}"),
        };
        let page = gw.workbench_json(Method::GET, &query, None, 200).await;
        let data = page["data"].as_array().expect("a page: {page}").clone();
        assert!(data.len() <= limit as usize, "{page}");
        entries.extend(data);
        match page["next_cursor"].as_str() {
            Some(next) => {
                assert_eq!(page["has_more"], true, "{page}");
                cursor = Some(next.to_owned());
            }
            None => return entries,
        }
    }
}

#[tokio::test]
async fn workbench_items_stop_at_the_keys_byte_bound() {
    let gw = Gateway::start_with(Default::default(), BOUND).await;
    let mut stored = 0;
    let refused = loop {
        let response = gw
            .workbench(Method::POST, &gw.key, "/items", Some(run_of(10_000)))
            .await;
        if response.status() != 201 {
            break response;
        }
        stored += 1;
        assert!(
            stored < 20,
            "{stored} items of 10 kB stored under a bound of 64 KiB"
        );
    };
    expect_error(refused, 413, "storage_quota_exceeded").await;
    assert_eq!(
        stored, 6,
        "six items of 10 kB fit in 64 KiB, the seventh does not"
    );
    // Nothing of the refused write was kept.
    assert_eq!(every_page(&gw, "/items", 100).await.len(), stored);
    // Growing an item over the bound is refused too, and leaves it as it was.
    let first = every_page(&gw, "/items", 100).await[0].clone();
    let grow = json!({"version": first["version"], "content": {"prompt": "x".repeat(20_000)}});
    let response = gw
        .workbench(
            Method::PATCH,
            &gw.key,
            &format!("/items/{}", first["id"]),
            Some(grow),
        )
        .await;
    expect_error(response, 413, "storage_quota_exceeded").await;
    let kept = gw
        .workbench_json(Method::GET, &format!("/items/{}", first["id"]), None, 200)
        .await;
    assert_eq!(kept["version"], first["version"]);
    // Another key is not affected, and deleting frees the room.
    let (_, other) = gw.create_key(Default::default()).await;
    let response = gw
        .workbench(Method::POST, &other, "/items", Some(run_of(10_000)))
        .await;
    assert_eq!(response.status(), 201);
    let response = gw
        .workbench(
            Method::DELETE,
            &gw.key,
            &format!("/items/{}", first["id"]),
            None,
        )
        .await;
    assert_eq!(response.status(), 204);
    let response = gw
        .workbench(Method::POST, &gw.key, "/items", Some(run_of(10_000)))
        .await;
    assert_eq!(response.status(), 201);
}

#[tokio::test]
async fn loom_nodes_count_against_the_same_bound() {
    let gw = Gateway::start_with(Default::default(), BOUND).await;
    let tree = gw
        .workbench_json(
            Method::POST,
            "/trees",
            Some(json!({"title": "t", "root_text": "Once"})),
            201,
        )
        .await;
    let id = tree["tree"]["id"].as_i64().unwrap();
    let root = tree["nodes"][0]["id"].as_i64().unwrap();
    let mut added = 0;
    let refused = loop {
        let node = json!({"parent_id": root, "text": "y".repeat(10_000)});
        let response = gw
            .workbench(
                Method::POST,
                &gw.key,
                &format!("/trees/{id}/nodes"),
                Some(node),
            )
            .await;
        if response.status() != 201 {
            break response;
        }
        added += 1;
        assert!(
            added < 20,
            "{added} nodes of 10 kB added under a bound of 64 KiB"
        );
    };
    expect_error(refused, 413, "storage_quota_exceeded").await;
    let tree = gw
        .workbench_json(Method::GET, &format!("/trees/{id}"), None, 200)
        .await;
    assert_eq!(tree["nodes"].as_array().unwrap().len(), added + 1);
    // Deleting the tree frees what its nodes took.
    let response = gw
        .workbench(Method::DELETE, &gw.key, &format!("/trees/{id}"), None)
        .await;
    assert_eq!(response.status(), 204);
    let response = gw
        .workbench(Method::POST, &gw.key, "/items", Some(run_of(60_000)))
        .await;
    assert_eq!(response.status(), 201);
}

#[tokio::test]
async fn a_tree_import_over_its_bounds_writes_nothing() {
    let gw = Gateway::start_with(Default::default(), BOUND).await;
    // Over `max_import_nodes`.
    let response = gw
        .workbench(
            Method::POST,
            &gw.key,
            "/trees/import",
            Some(chain(101, "a")),
        )
        .await;
    expect_error(response, 413, "request_too_large").await;
    // Within the node bound, over the key's bytes.
    let response = gw
        .workbench(
            Method::POST,
            &gw.key,
            "/trees/import",
            Some(chain(50, &"b".repeat(2_000))),
        )
        .await;
    expect_error(response, 413, "storage_quota_exceeded").await;
    assert!(every_page(&gw, "/trees", 100).await.is_empty());
    // Within both: written whole.
    let tree = gw
        .workbench_json(Method::POST, "/trees/import", Some(chain(100, "c")), 201)
        .await;
    assert_eq!(tree["nodes"].as_array().unwrap().len(), 100);
}

#[tokio::test]
async fn workbench_lists_are_paged_and_carry_no_content() {
    let gw = Gateway::start().await;
    for i in 0..5 {
        let item = json!({"kind": "prompt", "title": format!("p{i}"), "content": {"prompt": "secret text"}});
        gw.workbench_json(Method::POST, "/items", Some(item), 201)
            .await;
        let tree = json!({"title": format!("t{i}"), "root_text": "Once"});
        gw.workbench_json(Method::POST, "/trees", Some(tree), 201)
            .await;
    }
    let first = gw
        .workbench_json(Method::GET, "/items?limit=2", None, 200)
        .await;
    assert_eq!(first["object"], "list", "{first}");
    assert_eq!(first["data"].as_array().unwrap().len(), 2);
    assert_eq!(first["has_more"], true);
    let items = every_page(&gw, "/items", 2).await;
    let titles: Vec<&str> = items.iter().map(|i| i["title"].as_str().unwrap()).collect();
    assert_eq!(
        titles,
        ["p4", "p3", "p2", "p1", "p0"],
        "newest first, each once"
    );
    assert!(
        items.iter().all(|i| i.get("content").is_none()),
        "a list carries no content: {items:?}"
    );
    // Content is fetched per item.
    let one = gw
        .workbench_json(
            Method::GET,
            &format!("/items/{}", items[0]["id"]),
            None,
            200,
        )
        .await;
    assert_eq!(one["content"]["prompt"], "secret text");
    let trees = every_page(&gw, "/trees", 2).await;
    let titles: Vec<&str> = trees.iter().map(|t| t["title"].as_str().unwrap()).collect();
    assert_eq!(titles, ["t4", "t3", "t2", "t1", "t0"]);
    for bad in [
        "/items?limit=0",
        "/items?limit=101",
        "/trees?cursor=nonsense",
    ] {
        let response = gw.workbench(Method::GET, &gw.key, bad, None).await;
        expect_error(response, 400, "invalid_request").await;
    }
}

#[tokio::test]
async fn the_jobs_list_carries_no_results() {
    let gw = Gateway::start().await;
    let body = json!({"model": MODEL, "prompt": "Once upon", "max_tokens": 4}).to_string();
    let response = gw
        .complete(&body)
        .header("prefer", "respond-async")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
    let id = response.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let job = gw.get_json(&format!("/v1/harvest/{id}?wait=20")).await;
    assert_eq!(job["status"], "succeeded", "{job}");
    assert!(
        job["result"].is_object(),
        "harvesting one job gives its result"
    );
    let list = gw.get_json("/v1/harvest").await;
    let listed = &list["data"][0];
    assert_eq!(listed["id"], id.as_str());
    assert_eq!(listed["status"], "succeeded");
    assert!(
        listed.get("result").is_none(),
        "a list carries no result: {listed}"
    );
}

#[tokio::test]
async fn a_keys_pending_jobs_stop_at_their_request_bytes() {
    let gw = Gateway::start_with(
        Default::default(),
        "[jobs]\nworkers = 0\nmax_pending_bytes_per_key = 65536\n",
    )
    .await;
    let body = json!({"model": MODEL, "prompt": "hi ".repeat(6_000), "max_tokens": 4}).to_string();
    let mut ids = Vec::new();
    let refused = loop {
        let response = gw
            .complete(&body)
            .header("prefer", "respond-async")
            .send()
            .await
            .unwrap();
        if response.status() != 202 {
            break response;
        }
        ids.push(
            response.json::<Value>().await.unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
        assert!(
            ids.len() < 10,
            "{} jobs of 18 kB queued under a bound of 64 KiB",
            ids.len()
        );
    };
    let error = expect_error(refused, 429, "queue_full").await;
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("bytes"),
        "{error}"
    );
    assert_eq!(
        ids.len(),
        3,
        "three requests of 18 kB fit in 64 KiB, the fourth does not"
    );
    // A job that ended no longer counts.
    let response = gw
        .client
        .delete(format!("{}/v1/harvest/{}", gw.url, ids[0]))
        .bearer_auth(&gw.key)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let response = gw
        .complete(&body)
        .header("prefer", "respond-async")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
}

#[tokio::test]
async fn another_keys_write_goes_through_while_a_large_import_is_written() {
    // The default bound on an import is 10,000 nodes.
    let gw = Gateway::start().await;
    let (_, other) = gw.create_key(Default::default()).await;
    let import = {
        let (client, url, key) = (gw.client.clone(), gw.url.clone(), gw.key.clone());
        tokio::spawn(async move {
            client
                .post(format!("{url}/v1/workbench/trees/import"))
                .bearer_auth(key)
                .json(&chain(10_000, "some text of a node"))
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    // Watch the tree appear: written in batches, it shows part of its nodes first.
    let partial = tokio::time::timeout(WAIT, async {
        loop {
            let trees = gw.workbench_json(Method::GET, "/trees", None, 200).await;
            let listed = trees.get("data").unwrap_or(&trees);
            if let Some(tree) = listed.as_array().and_then(|t| t.first()) {
                let tree = gw
                    .workbench_json(Method::GET, &format!("/trees/{}", tree["id"]), None, 200)
                    .await;
                break tree["nodes"].as_array().unwrap().len();
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the import's tree never showed up");
    assert!(
        partial < 10_000,
        "the import was written in one transaction: its tree first showed up whole"
    );
    // Meanwhile another key writes, and is not kept waiting for the whole import.
    let response = gw
        .workbench(Method::POST, &other, "/items", Some(run_of(100)))
        .await;
    assert_eq!(response.status(), 201);
    assert!(
        !import.is_finished(),
        "the other key's write waited for the import"
    );
    assert_eq!(
        tokio::time::timeout(WAIT, import).await.unwrap().unwrap(),
        201
    );
}
