//! TLS for the tests: a certificate authority of the test's own, made with the `openssl`
//! command (its certificate, and certificates it signs for servers and clients, as PEM
//! files in a directory of the test's: EC P-256 keys, valid for two days), and a
//! redis-server that speaks TLS with them.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::redis_server::RedisServer;

/// A CA: its certificate and key files.
pub struct TestCa {
    dir: PathBuf,
    pub cert: PathBuf,
    key: PathBuf,
}

/// A certificate the CA signed, and its key.
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn openssl(args: &[&str], dir: &Path) {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl on PATH");
    assert!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

const NEW_KEY: [&str; 4] = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"];

impl TestCa {
    /// A new CA named `name`, its files in `dir`.
    pub fn new(dir: &Path, name: &str) -> Self {
        let (cert, key) = (format!("{name}.pem"), format!("{name}.key"));
        let subject = format!("/CN={name}");
        let mut args = vec!["req", "-x509", "-nodes", "-days", "2"];
        args.extend(NEW_KEY);
        args.extend(["-keyout", &key, "-out", &cert, "-subj", &subject]);
        args.extend(["-addext", "basicConstraints=critical,CA:TRUE"]);
        args.extend(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]);
        openssl(&args, dir);
        Self {
            dir: dir.to_owned(),
            cert: dir.join(cert),
            key: dir.join(key),
        }
    }

    /// A server certificate for the names `alt_names` (`DNS:localhost,IP:127.0.0.1`).
    pub fn server(&self, name: &str, alt_names: &str) -> Issued {
        self.issue(
            name,
            &format!("subjectAltName={alt_names}\nextendedKeyUsage=serverAuth"),
        )
    }

    /// A client certificate (mutual TLS).
    pub fn client(&self, name: &str) -> Issued {
        self.issue(name, "extendedKeyUsage=clientAuth")
    }

    fn issue(&self, name: &str, extensions: &str) -> Issued {
        let (cert, key, request, ext) = (
            format!("{name}.pem"),
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.ext"),
        );
        std::fs::write(
            self.dir.join(&ext),
            format!("basicConstraints=CA:FALSE\n{extensions}\n"),
        )
        .unwrap();
        let subject = format!("/CN={name}");
        let mut args = vec!["req", "-new", "-nodes"];
        args.extend(NEW_KEY);
        args.extend(["-keyout", &key, "-out", &request, "-subj", &subject]);
        openssl(&args, &self.dir);
        let (ca_cert, ca_key) = (self.cert.to_str().unwrap(), self.key.to_str().unwrap());
        openssl(
            &[
                "x509",
                "-req",
                "-in",
                &request,
                "-CA",
                ca_cert,
                "-CAkey",
                ca_key,
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &ext,
                "-out",
                &cert,
            ],
            &self.dir,
        );
        Issued {
            cert: self.dir.join(cert),
            key: self.dir.join(key),
        }
    }
}

/// A redis-server listening with TLS on `tls_port` with `certificate`, trusting client
/// certificates signed by `ca`; `auth_clients` is `--tls-auth-clients` (`yes`: a client
/// must present one). Plain TCP on `port` stays, for the tests' own looks.
pub async fn redis_server(
    port: u16,
    tls_port: u16,
    certificate: &Issued,
    ca: &TestCa,
    auth_clients: &str,
) -> RedisServer {
    let path = |p: &Path| p.to_str().unwrap().to_owned();
    let tls_port = tls_port.to_string();
    let (cert, key, ca) = (
        path(&certificate.cert),
        path(&certificate.key),
        path(&ca.cert),
    );
    let args = [
        "--tls-port",
        &tls_port,
        "--tls-cert-file",
        &cert,
        "--tls-key-file",
        &key,
        "--tls-ca-cert-file",
        &ca,
        "--tls-auth-clients",
        auth_clients,
    ];
    RedisServer::start_with(port, &args, &format!("redis://127.0.0.1:{port}")).await
}
