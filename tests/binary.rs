//! The real binaries on port 0: `fleetgate keys …`, `fleetgate serve` in front of the
//! `mock-vllm` binary (also with every store over TLS), `fleetgate demo` and its printed
//! curl line, and memory use while a large body streams through.
//!
//! The tests on a PostgreSQL store are ignored by default; run them with
//! `TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/test cargo test --test binary postgres -- --include-ignored`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test fails by panicking"
)]

/// The parts of the shared harness (`tests/common`) these tests use.
mod common {
    pub mod cli;
    pub mod jobs;
    pub mod postgres;
    pub mod private_postgres;
    pub mod processes;
    #[expect(
        dead_code,
        reason = "only a TLS server is started here, never a plain one, nor killed"
    )]
    pub mod redis_server;
    pub mod tls;
}

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::cli::{create_key, create_key_with, fleetgate};
use common::processes::{
    FLEETGATE, Proc, listening_address, logged_address, serve, signal, start_mock, wait_for_line,
};

fn write_config(dir: &Path, upstream: &str) -> std::path::PathBuf {
    let path = dir.join("fleetgate.toml");
    std::fs::write(
        &path,
        format!(
            "listen = \"127.0.0.1:0\"\ndatabase_url = \"sqlite://{}/fg.db\"\n\n[[models]]\nid = \"llama-8b\"\n\n[[models.upstreams]]\nurl = \"{upstream}\"\ngpu = \"gpu-a\"\n",
            dir.display()
        ),
    )
    .unwrap();
    path
}

/// SIGTERM, then waits: whether it exited with success (a clean, drained stop).
fn terminate(mut process: Proc) -> bool {
    signal(&process.0, "TERM");
    process.0.wait().unwrap().success()
}

async fn complete(url: &str, key: &str, body: serde_json::Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap()
}

/// Sends the request until it answers `status`, which must happen within 1 s (a change
/// made by the CLI reaches a running server through its key table's follow loop).
async fn within_a_second(
    url: &str,
    key: &str,
    body: &serde_json::Value,
    status: u16,
) -> reqwest::Response {
    let started = std::time::Instant::now();
    loop {
        let response = complete(url, key, body.clone()).await;
        if response.status() == status {
            return response;
        }
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "still {} after 1 s, not {status}",
            response.status()
        );
    }
}

