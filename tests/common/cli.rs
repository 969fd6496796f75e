//! The `fleetgate` command's key management, run as a child process against a config.

use std::path::Path;
use std::process::Command;

use super::processes::FLEETGATE;

/// `fleetgate keys create --name NAME`: the secret, alone on the last line of stdout.
pub fn create_key(config: &Path, name: &str) -> String {
    create_key_with(config, name, &[])
}

/// [`create_key`] with more flags (limits).
pub fn create_key_with(config: &Path, name: &str, flags: &[&str]) -> String {
    let mut args = vec!["keys", "create", "--name", name];
    args.extend_from_slice(flags);
    let created = fleetgate(config, &args);
    let stdout = String::from_utf8(created.stdout).unwrap();
    stdout.trim_end().lines().last().unwrap().to_owned()
}

/// `fleetgate ARGS --config CONFIG`, which must succeed.
pub fn fleetgate(config: &Path, args: &[&str]) -> std::process::Output {
    let output = Command::new(FLEETGATE)
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}
