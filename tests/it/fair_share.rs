//! The fleet queue's order (`fleet.queue_order`): with every node full, the next free
//! slot goes to the key served least for its share, so a light key's requests do not
//! wait behind a heavy key's backlog; `arrival` serves first come, first served.
//!
//! One node with room for one request: the first request holds it behind the node's
//! closed gate while the others line up, then the gate opens and the node runs them one
//! at a time, so the order the node received them in is the order they were served.

use std::time::{Duration, Instant};

use crate::common::{Gateway, node};
use fleetgate::store::LimitOverrides;
use mock_vllm::MockConfig;
use tokio::task::JoinHandle;

const HEAVY: &str = r#"{"model":"llama-8b","prompt":[1,2,3],"max_tokens":4}"#;
const LIGHT: &str = r#"{"model":"llama-8b","prompt":[7,7,7],"max_tokens":4}"#;

/// A gateway in front of one node that runs one request at a time, its fleet queue in
/// `order`, and two keys with room to queue: (gateway, heavy key, light key).
async fn one_slot(order: &str) -> (Gateway, String, String) {
    let mock = node(MockConfig::default()).await;
    let top_level =
        format!("[fleet]\nqueue_order = \"{order}\"\n[limits]\nrequests_per_minute = 1000000\n");
    let gw = Gateway::start_fleet(&top_level, "", &[(&mock, "gpu-a", "max_in_flight = 1")]).await;
    let (_, heavy) = gw.key_with_slots(32, Some(32)).await;
    let (_, light) = gw.key_with_slots(32, Some(32)).await;
    (gw, heavy, light)
}

/// Waits until `n` requests wait in the model's fleet queue.
async fn wait_queued(gw: &Gateway, n: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let model = &gw.state.fleet().models()[0];
    while model.queued() != n {
        assert!(
            Instant::now() < deadline,
            "{} queued, never {n}",
            model.queued()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

type Sent = JoinHandle<reqwest::Result<reqwest::Response>>;

fn send(gw: &Gateway, key: &str, body: &'static str) -> Sent {
    tokio::spawn(gw.complete_as(key, body).send())
}

/// The heavy key holds the node and lines up 8 more; then the light key lines up 2. The
/// gate opens: which key each request the node ran was from, in the order it ran them.
async fn served_after_a_backlog(order: &str) -> Vec<&'static str> {
    let (gw, heavy, light) = one_slot(order).await;
    gw.mock.close_gate();
    let mut sent = vec![send(&gw, &heavy, HEAVY)];
    gw.mock.wait_in_flight(1).await;
    for queued in 1..=8 {
        sent.push(send(&gw, &heavy, HEAVY));
        wait_queued(&gw, queued).await;
    }
    for queued in 9..=10 {
        sent.push(send(&gw, &light, LIGHT));
        wait_queued(&gw, queued).await;
    }
    gw.mock.open_gate();
    for request in sent {
        assert_eq!(request.await.unwrap().unwrap().status(), 200);
    }
    served(&gw, ["light", "heavy"])
}

/// In the order the node ran them, the key each request was from: `names[0]` for the
/// [`LIGHT`] prompt, `names[1]` for the [`HEAVY`] one.
fn served(gw: &Gateway, names: [&'static str; 2]) -> Vec<&'static str> {
    gw.mock
        .received()
        .iter()
        .filter(|r| r.path == "/v1/completions")
        .map(|r| match r.json()["prompt"][0].as_u64() {
            Some(7) => names[0],
            _ => names[1],
        })
        .collect()
}

fn positions(served: &[&str], key: &str) -> Vec<usize> {
    (0..served.len()).filter(|&i| served[i] == key).collect()
}

#[tokio::test]
async fn a_light_keys_requests_go_before_a_heavy_keys_backlog() {
    let served = tokio::time::timeout(Duration::from_secs(30), served_after_a_backlog("fair"))
        .await
        .expect("hung");
    assert_eq!(served.len(), 11);
    // The heavy key's request on the node, then the keys take turns, the light key
    // first (a tie goes to the key with fewer requests waiting): its two go second and
    // fourth.
    assert_eq!(positions(&served, "light"), [1, 3], "{served:?}");
}

#[tokio::test]
async fn in_arrival_order_they_wait_behind_the_backlog() {
    let served = tokio::time::timeout(Duration::from_secs(30), served_after_a_backlog("arrival"))
        .await
        .expect("hung");
    assert_eq!(positions(&served, "light"), [9, 10], "{served:?}");
}

/// Two keys with shares 2 and 1 keep 12 requests each waiting behind the held slot:
/// while both wait, the node runs two of the first key's for each of the second's.
#[tokio::test]
async fn backlogged_keys_are_served_in_proportion_to_their_shares() {
    let served = tokio::time::timeout(Duration::from_secs(30), async {
        let mock = node(MockConfig::default()).await;
        let top_level = "[limits]\nrequests_per_minute = 1000000\n";
        let gw =
            Gateway::start_fleet(top_level, "", &[(&mock, "gpu-a", "max_in_flight = 1")]).await;
        let backlogged = |share| LimitOverrides {
            max_concurrent: Some(32),
            max_queued: Some(32),
            share: Some(share),
            ..LimitOverrides::default()
        };
        let (_, double) = gw.create_key(backlogged(2)).await;
        let (_, single) = gw.create_key(backlogged(1)).await;
        gw.mock.close_gate();
        let mut sent = vec![send(&gw, &single, LIGHT)];
        gw.mock.wait_in_flight(1).await;
        for queued in 1..=24 {
            let (key, body) = if queued % 2 == 0 {
                (&double, HEAVY)
            } else {
                (&single, LIGHT)
            };
            sent.push(send(&gw, key, body));
            wait_queued(&gw, queued).await;
        }
        gw.mock.open_gate();
        for request in sent {
            assert_eq!(request.await.unwrap().unwrap().status(), 200);
        }
        served(&gw, ["single", "double"])
    })
    .await
    .expect("hung");
    // The first 18 after the held one, while both keys still wait: 12 and 6.
    let window = &served[1..19];
    assert_eq!(positions(window, "double").len(), 12, "{served:?}");
    assert_eq!(positions(window, "single").len(), 6, "{served:?}");
}