#[tokio::test]
async fn keys_cli_and_serve_work_together() {
    let dir = tempfile::tempdir().unwrap();
    let (_mock, upstream) = start_mock(0);
    let config = write_config(dir.path(), &upstream);

    let created = fleetgate(
        &config,
        &[
            "keys",
            "create",
            "--name",
            "alice",
            "--email",
            "a@example.org",
        ],
    );
    let stdout = String::from_utf8(created.stdout).unwrap();
    let secret = stdout.trim_end().lines().last().unwrap().to_owned();
    assert!(
        secret.starts_with("fg-") && !secret.contains(' '),
        "secret alone on the last line: {stdout}"
    );

    let json = fleetgate(&config, &["keys", "create", "--name", "bob", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert!(
        json["secret"]
            .as_str()
            .unwrap()
            .starts_with(json["prefix"].as_str().unwrap())
    );

    let listed = String::from_utf8(fleetgate(&config, &["keys", "list"]).stdout).unwrap();
    assert!(listed.contains("alice") && listed.contains("bob"));
    assert!(!listed.contains(&secret), "list never shows secrets");

    let (_server, url) = serve(&config, "fleetgate");
    let body = serde_json::json!({"model": "llama-8b", "prompt": "Hi", "max_tokens": 2});
    let served = complete(&url, &secret, body.clone()).await;
    assert_eq!(served.status(), 200);
    // The body ends once the request is settled; its ledger row is committed by the
    // write-behind writer within milliseconds.
    served.bytes().await.unwrap();

    // Usage from the ledger, and a budget changed from the CLI applies within the key
    // table's follow period.
    let settled = std::time::Instant::now();
    loop {
        let usage = fleetgate(&config, &["keys", "usage", &secret[..12], "--json"]);
        let usage: serde_json::Value = serde_json::from_slice(&usage.stdout).unwrap();
        if usage["used_tokens"].as_u64().unwrap() > 0 {
            break;
        }
        assert!(
            settled.elapsed() < Duration::from_secs(1),
            "not in the ledger after 1 s: {usage}"
        );
    }
    fleetgate(
        &config,
        &["keys", "set", &secret[..12], "--monthly-budget", "5"],
    );
    let over = within_a_second(&url, &secret, &body, 429).await;
    let error: serde_json::Value = over.json().await.unwrap();
    assert_eq!(error["error"]["code"], "budget_exceeded");
    fleetgate(
        &config,
        &["keys", "set", &secret[..12], "--monthly-budget", "default"],
    );
    within_a_second(&url, &secret, &body, 200).await;

    fleetgate(&config, &["keys", "revoke", &secret[..12]]);
    within_a_second(&url, &secret, &body, 401).await;
    let bob = json["secret"].as_str().unwrap();
    assert_eq!(complete(&url, bob, body).await.status(), 200);
}

/// `keys rotate` against a running server (SQLite, the CLI in another process): the new
/// secret works within a second, the old one until its grace ends; `keys set --expires`
/// refuses the key with a message saying when it expired, and `never` lifts it.
#[tokio::test]
async fn keys_rotate_and_expire_reach_a_running_server() {
    let dir = tempfile::tempdir().unwrap();
    let (_mock, upstream) = start_mock(0);
    let config = write_config(dir.path(), &upstream);
    let old = create_key_with(&config, "rotating", &["--expires", "30d"]);
    let prefix = &old[..12];
    let (_server, url) = serve(&config, "fleetgate");
    let body = serde_json::json!({"model": "llama-8b", "prompt": "Hi", "max_tokens": 2});
    assert_eq!(complete(&url, &old, body.clone()).await.status(), 200);

    let rotated = fleetgate(&config, &["keys", "rotate", prefix, "--grace", "2s"]);
    let stdout = String::from_utf8(rotated.stdout).unwrap();
    let new = stdout.trim_end().lines().last().unwrap().to_owned();
    assert!(new.starts_with(prefix) && new != old, "{stdout}");
    assert!(
        stdout.contains("(a grace of 2s); then only the new one does."),
        "{stdout}"
    );
    within_a_second(&url, &new, &body, 200).await;
    let graced = std::time::Instant::now();
    assert_eq!(complete(&url, &old, body.clone()).await.status(), 200);
    // The grace ends on a whole second: within 3 s of the rotation.
    loop {
        let status = complete(&url, &old, body.clone()).await.status();
        if status == 401 {
            break;
        }
        assert!(
            graced.elapsed() < Duration::from_secs(4),
            "the old secret still answers {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(complete(&url, &new, body.clone()).await.status(), 200);

    fleetgate(&config, &["keys", "set", prefix, "--expires", "2020-01-01"]);
    let expired = within_a_second(&url, &new, &body, 401).await;
    let error: serde_json::Value = expired.json().await.unwrap();
    assert_eq!(error["error"]["code"], "invalid_api_key");
    assert_eq!(
        error["error"]["message"],
        "This API key expired at 2020-01-01T00:00:00Z. Ask its administrator for a new expiry or a new key."
    );
    let listed = String::from_utf8(fleetgate(&config, &["keys", "list"]).stdout).unwrap();
    assert!(listed.contains(" expired  rotating"), "{listed}");
    fleetgate(&config, &["keys", "set", prefix, "--expires", "never"]);
    within_a_second(&url, &new, &body, 200).await;
}

/// `--share` sets a key's share on `keys create` and `keys set` (`default`: back to the
/// configured 1), and `keys list` and `keys usage` show it.
#[test]
fn the_share_round_trips_through_keys_create_set_list_and_usage() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "http://127.0.0.1:9");
    let json = |args: &[&str]| -> serde_json::Value {
        serde_json::from_slice(&fleetgate(&config, args).stdout).unwrap()
    };
    let share = |key: &serde_json::Value| {
        (
            key["limits"]["share"].clone(),
            key["overrides"]["share"].clone(),
        )
    };

    let plain = json(&["keys", "create", "--name", "plain", "--json"]);
    assert_eq!(share(&plain), (1.into(), serde_json::Value::Null));
    let heavy = json(&[
        "keys", "create", "--name", "heavy", "--share", "5", "--json",
    ]);
    assert_eq!(share(&heavy), (5.into(), 5.into()));
    let prefix = heavy["prefix"].as_str().unwrap();

    let set = fleetgate(&config, &["keys", "set", prefix, "--share", "1000"]);
    let set = String::from_utf8(set.stdout).unwrap();
    assert!(set.contains("  share            1000 (own)"), "{set}");
    let listed = json(&["keys", "list", "--json"]);
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 2);
    assert_eq!(share(&listed[1]), (1000.into(), 1000.into()));
    let table = String::from_utf8(fleetgate(&config, &["keys", "list"]).stdout).unwrap();
    assert!(table.lines().next().unwrap().contains(" SHARE "), "{table}");

    fleetgate(&config, &["keys", "set", prefix, "--share", "default"]);
    let usage = json(&["keys", "usage", prefix, "--json"]);
    assert_eq!(share(&usage), (1.into(), serde_json::Value::Null));
}

/// A bad limit flag of `keys create` or `keys set`: a non-zero exit, before the store is
/// opened, with an error naming the flag and the bounds; nothing created or changed.
#[test]
fn a_bad_limit_flag_stops_keys_create_and_set_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "http://127.0.0.1:9");
    let secret = create_key(&config, "kept");
    let prefix = &secret[..12];
    let list = || fleetgate(&config, &["keys", "list", "--json"]).stdout;
    let before = list();

    let fresh = tempfile::tempdir().unwrap();
    let untouched = write_config(fresh.path(), "http://127.0.0.1:9");
    let create = ["keys", "create", "--name", "bad"];
    let set = ["keys", "set", prefix];
    let cases: [(&[&str], &str, &str, &str); 14] = [
        (
            &create,
            "--max-queued",
            "3000000000",
            "must be between 0 and 2147483647 (got 3000000000)",
        ),
        (
            &create,
            "--max-queued",
            "-1",
            "must be between 0 and 2147483647 (got -1)",
        ),
        (
            &create,
            "--rpm",
            "0",
            "must be between 1 and 2147483647 (got 0)",
        ),
        (
            &create,
            "--rpm",
            "ten",
            "must be a whole number between 1 and 2147483647 (got ten)",
        ),
        (
            &set,
            "--max-queued",
            "3000000000",
            "must be between 0 and 2147483647 (got 3000000000), or 'default'",
        ),
        (
            &set,
            "--max-queued",
            "1.5",
            "must be a whole number between 0 and 2147483647 (got 1.5), or 'default'",
        ),
        (
            &set,
            "--rpm",
            "0",
            "must be between 1 and 2147483647 (got 0), or 'default'",
        ),
        (
            &set,
            "--rpm",
            "2147483648",
            "must be between 1 and 2147483647 (got 2147483648), or 'default'",
        ),
        (
            &create,
            "--share",
            "0",
            "must be between 1 and 1000 (got 0)",
        ),
        (
            &set,
            "--share",
            "1001",
            "must be between 1 and 1000 (got 1001), or 'default'",
        ),
        // Negative numbers reach the check (not clap's `unexpected argument '-1'`).
        (
            &create,
            "--monthly-budget",
            "-5",
            "must be between 0 and 9223372036854775807 (got -5)",
        ),
        (
            &create,
            "--max-concurrent",
            "-1",
            "must be between 1 and 2147483647 (got -1)",
        ),
        (
            &set,
            "--max-queued",
            "-1",
            "must be between 0 and 2147483647 (got -1), or 'default'",
        ),
        (
            &set,
            "--share",
            "-1",
            "must be between 1 and 1000 (got -1), or 'default'",
        ),
    ];
    for (command, flag, value, requirement) in cases {
        for config in [&config, &untouched] {
            let output = Command::new(FLEETGATE)
                .args(command)
                .args([flag, value])
                .arg("--config")
                .arg(config)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(
                !output.status.success(),
                "{command:?} {flag} {value}: {stderr}"
            );
            assert!(
                stderr.contains(&format!("invalid value '{value}' for '{flag} <"))
                    && stderr.contains(requirement),
                "{command:?} {flag} {value}: {stderr}"
            );
            assert!(output.stdout.is_empty(), "{command:?} {flag} {value}");
        }
    }
    assert_eq!(list(), before, "nothing created or changed");
    assert!(
        !fresh.path().join("fg.db").exists(),
        "a bad flag stops the command before the store is opened"
    );
    // So does a negative --limit of the listings, saying the range.
    for command in [&["log"][..], &["jobs", "list"]] {
        let output = Command::new(FLEETGATE)
            .args(command)
            .args(["--limit", "-1", "--config"])
            .arg(&untouched)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{command:?}: {stderr}");
        assert!(
            stderr.contains("invalid value '-1' for '--limit <LIMIT>'")
                && stderr.contains("-1 is not in 1..="),
            "{command:?}: {stderr}"
        );
    }
}

#[test]
fn unknown_config_keys_stop_the_start_with_their_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "listen = \"127.0.0.1:0\"\nlisten_port = 9\n[[models]]\nid = \"m\"\n[[models.upstreams]]\nurl = \"http://127.0.0.1:1\"\ngpu = \"g\"\n").unwrap();
    let output = Command::new(FLEETGATE)
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("listen_port"));
}

