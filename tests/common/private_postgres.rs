//! A private PostgreSQL server that speaks TLS, for the tests of `sslmode=verify-full`:
//! a fresh cluster in a temporary directory on a port of its own (the shared server
//! named by TEST_POSTGRES_URL is left alone), with a certificate a test CA signed,
//! stopped when dropped (also when the test fails). The binaries are the newest under
//! /usr/lib/postgresql; as root, they run as the `postgres` user, since initdb and
//! postgres refuse to run as root.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::redis_server::free_port;
use super::tls::Issued;

pub struct PrivatePostgres {
    bin: PathBuf,
    data: PathBuf,
    pub port: u16,
    _dir: tempfile::TempDir,
}

/// The newest PostgreSQL's binaries.
fn binaries() -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL's binaries under /usr/lib/postgresql")
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            let version = path.file_name()?.to_str()?.parse().ok()?;
            Some((version, path.join("bin")))
        })
        .collect();
    versions.sort();
    versions.pop().expect("a PostgreSQL version installed").1
}

fn is_root() -> bool {
    let id = Command::new("id").arg("-u").output().unwrap();
    String::from_utf8_lossy(&id.stdout).trim() == "0"
}

/// `program` of the PostgreSQL binaries, as the `postgres` user when run as root.
fn command(bin: &Path, program: &str) -> Command {
    let program = bin.join(program);
    if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

fn run(mut command: Command, what: &str) {
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

impl PrivatePostgres {
    /// Starts a server on 127.0.0.1 with `certificate` (TLS on; plain connections still
    /// accepted), user `postgres` trusted, and waits until it accepts connections.
    pub fn start(certificate: &Issued) -> Self {
        let bin = binaries();
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        // PostgreSQL wants its key readable by its owner only.
        let (cert, key) = (dir.path().join("server.crt"), dir.path().join("server.key"));
        std::fs::copy(&certificate.cert, &cert).unwrap();
        std::fs::copy(&certificate.key, &key).unwrap();
        if is_root() {
            run(
                {
                    let mut chown = Command::new("chown");
                    chown.args(["-R", "postgres:"]).arg(dir.path());
                    chown
                },
                "chown",
            );
        }
        run(
            {
                let mut chmod = Command::new("chmod");
                chmod.arg("600").arg(&key);
                chmod
            },
            "chmod",
        );
        let mut initdb = command(&bin, "initdb");
        initdb
            .args(["--auth=trust", "--username=postgres", "--no-sync", "-D"])
            .arg(&data);
        run(initdb, "initdb");

        let port = free_port();
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {port} -k {} -c ssl=on -c ssl_cert_file={} \
             -c ssl_key_file={} -c fsync=off",
            dir.path().display(),
            cert.display(),
            key.display()
        );
        let mut start = command(&bin, "pg_ctl");
        start
            .args(["start", "--wait", "--timeout=30", "-D"])
            .arg(&data)
            .arg("-l")
            .arg(dir.path().join("server.log"))
            .args(["-o", &options]);
        let server = Self {
            bin,
            data,
            port,
            _dir: dir,
        };
        run(start, "pg_ctl start");
        server
    }

    /// A URL of the `postgres` database as user `postgres`, with `params`.
    pub fn url(&self, params: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?{params}",
            self.port
        )
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let mut stop = command(&self.bin, "pg_ctl");
        stop.args(["stop", "--mode=immediate", "--wait", "-D"])
            .arg(&self.data);
        // Never panic here: this may run while a failed test is already unwinding.
        if let Err(e) = stop.output() {
            eprintln!("could not stop the private PostgreSQL: {e}");
        }
    }
}
