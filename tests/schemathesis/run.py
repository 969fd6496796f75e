#!/usr/bin/env python3
"""Schema-driven fuzzing of a real fleetgate: schemathesis against its /openapi.json.

Starts the built binaries (mock-vllm, then fleetgate in front of it, both on port 0,
SQLite in a temporary directory), creates a user API key with `fleetgate keys create`
and sets an admin token in the config, as docs/operations.md says. Then runs schemathesis
twice over the served document: first every operation except the admin ones (with the
user key), then the admin operations (with the admin token) — in that order, so that
the admin run may revoke or limit any key, the user key included, without affecting
the user run. With --postgres, the same again on a fleetgate whose store is a fresh
PostgreSQL database. Finally stops the processes (fleetgate with SIGTERM, which must
exit 0) and fails if a check failed, schemathesis reported an error, the run overran
its time cap, or the gateway logged a panic.

Needs Python 3 with schemathesis (tests/schemathesis/requirements.txt), the binaries
from `cargo build --bins` (in $CARGO_TARGET_DIR/debug, or --bin-dir) and, for
--postgres, `psql`.
"""

import argparse
import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STARTUP_TIMEOUT_S = 30
STOP_TIMEOUT_S = 30

# Every check whose verdict the document decides: no 5xx, every status, content type
# and body as documented.
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
]

# (name, schemathesis options): the user run first, then the admin run (see above). The
# stateful phase follows the document's links, which only the admin operations have.
RUNS = [
    ("user", ["--exclude-tag", "admin", "--phases", "examples,coverage,fuzzing"]),
    ("admin", ["--include-tag", "admin", "--phases", "examples,coverage,fuzzing,stateful"]),
]


def parse_args():
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", type=Path, default=target / "debug",
                        help="where fleetgate and mock-vllm are (default: $CARGO_TARGET_DIR/debug)")
    parser.add_argument("--max-examples", type=int, default=40,
                        help="test cases per operation and phase (default: 40)")
    parser.add_argument("--seed", default="20260101",
                        help="hypothesis seed, or 'random' (default: a fixed seed, so CI runs repeat)")
    parser.add_argument("--workers", type=int, default=2, help="schemathesis workers (default: 2)")
    parser.add_argument("--time-cap", type=float, default=170,
                        help="seconds all runs may take together; past it the run is stopped and fails (default: 170)")
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"schemathesis checks (default: {','.join(CHECKS)})")
    parser.add_argument("--postgres", metavar="SERVER_URL",
                        help="also fuzz a fleetgate on a fresh database of this PostgreSQL server "
                             "(e.g. postgres://postgres@127.0.0.1:5432/postgres), dropped afterwards")
    parser.add_argument("--report-dir", type=Path, default=ROOT / "target" / "schemathesis-report",
                        help="where schemathesis writes its JSON and JUnit reports")
    parser.add_argument("schemathesis_args", nargs=argparse.REMAINDER,
                        help="after --: more `schemathesis run` options for both runs (e.g. --continue-on-failure)")
    args = parser.parse_args()
    if args.schemathesis_args[:1] == ["--"]:
        args.schemathesis_args = args.schemathesis_args[1:]
    return args


class LineWatcher:
    """Copies a child's pipe line by line to a log file; `wait` returns the first match."""

    def __init__(self, pipe, log_path, pattern):
        self.pattern = re.compile(pattern)
        self.match = None
        self.found = threading.Event()
        self.log_path = log_path
        self.panicked = False
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe):
        with open(self.log_path, "w", encoding="utf-8") as log:
            for line in pipe:
                log.write(line)
                log.flush()
                if "panicked" in line:
                    self.panicked = True
                if self.match is None:
                    match = self.pattern.search(line)
                    if match:
                        self.match = match
                        self.found.set()
        self.found.set()

    def wait(self, proc, what):
        if not self.found.wait(STARTUP_TIMEOUT_S) or self.match is None:
            proc.kill()
            raise RuntimeError(f"{what} did not report its address; its output: {self.log_path}")
        return self.match.group(1)

    def tail(self, lines=30):
        """The last lines logged, but the one `request finished` line of every request."""
        self.thread.join(timeout=5)
        text = Path(self.log_path).read_text(encoding="utf-8", errors="replace").splitlines()
        return "\n".join([line for line in text if "request finished" not in line][-lines:])