/// The admin token the deploy recipes ship as a sample, or any other that says
/// `change-me`, stops `serve` with a message saying how to make a real one.
#[test]
fn a_placeholder_admin_token_stops_the_start_saying_how_to_make_one() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "http://127.0.0.1:1");
    for token in [
        "sample-admin-token-change-me",
        "our-production-token-CHANGE_ME",
    ] {
        let mut child = Command::new(FLEETGATE)
            .args(["serve", "--config"])
            .arg(&config)
            .env("FLEETGATE_ADMIN_TOKEN", token)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let server = Proc(child);
        let line = wait_for_line(stderr, "placeholder".to_owned(), |line| {
            (line.contains("fleetgate listening") || line.starts_with("error: "))
                .then(|| line.to_owned())
        });
        assert!(
            line.starts_with("error: "),
            "fleetgate started with the admin token {token}: {line}"
        );
        assert!(line.contains("admin_token"), "{line}");
        assert!(line.contains("openssl rand -hex 32"), "{line}");
        assert!(
            !line.contains(token),
            "the token itself is not repeated: {line}"
        );
        let mut server = server;
        assert!(!server.0.wait().unwrap().success());
    }
}

/// A config error is one line that says each problem once, by key, with no backtrace
/// even when the user runs with `RUST_BACKTRACE=1`; so is any other CLI error.
#[test]
fn errors_are_one_line_each_said_once_without_a_backtrace() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "[limits]\nrpm = 3\n[[models]]\nid = \"m\"\n[[models.upstreams]]\nurl = \"http://127.0.0.1:1\"\ngpu = \"g\"\n").unwrap();
    let run = |args: &[&str], config: &Path| {
        let output = Command::new(FLEETGATE)
            .args(args)
            .arg("--config")
            .arg(config)
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap();
        assert!(!output.status.success());
        String::from_utf8(output.stderr).unwrap()
    };
    let stderr = run(&["keys", "list"], &path);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(
        stderr.contains("in [limits]: unknown key `rpm`"),
        "{stderr}"
    );
    assert!(stderr.contains("requests_per_minute"), "{stderr}");
    assert_eq!(stderr.matches("rpm").count(), 1, "said once: {stderr}");
    assert!(!stderr.contains("default."), "{stderr}");
    assert!(!stderr.contains("``"), "{stderr}");

    let good = write_config(dir.path(), "http://127.0.0.1:1");
    let stderr = run(&["keys", "revoke", "alice"], &good);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(!stderr.contains("backtrace"), "{stderr}");
    assert!(stderr.contains("alice"), "{stderr}");
}

/// A relative SQLite path is relative to the config file, not to where the command runs:
/// keys made from anywhere with `--config` land in the store `serve` opens.
#[test]
fn a_relative_sqlite_path_follows_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("etc").join("fleetgate.toml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    std::fs::write(&config, "database_url = \"sqlite://state/fg.db\"\n[[models]]\nid = \"m\"\n[[models.upstreams]]\nurl = \"http://127.0.0.1:1\"\ngpu = \"g\"\n").unwrap();
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let keys = |cwd: &Path, args: &[&str]| {
        let output = Command::new(FLEETGATE)
            .args(args)
            .arg("--config")
            .arg(&config)
            .current_dir(cwd)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap()
    };
    keys(&elsewhere, &["keys", "create", "--name", "alice"]);
    assert!(dir.path().join("etc/state/fg.db").exists());
    assert!(
        !elsewhere.join("state").exists(),
        "nothing made where the command ran"
    );
    let listed = keys(config.parent().unwrap(), &["keys", "list"]);
    assert!(listed.contains("alice"), "{listed}");
}

/// On a busy address the demo says which one, and how to pick another.
#[test]
fn the_demo_on_a_busy_port_names_the_address_and_the_flag() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = busy.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(FLEETGATE)
        .args(["demo", "--listen", &address, "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(&address), "{stderr}");
    assert!(stderr.contains("--listen"), "{stderr}");
}

/// So does `serve`, for its API listener and the ones beside it, naming the config key and
/// the file that set the busy address.
#[test]
fn serve_on_a_busy_port_names_the_address_and_the_config_key() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = busy.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "http://127.0.0.1:9");
    let text = std::fs::read_to_string(&config).unwrap();
    for (setting, replacement) in [
        (
            format!("`listen` in {}", config.display()),
            format!("listen = \"{address}\""),
        ),
        (
            "`ops_listen` in the config".to_owned(),
            format!("listen = \"127.0.0.1:0\"\nops_listen = \"{address}\""),
        ),
    ] {
        std::fs::write(
            &config,
            text.replacen("listen = \"127.0.0.1:0\"", &replacement, 1),
        )
        .unwrap();
        let output = Command::new(FLEETGATE)
            .args(["serve", "--config"])
            .arg(&config)
            .output()
            .unwrap();
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        let error = stderr.lines().find(|l| l.starts_with("error: ")).unwrap();
        assert!(
            error.contains(&format!(
                "cannot listen on {address}; pick another address with {setting}"
            )),
            "{stderr}"
        );
        assert!(error.contains("in use"), "{stderr}");
    }
}

/// Starts `fleetgate demo` on `data_dir`; returns the process and the curl line it
/// printed.
fn start_demo(data_dir: &Path) -> (Proc, String) {
    let mut child = Command::new(FLEETGATE)
        .args(["demo", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let demo = Proc(child);
    let curl = wait_for_line(stdout, "demo".into(), |l| {
        l.starts_with("curl ").then(|| l.to_owned())
    });
    (demo, curl)
}

/// The secret in a printed curl line.
fn bearer_of(curl: &str) -> &str {
    curl.split("Bearer ")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap()
}

#[tokio::test]
async fn the_demo_serves_its_printed_curl_line() {
    let dir = tempfile::tempdir().unwrap();
    let (_demo, curl) = start_demo(dir.path());

    let json: serde_json::Value = if Command::new("curl").arg("--version").output().is_ok() {
        // Run the printed line exactly as a user pasting it would.
        let output = Command::new("sh").arg("-c").arg(&curl).output().unwrap();
        assert!(output.status.success(), "{curl}");
        serde_json::from_slice(&output.stdout).unwrap()
    } else {
        // No curl on this machine: send what the line says.
        let url = curl.split_whitespace().nth(2).unwrap();
        let body = curl.split("-d '").nth(1).unwrap().trim_end_matches('\'');
        reqwest::Client::new()
            .post(url)
            .bearer_auth(bearer_of(&curl))
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    };
    assert!(
        json["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
    );
}

/// A second run of the demo revokes the first run's key, and the store commands read
/// the demo's store through the config it wrote (`demo.toml`), without writing one.
#[tokio::test]
async fn each_demo_run_leaves_one_live_key_and_its_store_reads_with_its_config() {
    let dir = tempfile::tempdir().unwrap();
    let (first, curl) = start_demo(dir.path());
    let first_secret = bearer_of(&curl).to_owned();
    let url = curl
        .split_whitespace()
        .nth(2)
        .unwrap()
        .replace("/v1/completions", "");
    let body = serde_json::json!({"model": "llama-8b", "prompt": "The capital of France is", "max_tokens": 4});
    assert_eq!(
        complete(&url, &first_secret, body.clone()).await.status(),
        200
    );
    assert!(terminate(first));

    let (_second, curl) = start_demo(dir.path());
    let second_secret = bearer_of(&curl).to_owned();
    let url = curl
        .split_whitespace()
        .nth(2)
        .unwrap()
        .replace("/v1/completions", "");
    assert_eq!(
        complete(&url, &first_secret, body.clone()).await.status(),
        401,
        "the first run's key is revoked"
    );
    assert_eq!(complete(&url, &second_secret, body).await.status(), 200);

    let config = dir.path().join("demo.toml");
    let keys = fleetgate(&config, &["keys", "list", "--json"]).stdout;
    let keys: Vec<serde_json::Value> = serde_json::from_slice(&keys).unwrap();
    let live: Vec<_> = keys.iter().filter(|k| k["active"] == true).collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert_eq!(live.len(), 1, "{keys:?}");
    assert!(second_secret.starts_with(live[0]["prefix"].as_str().unwrap()));

    // Both runs' completions, by their keys' prefixes (the running demo writes its log
    // in batches: read until its row is there).
    let served_by = || -> Vec<String> {
        let log = fleetgate(&config, &["log", "--json"]).stdout;
        String::from_utf8(log)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|row| row["status"] == 200)
            .map(|row| row["key_prefix"].as_str().unwrap().to_owned())
            .collect()
    };
    until("the second run's request in the log", || {
        served_by().len() == 2
    })
    .await;
    let prefixes = served_by();
    assert!(second_secret.starts_with(&prefixes[0]), "{prefixes:?}");
    assert!(first_secret.starts_with(&prefixes[1]), "{prefixes:?}");
}

/// Peak resident memory of a process, from /proc (Linux).
fn peak_rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

#[tokio::test]
async fn a_full_vocab_body_streams_through_with_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let (_mock, upstream) = start_mock(0);
    let config = write_config(dir.path(), &upstream);
    // The mock is busy for seconds making the 40 MB body; on a loaded machine its health
    // probe would time out and the stream be cut as lost. Probes are not under test here.
    let mut toml = std::fs::read_to_string(&config).unwrap();
    toml.push_str("\n[fleet]\nprobe_timeout_ms = 60000\n");
    std::fs::write(&config, toml).unwrap();
    let secret = create_key(&config, "mem");
    let (server, url) = serve(&config, "fleetgate");

    // The high-water mark after an ordinary request is the baseline.
    let small = serde_json::json!({"model": "llama-8b", "prompt": [1, 2], "max_tokens": 2});
    complete(&url, &secret, small).await.bytes().await.unwrap();
    let baseline = peak_rss_bytes(server.0.id());

    let prompt: Vec<u32> = (1..=8).collect();
    let body = serde_json::json!({"model": "llama-8b", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": -1});
    let mut response = complete(&url, &secret, body).await;
    assert_eq!(response.status(), 200);
    let mut total = 0usize;
    while let Some(chunk) = response.chunk().await.unwrap() {
        total += chunk.len();
    }
    let peak = peak_rss_bytes(server.0.id());
    let growth = peak.saturating_sub(baseline);
    eprintln!(
        "relayed {} MB; gateway peak RSS {} MB, {} MB above its baseline",
        total >> 20,
        peak >> 20,
        growth >> 20
    );
    assert!(total > 40 << 20, "the body is large ({total} bytes)");
    assert!(
        growth < (total as u64) / 4,
        "RSS grew {growth} bytes for a {total}-byte body: buffered?"
    );
}

#[tokio::test]
async fn sigterm_drains_within_the_grace_period_and_keeps_the_usage() {
    let dir = tempfile::tempdir().unwrap();
    let (_mock, upstream) = start_mock(50);
    let config = write_config(dir.path(), &upstream);
    let secret = create_key(&config, "drain");
    let mut child = tokio::process::Command::new(FLEETGATE)
        .args(["serve", "--config"])
        .arg(&config)
        .env("FLEETGATE_SHUTDOWN_GRACE_MS", "300")
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap().into_owned_fd().unwrap();
    let address = wait_for_line(
        std::fs::File::from(stderr),
        "fleetgate".into(),
        listening_address,
    );
    let url = format!("http://{address}");

    // A long stream is running when the gateway is told to stop.
    let body = serde_json::json!({"model": "llama-8b", "prompt": [1, 2, 3], "max_tokens": 1000, "stream": true});
    let mut stream = complete(&url, &secret, body).await;
    assert_eq!(stream.status(), 200);
    stream.chunk().await.unwrap().unwrap();
    let pid = child.id().unwrap().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );

    // The stream is cut after the grace period, the process exits cleanly on its own…
    let drained = tokio::time::timeout(Duration::from_secs(10), async {
        while let Ok(Some(_)) = stream.chunk().await {}
    });
    drained
        .await
        .expect("the stream ends within the grace period");
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("the process exits")
        .unwrap();
    assert!(status.success(), "{status}");

    // …and what the cut stream used is in the ledger.
    let usage = fleetgate(&config, &["keys", "usage", &secret[..12], "--json"]);
    let usage: serde_json::Value = serde_json::from_slice(&usage.stdout).unwrap();
    let used = usage["used_tokens"].as_u64().unwrap();
    assert!(
        (3 + 1..3 + 1000).contains(&used),
        "charged the prompt and what was relayed: {used}"
    );
}

#[tokio::test]
async fn json_logs_carry_one_line_per_request_without_prompt_or_key() {
    let dir = tempfile::tempdir().unwrap();
    let (_mock, upstream) = start_mock(0);
    let config = write_config(dir.path(), &upstream);
    let secret = create_key(&config, "logs");
    let mut child = Command::new(FLEETGATE)
        .args(["serve", "--config"])
        .arg(&config)
        .env("FLEETGATE_LOG_FORMAT", "json")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let _server = Proc(child);
    // Every line, parsed; the reader thread ends with the process.
    let (tx, lines) = std::sync::mpsc::channel::<(String, serde_json::Value)>();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let json = serde_json::from_str(&line).expect("every log line is JSON");
            if tx.send((line, json)).is_err() {
                break;
            }
        }
    });
    let next_with = |message: &str| loop {
        let (line, json) = lines
            .recv_timeout(Duration::from_secs(30))
            .expect("a log line");
        assert!(!line.contains(&secret), "a key secret in the log: {line}");
        assert!(
            !line.contains("PRIVATE-PROMPT"),
            "prompt text in the log: {line}"
        );
        if json["fields"]["message"] == message {
            return json;
        }
    };
    let address = next_with("fleetgate listening")["fields"]["address"]
        .as_str()
        .unwrap()
        .to_owned();

    let body =
        serde_json::json!({"model": "llama-8b", "prompt": "PRIVATE-PROMPT here", "max_tokens": 3});
    let response = complete(&format!("http://{address}"), &secret, body).await;
    let request_id = response.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_owned();
    let completion: serde_json::Value = response.json().await.unwrap();
    let finished = next_with("request finished");
    let fields = &finished["fields"];
    assert_eq!(fields["request_id"], request_id.as_str());
    assert_eq!(fields["status"], 200);
    assert_eq!(fields["model"], "llama-8b");
    assert_eq!(fields["key_prefix"], &secret[..12]);
    assert_eq!(fields["completion_tokens"], 3);
    assert_eq!(finished["span"]["request_id"], request_id.as_str());
    let generated = completion["choices"][0]["text"].as_str().unwrap();
    assert!(
        !finished.to_string().contains(generated),
        "completion text in the log"
    );

    // A stream's line is written when its body ends, and carries the request's span too.
    let body = serde_json::json!({"model": "llama-8b", "prompt": "PRIVATE-PROMPT", "max_tokens": 3, "stream": true});
    let response = complete(&format!("http://{address}"), &secret, body).await;
    let request_id = response.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        response
            .text()
            .await
            .unwrap()
            .trim_end()
            .ends_with("data: [DONE]")
    );
    let finished = next_with("request finished");
    assert_eq!(finished["fields"]["request_id"], request_id.as_str());
    assert_eq!(finished["fields"]["completion_tokens"], 3);
    assert_eq!(
        finished["span"]["request_id"],
        request_id.as_str(),
        "{finished}"
    );
}