def start(argv, pipe_name, log_path, pattern, what):
    kwargs = {"stdout": subprocess.PIPE} if pipe_name == "stdout" else {"stderr": subprocess.PIPE}
    proc = subprocess.Popen(argv, text=True, encoding="utf-8", errors="replace", **kwargs)
    watcher = LineWatcher(getattr(proc, pipe_name), log_path, pattern)
    return proc, watcher, watcher.wait(proc, what)


def wait_healthy(url):
    """Polls GET /health until the model's node is up (the prober's first round)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                health = json.load(resp)
                if health["status"] == "ok":
                    return
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health not ok within {STARTUP_TIMEOUT_S} s")
        time.sleep(0.1)  # polling with a deadline, not synchronisation


def write_config(tmp, name, database_url, mock_url, admin_token):
    # Limits far above what the fuzz load reaches, so that no operation is refused for
    # rate, concurrency or budget (429 is documented, but would hide what comes after
    # admission). The request window stays at its default.
    config = tmp / f"fleetgate-{name}.toml"
    config.write_text(
        f'listen = "127.0.0.1:0"\n'
        f'database_url = "{database_url}"\n'
        f'admin_token = "{admin_token}"\n'
        f'shutdown_grace_ms = 5000\n'
        f'[limits]\n'
        f'monthly_budget = 1000000000000\n'
        f'requests_per_minute = 1000000\n'
        f'max_concurrent = 1000\n'
        f'max_queued = 1000\n'
        f'[[models]]\nid = "llama-8b"\ndefault = true\n'
        f'[[models.upstreams]]\nurl = "{mock_url}"\ngpu = "gpu-a"\n',
        encoding="utf-8",
    )
    return config


class FreshPostgres:
    """A database of its own on the PostgreSQL server `server_url` names (created and
    dropped with `psql`); entering it gives its URL."""

    def __init__(self, server_url):
        self.server_url = server_url
        self.name = f"fleetgate_schemathesis_{secrets.token_hex(6)}"
        self.url = urllib.parse.urlsplit(server_url)._replace(path=f"/{self.name}").geturl()

    def _psql(self, sql):
        subprocess.run(["psql", self.server_url, "-q", "-v", "ON_ERROR_STOP=1", "-c", sql],
                       check=True, stdout=subprocess.DEVNULL)

    def __enter__(self):
        self._psql(f'CREATE DATABASE "{self.name}"')
        return self.url

    def __exit__(self, *_):
        self._psql(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def schemathesis_run(name, filters, url, args, env, deadline):
    """One schemathesis run; returns (ok, test cases generated, of them failed, summary line)."""
    report = args.report_dir / f"{name}.json"
    report.unlink(missing_ok=True)
    argv = [
        sys.executable, "-m", "schemathesis.cli",
        "--config-file", str(HERE / "schemathesis.toml"),
        "run", f"{url}/openapi.json",
        "--checks", args.checks,
        "--max-examples", str(args.max_examples),
        "--workers", str(args.workers),
        "--request-timeout", "30",
        "--generation-database", "none",
        "--suppress-health-check", "too_slow",
        "--report", "json,junit",
        "--report-dir", str(args.report_dir),
        "--report-json-path", str(report),
        "--report-junit-path", str(args.report_dir / f"{name}.xml"),
        "--no-color",
        *filters,
        *args.schemathesis_args,
    ]
    if args.seed != "random":
        argv += ["--seed", str(args.seed)]
    print(f"\n--- schemathesis, {name}: {' '.join(argv[3:])}", flush=True)
    started = time.monotonic()
    # Its crash store (`.schemathesis/`) goes beside the reports, not into the work tree.
    proc = subprocess.Popen(argv, env=env, cwd=args.report_dir)
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False, 0, 0, f"{name}: stopped at the time cap ({args.time_cap:.0f} s)"
    elapsed = time.monotonic() - started
    if not report.exists():
        return False, 0, 0, f"{name}: schemathesis exited {code} without a report"
    doc = json.loads(report.read_text(encoding="utf-8"))
    cases = doc["test_cases"]["generated"]
    failed_cases = doc["test_cases"]["with_failures"] + doc["test_cases"]["errored"]
    ops = doc["operations"]
    failures = sum(group["count"] for group in doc["failures"])
    errors = sum(group["count"] for group in doc["errors"])
    ok = code == 0 and not failures and not errors and ops["errored"] == 0
    line = (f"{name}: {ops['tested']} of {ops['selected']} operations, {cases} test cases, "
            f"{failures} failures, {errors} errors, exit {code}, {elapsed:.1f} s")
    return ok, cases, failed_cases, line


def stop(proc, what, sig, problems):
    """Stops `proc` with `sig`; a clean stop is exit status 0."""
    if proc.poll() is not None:
        problems.append(f"{what} had already exited ({proc.returncode})")
        return
    proc.send_signal(sig)
    try:
        code = proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        problems.append(f"{what} did not stop within {STOP_TIMEOUT_S} s of {signal.Signals(sig).name}")
        return
    if code != 0:
        problems.append(f"{what} exited {code} on {signal.Signals(sig).name}")


def fuzz_backend(backend, database_url, tmp, mock_url, args, deadline, problems, summaries):
    """A fleetgate on `database_url` in front of the mock, fuzzed by both runs; returns
    (test cases, of them failed)."""
    fleetgate = str(args.bin_dir / "fleetgate")
    admin_token = secrets.token_urlsafe(32)
    config = write_config(tmp, backend, database_url, mock_url, admin_token)
    created = subprocess.run(
        [fleetgate, "keys", "create", "--name", "schemathesis", "--config", str(config)],
        capture_output=True, text=True, check=False,
    )
    if created.returncode != 0:
        raise RuntimeError(f"keys create failed: {created.stderr}")
    user_key = created.stdout.strip().splitlines()[-1]
    server, gateway_log, address = start(
        [fleetgate, "serve", "--config", str(config)],
        "stderr", tmp / f"fleetgate-{backend}.log", r"fleetgate listening.*?address=(\S+)", "fleetgate")
    found = len(problems)
    cases = failed = 0
    try:
        url = f"http://{address}"
        wait_healthy(url)
        env = {**os.environ,
               "FLEETGATE_FUZZ_USER_KEY": user_key,
               "FLEETGATE_FUZZ_ADMIN_TOKEN": admin_token}
        for run, filters in RUNS:
            ok, run_cases, run_failed, line = schemathesis_run(
                f"{run}-{backend}", filters, url, args, env, deadline)
            cases += run_cases
            failed += run_failed
            summaries.append(line)
            if not ok:
                problems.append(line)
    finally:
        stop(server, f"fleetgate ({backend})", signal.SIGTERM, problems)
    if gateway_log.panicked:
        problems.append(f"fleetgate ({backend}) logged a panic")
    if len(problems) > found:
        print(f"\n--- fleetgate ({backend}): the last lines it logged, but `request finished`\n"
              + gateway_log.tail(), flush=True)
    return cases, failed


def main():
    args = parse_args()
    for binary in ("fleetgate", "mock-vllm"):
        if not (args.bin_dir / binary).exists():
            sys.exit(f"{args.bin_dir / binary} not found: run `cargo build --bins` first (or pass --bin-dir)")
    args.report_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    deadline = started + args.time_cap
    problems, summaries, total_cases, total_failed = [], [], 0, 0

    with tempfile.TemporaryDirectory(prefix="fleetgate-schemathesis-") as tmp_name:
        tmp = Path(tmp_name)
        # A small vocabulary keeps full-vocabulary prompt_logprobs (-1) bodies small.
        mock, _, mock_url = start(
            [str(args.bin_dir / "mock-vllm"), "--listen", "127.0.0.1:0", "--vocab-size", "512"],
            "stdout", tmp / "mock-vllm.log", r"listening on (http://\S+)", "mock-vllm")
        try:
            backends = [("sqlite", contextlib.nullcontext(f"sqlite://{tmp}/fleetgate.db"))]
            if args.postgres:
                backends.append(("postgres", FreshPostgres(args.postgres)))
            for backend, database in backends:
                with database as database_url:
                    cases, failed = fuzz_backend(backend, database_url, tmp, mock_url,
                                                 args, deadline, problems, summaries)
                total_cases += cases
                total_failed += failed
        except RuntimeError as err:  # a process that did not start, or not in time
            problems.append(str(err))
        finally:
            stop(mock, "mock-vllm", signal.SIGINT, problems)  # it waits for Ctrl-C

    print("\n=== schema-driven fuzzing")
    for line in summaries:
        print(f"  {line}")
    print(f"  {total_cases} test cases in {time.monotonic() - started:.1f} s "
          f"(checks: {args.checks}; seed {args.seed}; reports in {args.report_dir})")
    for problem in problems:
        print(f"  FAILED: {problem}")
    print(f"schemathesis: {total_cases - total_failed} passed, {total_failed} failed")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