#[tokio::test]
async fn the_ops_listener_serves_only_metrics_and_health() {
    let dir = tempfile::tempdir().unwrap();
    let (_mock, upstream) = start_mock(0);
    let config = write_config(dir.path(), &upstream);
    let mut child = Command::new(FLEETGATE)
        .args(["serve", "--config"])
        .arg(&config)
        .env("FLEETGATE_OPS_LISTEN", "127.0.0.1:0")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let _server = Proc(child);
    let ops = wait_for_line(stderr, "ops".into(), |line| {
        logged_address(line, "fleetgate ops listening")
    });
    let client = reqwest::Client::new();
    let get = |path: &str| client.get(format!("http://{ops}{path}")).send();
    let metrics = get("/metrics").await.unwrap();
    assert_eq!(metrics.status(), 200);
    let text = metrics.text().await.unwrap();
    assert!(
        text.contains(r#"fleetgate_upstream_up{model="llama-8b",gpu="gpu-a"} 1"#),
        "{text}"
    );
    let health: serde_json::Value = get("/health").await.unwrap().json().await.unwrap();
    assert_eq!(health["models"][0]["ready"], true);
    let completions = get("/v1/models").await.unwrap();
    assert_eq!(
        completions.status(),
        404,
        "the API is not on the ops listener"
    );
}

/// Requests sent by 8 clients until `stop`: each 200's request id and when its answer
/// had been read.
async fn load_until(
    url: &str,
    secret: &str,
    stop: tokio_util::sync::CancellationToken,
) -> Vec<(String, std::time::Instant)> {
    let body = serde_json::json!({"model": "llama-8b", "prompt": "Hi", "max_tokens": 1});
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let (url, secret, body, stop) = (
                url.to_owned(),
                secret.to_owned(),
                body.clone(),
                stop.clone(),
            );
            tokio::spawn(async move {
                let client = reqwest::Client::new();
                let mut answered = Vec::new();
                while !stop.is_cancelled() {
                    let sent = client
                        .post(format!("{url}/v1/completions"))
                        .bearer_auth(&secret)
                        .json(&body)
                        .send()
                        .await;
                    let Ok(response) = sent else { break };
                    if response.status() != 200 {
                        continue;
                    }
                    let id = response.headers()["x-request-id"]
                        .to_str()
                        .unwrap()
                        .to_owned();
                    if response.bytes().await.is_ok() {
                        answered.push((id, std::time::Instant::now()));
                    }
                }
                answered
            })
        })
        .collect();
    let mut all = Vec::new();
    for client in clients {
        all.extend(client.await.unwrap());
    }
    all
}

/// The request ids in the SQLite ledger at `path`.
async fn ledger_ids(path: &Path) -> std::collections::HashSet<String> {
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let ids: Vec<String> = sqlx::query_scalar("SELECT request_id FROM usage_ledger")
        .fetch_all(&pool)
        .await
        .unwrap();
    pool.close().await;
    ids.into_iter().collect()
}

/// The write-behind ledger's promise: a SIGKILL under load loses at most the usage
/// settled in the last moments (the documented ≤ 20 ms batch delay plus the batch being
/// written; 250 ms allowed here for a loaded machine), and a SIGTERM loses none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_loses_only_the_last_moments_of_usage_and_sigterm_none() {
    const WINDOW: Duration = Duration::from_millis(250);
    let dir = tempfile::tempdir().unwrap();
    let (_mock, upstream) = start_mock(0);
    let config = write_config(dir.path(), &upstream);
    let secret = create_key_with(
        &config,
        "load",
        &["--rpm", "10000000", "--max-concurrent", "64"],
    );
    let db = dir.path().join("fg.db");

    // SIGKILL while 8 clients keep it busy.
    let (mut server, url) = serve(&config, "killed");
    let stop = tokio_util::sync::CancellationToken::new();
    let load = tokio::spawn({
        let (url, secret, stop) = (url.clone(), secret.clone(), stop.clone());
        async move { load_until(&url, &secret, stop).await }
    });
    // Until a few hundred requests are through (bounded).
    let started = std::time::Instant::now();
    while ledger_ids(&db).await.len() < 300 && started.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.0.kill().unwrap();
    let killed = std::time::Instant::now();
    stop.cancel();
    let answered = load.await.unwrap();
    server.0.wait().unwrap();
    let ledger = ledger_ids(&db).await;
    let missing: Vec<_> = answered
        .iter()
        .filter(|(id, _)| !ledger.contains(id))
        .collect();
    assert!(answered.len() >= 300, "only {} answered", answered.len());
    for (id, at) in &missing {
        let before = killed.saturating_duration_since(*at);
        assert!(
            before < WINDOW,
            "{id} was answered {before:?} before the SIGKILL and is not in the ledger"
        );
    }
    eprintln!(
        "SIGKILL after {} answers: {} not in the ledger (all within {WINDOW:?} of the kill)",
        answered.len(),
        missing.len()
    );

    // SIGTERM under the same load: every answered request is in the ledger.
    let (server, url) = serve(&config, "terminated");
    let load = tokio::spawn({
        let (url, secret) = (url.clone(), secret.clone());
        async move { load_until(&url, &secret, tokio_util::sync::CancellationToken::new()).await }
    });
    let before = ledger.len();
    let started = std::time::Instant::now();
    while ledger_ids(&db).await.len() < before + 300 && started.elapsed() < Duration::from_secs(20)
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    signal(&server.0, "TERM");
    // The clients stop once the server no longer answers.
    let answered = load.await.unwrap();
    let mut server = server;
    assert!(server.0.wait().unwrap().success());
    let ledger = ledger_ids(&db).await;
    let missing = answered
        .iter()
        .filter(|(id, _)| !ledger.contains(id))
        .count();
    assert_eq!(
        missing,
        0,
        "{missing} of {} answered requests not in the ledger after SIGTERM",
        answered.len()
    );
}

/// `fleetgate log` and `fleetgate spend` read what a server wrote to the request log:
/// filtered by key, model, status and time; per day, key and model; metadata only.
#[tokio::test]
async fn log_and_spend_show_the_requests_a_server_served() {
    let dir = tempfile::tempdir().unwrap();
    let (_mock, upstream) = start_mock(0);
    let config = write_config(dir.path(), &upstream);
    let key = |name: &str| {
        let out = fleetgate(&config, &["keys", "create", "--name", name, "--json"]);
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (
            json["secret"].as_str().unwrap().to_owned(),
            json["prefix"].as_str().unwrap().to_owned(),
        )
    };
    let ((alice, alice_prefix), (bob, bob_prefix)) = (key("alice"), key("bob"));

    let (server, url) = serve(&config, "log");
    let prompt = "The zanzibar prompt";
    let ok = serde_json::json!({"model": "llama-8b", "prompt": prompt, "max_tokens": 3});
    let bad = serde_json::json!({"model": "llama-8b", "prompt": prompt, "max_tokens": -1});
    for (secret, body, status) in [
        (&alice, &ok, 200),
        (&alice, &ok, 200),
        (&alice, &bad, 400),
        (&bob, &ok, 200),
    ] {
        let response = complete(&url, secret, body.clone()).await;
        assert_eq!(response.status(), status);
        response.bytes().await.unwrap();
    }
    // A clean stop writes every queued log row.
    assert!(terminate(server));

    let text = |args: &[&str]| String::from_utf8(fleetgate(&config, args).stdout).unwrap();
    let lines = |args: &[&str]| -> Vec<serde_json::Value> {
        text(args)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };

    let alices = lines(&["log", "--key", &alice_prefix, "--json"]);
    assert_eq!(alices.len(), 3, "{alices:?}");
    assert!(
        alices
            .iter()
            .all(|r| r["key_prefix"] == alice_prefix.as_str())
    );
    let times: Vec<i64> = alices
        .iter()
        .map(|r| r["created_at_ms"].as_i64().unwrap())
        .collect();
    assert!(
        times.windows(2).all(|w| w[0] >= w[1]),
        "newest first: {times:?}"
    );
    assert_eq!(alices[0]["status"], 400, "the last request comes first");

    let refused = lines(&["log", "--status", "4xx", "--json"]);
    assert_eq!(refused.len(), 1);
    assert_eq!(refused[0]["error_code"], "invalid_request");
    assert_eq!(refused[0]["model"], "llama-8b");
    assert_eq!(
        lines(&["log", "--status", "200", "--model", "llama-8b", "--json"]).len(),
        3
    );
    assert!(lines(&["log", "--model", "other", "--json"]).is_empty());
    assert_eq!(lines(&["log", "--limit", "1", "--json"]).len(), 1);
    assert!(text(&["log", "--since", "2099-01-01"]).contains("No requests match."));
    assert_eq!(
        lines(&["log", "--since", "1h", "--until", "2099-01-01", "--json"]).len(),
        4
    );
    let table = text(&["log"]);
    assert!(
        table.contains(&bob_prefix) && table.contains("4 requests"),
        "{table}"
    );
    assert!(
        !table.contains("zanzibar") && !table.contains(&alice),
        "metadata only: {table}"
    );

    let spend: serde_json::Value = serde_json::from_str(&text(&["spend", "--json"])).unwrap();
    let spend = spend.as_array().unwrap();
    assert_eq!(spend.len(), 2, "one row per key and model today: {spend:?}");
    let of = |prefix: &str| spend.iter().find(|r| r["key_prefix"] == prefix).unwrap();
    assert_eq!(of(&alice_prefix)["requests"], 3);
    assert_eq!(of(&bob_prefix)["requests"], 1);
    let logged_tokens: u64 = alices
        .iter()
        .map(|r| {
            r["prompt_tokens"].as_u64().unwrap_or(0) + r["completion_tokens"].as_u64().unwrap_or(0)
        })
        .sum();
    assert!(logged_tokens > 0);
    assert_eq!(of(&alice_prefix)["total_tokens"], logged_tokens);
    let bobs = text(&["spend", "--key", &bob_prefix]);
    assert!(
        bobs.contains(&bob_prefix) && !bobs.contains(&alice_prefix),
        "{bobs}"
    );
    assert!(bobs.contains("total"), "{bobs}");

    let refused = Command::new(FLEETGATE)
        .args(["log", "--status", "6xx", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("1xx to 5xx"));
}

/// SIGHUP re-reads the config file: a refused edit is logged at error level and changes
/// nothing; a node added to the file then takes traffic, without a restart.
#[tokio::test]
async fn sighup_reloads_the_config_file_and_a_new_node_takes_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let (_a, url_a) = start_mock(0);
    let (_b, url_b) = start_mock(0);
    let config = write_config(dir.path(), &url_a);
    let secret = create_key(&config, "hup");
    let mut child = Command::new(FLEETGATE)
        .args(["serve", "--config"])
        .arg(&config)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Every line of the log, for the test to wait on.
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    let stderr = child.stderr.take().unwrap();
    let server = Proc(child);
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            eprintln!("[fleetgate] {line}");
            let _ = lines_tx.send(line);
        }
    });
    let next_line = |pred: &dyn Fn(&str) -> bool| loop {
        let line = lines
            .recv_timeout(Duration::from_secs(30))
            .expect("the expected log line");
        if pred(&line) {
            return line;
        }
    };
    let listening = next_line(&|l| listening_address(l).is_some());
    let url = format!("http://{}", listening_address(&listening).unwrap());
    let body = serde_json::json!({"model": "llama-8b", "prompt": [1, 2, 3], "max_tokens": 2});
    let served_by = |response: &reqwest::Response| {
        assert_eq!(response.status(), 200);
        response.headers()["x-acs-upstream-gpu"]
            .to_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(
        served_by(&complete(&url, &secret, body.clone()).await),
        "gpu-a"
    );
    let hang_up = || signal(&server.0, "HUP");
    let node_b = format!("\n[[models.upstreams]]\nurl = \"{url_b}\"\ngpu = \"gpu-b\"\n");
    let original = std::fs::read_to_string(&config).unwrap();

    std::fs::write(&config, format!("{original}{node_b}weight = 0\n")).unwrap();
    hang_up();
    let refused = next_line(&|l| l.contains("reload refused"));
    assert!(
        refused.contains("ERROR") && refused.contains("models.upstreams.weight"),
        "{refused}"
    );
    for _ in 0..4 {
        assert_eq!(
            served_by(&complete(&url, &secret, body.clone()).await),
            "gpu-a"
        );
    }

    std::fs::write(&config, format!("{original}{node_b}")).unwrap();
    hang_up();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if served_by(&complete(&url, &secret, body.clone()).await) == "gpu-b" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no request reached the added node within 20 s of SIGHUP"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let reloaded = next_line(&|l| l.contains("configuration reloaded"));
    assert!(reloaded.contains("added gpu-b"), "{reloaded}");
}

/// A 5xx is one log line, the request's own: no second `response failed` line from the
/// HTTP layer, which would double the log in an outage.
#[tokio::test]
async fn a_5xx_is_logged_once() {
    let dir = tempfile::tempdir().unwrap();
    // Nobody listens at the upstream: every completion is a 503.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let config = write_config(dir.path(), &format!("http://{closed}"));
    let secret = create_key(&config, "outage");
    let mut child = Command::new(FLEETGATE)
        .args(["serve", "--config"])
        .arg(&config)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let server = Proc(child);
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = lines_tx.send(line);
        }
    });
    let listening = loop {
        let line = lines.recv_timeout(Duration::from_secs(30)).unwrap();
        if let Some(address) = listening_address(&line) {
            break address;
        }
    };
    let body = serde_json::json!({"model": "llama-8b", "prompt": "Hi", "max_tokens": 2});
    let response = complete(&format!("http://{listening}"), &secret, body).await;
    assert!(response.status().is_server_error(), "{}", response.status());
    response.bytes().await.unwrap();
    assert!(terminate(server));
    // The pipe closed with the process: once the reader is done, every line is here.
    reader.join().unwrap();
    let logged: Vec<String> = lines.try_iter().collect();
    let finished: Vec<&String> = logged
        .iter()
        .filter(|l| l.contains("request finished") && l.contains("/v1/completions"))
        .collect();
    assert_eq!(finished.len(), 1, "{logged:#?}");
    assert!(
        !logged.iter().any(|l| l.contains("response failed")),
        "{logged:#?}"
    );
}

/// Polls an outside process's state until `done` (at most 20 s).
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let since = std::time::Instant::now();
    while !done() {
        assert!(
            since.elapsed() < Duration::from_secs(20),
            "{what}: not within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The only replica killed (SIGKILL) while it runs jobs, then started again: each job
/// is taken over once its lease lapses and ends once, with its result; the killed runs
/// were aborted upstream and charged nothing, so each job is charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_cut_by_a_sigkill_finish_after_a_restart_charged_once() {
    const JOBS: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    // 20 tokens 50 ms apart: a run takes about a second.
    let (mock, upstream) = start_mock(50);
    let config = write_config(dir.path(), &upstream);
    let mut text = std::fs::read_to_string(&config).unwrap();
    text = text.replacen("[[models]]", "[jobs]\nlease_ms = 1000\n\n[[models]]", 1);
    std::fs::write(&config, text).unwrap();
    let secret = create_key(&config, "jobs");
    let client = reqwest::Client::new();

    let (mut server, url) = serve(&config, "killed");
    let mut ids = Vec::new();
    for n in 0..JOBS {
        ids.push(common::jobs::submit(&client, &url, &secret, &format!("restart-{n}"), 20).await);
    }
    until("every job running", || mock.in_flight() == JOBS).await;
    server.0.kill().unwrap();
    server.0.wait().unwrap();
    until("the killed runs aborted upstream", || {
        mock.cancelled() == JOBS
    })
    .await;

    let (server, url) = serve(&config, "restarted");
    let mut charged = 0;
    for id in &ids {
        let job = common::jobs::harvest(&client, &url, &secret, id, Duration::from_secs(30)).await;
        assert_eq!(job["status"], "succeeded", "{job}");
        assert_eq!(job["attempts"], 2, "{job}");
        assert_eq!(job["result"]["usage"]["completion_tokens"], 20);
        charged += job["result"]["usage"]["total_tokens"].as_u64().unwrap();
    }
    let mut prompts = mock.prompts();
    prompts.sort();
    let expected: Vec<String> = (0..JOBS)
        .flat_map(|n| [format!("restart-{n}"), format!("restart-{n}")])
        .collect();
    assert_eq!(
        prompts, expected,
        "each job ran twice: the killed run and its takeover"
    );
    assert!(terminate(server));
    let ledger = ledger_ids(&dir.path().join("fg.db")).await;
    for id in &ids {
        assert!(ledger.contains(id), "{id} is charged");
    }
    let usage: serde_json::Value = serde_json::from_str(
        &String::from_utf8(fleetgate(&config, &["keys", "usage", &secret[..12], "--json"]).stdout)
            .unwrap(),
    )
    .unwrap();
    assert_eq!(usage["used_tokens"], charged, "charged once per job");
}

/// `fleetgate jobs list|show|cancel` against the store a server writes: metadata only
/// (never the prompt), each job's key by its prefix; a cancel from the CLI is seen by the
/// server's harvest.
#[tokio::test]
async fn the_jobs_cli_lists_shows_and_cancels_without_showing_content() {
    let dir = tempfile::tempdir().unwrap();
    let (_mock, upstream) = start_mock(0);
    let config = write_config(dir.path(), &upstream);
    let text = std::fs::read_to_string(&config).unwrap();
    // No workers: the jobs stay queued.
    std::fs::write(
        &config,
        text.replacen("[[models]]", "[jobs]\nworkers = 0\n\n[[models]]", 1),
    )
    .unwrap();
    let secret = create_key(&config, "jobs");
    let client = reqwest::Client::new();
    let (server, url) = serve(&config, "jobs cli");
    let first = common::jobs::submit(&client, &url, &secret, "a secret prompt", 2).await;
    let second = common::jobs::submit(&client, &url, &secret, "another secret prompt", 2).await;

    let listed = fleetgate(&config, &["jobs", "list", "--json"]);
    assert!(listed.status.success());
    let listed = String::from_utf8(listed.stdout).unwrap();
    let ids: Vec<String> = listed
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(ids, [second.clone(), first.clone()], "newest first");
    // The key as `log` shows it, by its prefix; in JSON beside its id.
    let prefix = &secret[..12];
    for line in listed.lines() {
        let job: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(job["key_prefix"], prefix, "{line}");
        assert!(job["key_id"].is_i64(), "{line}");
    }
    let table =
        String::from_utf8(fleetgate(&config, &["jobs", "list", "--status", "queued"]).stdout)
            .unwrap();
    let row = table.lines().find(|l| l.contains(&first)).unwrap();
    assert!(row.contains(prefix) && row.contains("queued"), "{table}");
    let shown = String::from_utf8(fleetgate(&config, &["jobs", "show", &first]).stdout).unwrap();
    let shown: serde_json::Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(shown["status"], "queued");
    assert_eq!(shown["key_prefix"], prefix);
    for out in [&listed, &table, &shown.to_string()] {
        assert!(!out.contains("secret prompt"), "content shown: {out}");
    }

    let cancelled = fleetgate(&config, &["jobs", "cancel", &first]);
    assert!(
        String::from_utf8(cancelled.stdout)
            .unwrap()
            .contains("Cancelled")
    );
    let job = common::jobs::harvest(&client, &url, &secret, &first, Duration::from_secs(10)).await;
    assert_eq!(job["status"], "cancelled");
    let failing = |args: &[&str]| {
        let output = Command::new(FLEETGATE)
            .args(args)
            .arg("--config")
            .arg(&config)
            .output()
            .unwrap();
        assert!(!output.status.success(), "{args:?} succeeded");
        String::from_utf8(output.stderr).unwrap()
    };
    assert!(failing(&["jobs", "show", "job_nope"]).contains("no job with id 'job_nope'"));
    assert!(failing(&["jobs", "list", "--status", "lost"]).contains("expected one of queued"));
    assert!(terminate(server));
}

/// `write_config`'s config with the store in PostgreSQL at `url`.
fn write_postgres_config(dir: &Path, url: &str) -> std::path::PathBuf {
    let path = write_config(dir, "http://127.0.0.1:9");
    let text = std::fs::read_to_string(&path).unwrap();
    let sqlite = format!("sqlite://{}/fg.db", dir.display());
    std::fs::write(&path, text.replacen(&sqlite, url, 1)).unwrap();
    path
}

/// A start on a PostgreSQL database already migrated logs no notice about the migration
/// table (`relation "_sqlx_migrations" already exists, skipping`): neither the first
/// start nor the second says anything about it before it listens.
#[test]
#[ignore = "needs PostgreSQL (set TEST_POSTGRES_URL)"]
fn a_postgres_start_logs_no_notice_about_the_migration_table() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let database = runtime.block_on(common::postgres::FreshDatabase::create("fg_binary"));
    let dir = tempfile::tempdir().unwrap();
    let config = write_postgres_config(dir.path(), &database.url);
    for start in ["first", "second"] {
        let mut child = Command::new(FLEETGATE)
            .args(["serve", "--config"])
            .arg(&config)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        // Killed at the end of the round: the database is all this test is about.
        let _server = Proc(child);
        // The first of: a line about the migration table, or the one saying it listens
        // (the migrations run before it).
        let line = wait_for_line(stderr, format!("{start} start"), |line| {
            (line.contains("_sqlx_migrations") || line.contains("fleetgate listening"))
                .then(|| line.to_owned())
        });
        assert!(
            line.contains("fleetgate listening"),
            "{start} start: {line}"
        );
    }
}

/// A PostgreSQL database that does not exist: one line, saying so once, with how to
/// create it.
#[test]
#[ignore = "needs PostgreSQL (set TEST_POSTGRES_URL)"]
fn a_missing_postgres_database_is_named_once_with_how_to_create_it() {
    let server = std::env::var(common::postgres::POSTGRES_URL_VAR).expect("TEST_POSTGRES_URL");
    let name = format!("fg_missing_{}", uuid::Uuid::new_v4().simple());
    let stderr = postgres_open_error(&common::postgres::with_database(&server, &name));
    let missing = format!("database \"{name}\" does not exist");
    assert_eq!(stderr.matches(&missing).count(), 1, "said once: {stderr}");
    assert!(stderr.contains(&format!("createdb {name}")), "{stderr}");
}

/// Runs `keys list` on a PostgreSQL URL that cannot be opened: its one-line error.
fn postgres_open_error(url: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let config = write_postgres_config(dir.path(), url);
    let output = Command::new(FLEETGATE)
        .args(["keys", "list", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    stderr
}

#[test]
fn an_unreachable_postgres_server_is_said_once() {
    // A port nobody listens on: bound, then let go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let stderr = postgres_open_error(&format!("postgres://postgres@127.0.0.1:{port}/test"));
    assert_eq!(stderr.matches("refused").count(), 1, "said once: {stderr}");
    assert!(stderr.contains("cannot reach the server"), "{stderr}");
}

#[test]
#[ignore = "needs PostgreSQL (set TEST_POSTGRES_URL)"]
fn a_refused_postgres_login_is_said_once_without_the_servers_source_line() {
    let server = std::env::var(common::postgres::POSTGRES_URL_VAR).expect("TEST_POSTGRES_URL");
    let role = format!("fg_nobody_{}", uuid::Uuid::new_v4().simple());
    let url = server.replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
    assert_ne!(url, server, "TEST_POSTGRES_URL names the user postgres");
    let stderr = postgres_open_error(&url);
    let refused = format!("role \"{role}\" does not exist");
    assert_eq!(stderr.matches(&refused).count(), 1, "said once: {stderr}");
    assert!(!stderr.contains(" at line "), "{stderr}");
}

/// Every store over TLS at once, as a managed deployment has them: the limiter on a
/// `rediss://` Redis that wants a client certificate (its CA trusted through
/// `SSL_CERT_FILE`, as in other rustls programs; the certificate's name given by
/// `server_name`, since the URL names an IP address), the store on PostgreSQL with
/// `sslmode=verify-full`. A completion is served, and its tokens are counted in both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server (with TLS), PostgreSQL's binaries (/usr/lib/postgresql) and openssl"]
async fn serves_with_every_store_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = common::tls::TestCa::new(dir.path(), "store-ca");
    let postgres = common::private_postgres::PrivatePostgres::start(
        &ca.server("postgres", "DNS:localhost,IP:127.0.0.1"),
    );
    let (port, tls_port) = (
        common::redis_server::free_port(),
        common::redis_server::free_port(),
    );
    let redis_cert = ca.server("redis", "DNS:localhost");
    let _redis = common::tls::redis_server(port, tls_port, &redis_cert, &ca, "yes").await;
    let client = ca.client("gateway");
    let (_mock, upstream) = start_mock(0);
    let config = dir.path().join("fleetgate.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\n\
             database_url = \"{}\"\n\
             redis_url = \"rediss://127.0.0.1:{tls_port}\"\n\n\
             [redis_tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nserver_name = \"localhost\"\n\n\
             [[models]]\nid = \"llama-8b\"\n\n[[models.upstreams]]\nurl = \"{upstream}\"\ngpu = \"gpu-a\"\n",
            postgres.url(&format!(
                "sslmode=verify-full&sslrootcert={}",
                ca.cert.display()
            )),
            client.cert.display(),
            client.key.display(),
        ),
    )
    .unwrap();
    let secret = create_key(&config, "tls");

    let mut child = Command::new(FLEETGATE)
        .args(["serve", "--config"])
        .arg(&config)
        .env("SSL_CERT_FILE", &ca.cert)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let server = Proc(child);
    let url = format!(
        "http://{}",
        wait_for_line(stderr, "fleetgate".to_owned(), listening_address)
    );
    let body = serde_json::json!({"model": "llama-8b", "prompt": "Hi", "max_tokens": 2});
    let served = complete(&url, &secret, body).await;
    assert_eq!(served.status(), 200);
    served.bytes().await.unwrap();

    // Counted in Redis (the key's usage is the limiter's), and in PostgreSQL's ledger
    // (written behind, within milliseconds).
    let usage: serde_json::Value = reqwest::Client::new()
        .get(format!("{url}/v1/usage"))
        .bearer_auth(&secret)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let counted = usage["used"].as_u64().unwrap();
    assert!(counted > 0, "{usage}");
    let settled = std::time::Instant::now();
    loop {
        let ledger = fleetgate(&config, &["keys", "usage", &secret[..12], "--json"]);
        let ledger: serde_json::Value = serde_json::from_slice(&ledger.stdout).unwrap();
        if ledger["used_tokens"].as_u64() == Some(counted) {
            break;
        }
        assert!(
            settled.elapsed() < Duration::from_secs(5),
            "the ledger has {ledger}, Redis {counted}"
        );
    }
    assert!(terminate(server));
}
