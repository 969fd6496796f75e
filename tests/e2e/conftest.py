"""Starts mock-vllm and a real fleetgate (the built binaries) for the SDK suite.

Both listen on port 0; their addresses are read from what they print. The binaries come
from E2E_BIN_DIR (default: target/debug), built beforehand by `.ci/run`.
"""

import os
import re
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN_DIR = Path(os.environ.get("E2E_BIN_DIR", ROOT / "target" / "debug"))
STARTUP_TIMEOUT_S = 30
CHECKPOINT = "meta-llama/Llama-3.1-8B"


def _wait_for_line(stream, pattern, proc, what):
    """Reads lines from `stream` until one matches `pattern`; returns the match."""
    found = {}

    def reader():
        for line in stream:
            match = re.search(pattern, line)
            if match and "match" not in found:
                found["match"] = match
                done.set()
        done.set()

    done = threading.Event()
    threading.Thread(target=reader, daemon=True).start()
    if not done.wait(STARTUP_TIMEOUT_S) or "match" not in found:
        proc.kill()
        raise RuntimeError(f"{what} did not report its address")
    return found["match"]


def _start_mock(*extra_args):
    """A mock-vllm process on a free port: (process, url)."""
    mock = subprocess.Popen(
        [str(BIN_DIR / "mock-vllm"), "--listen", "127.0.0.1:0",
         "--served-model-name", CHECKPOINT, *extra_args],
        stdout=subprocess.PIPE, text=True,
    )
    return mock, _wait_for_line(mock.stdout, r"listening on (http://\S+)", mock, "mock-vllm").group(1)


# Non-streaming requests get WINDOW_S seconds upstream; at FAST_RATE tokens/s that is
# WINDOW_S * FAST_RATE tokens. The "slow" model's node decodes far slower than its
# configured rate claims, so a request that fits on paper overruns the window.
WINDOW_S = 2
FAST_RATE = 100
DEADLINE_FIT = WINDOW_S * FAST_RATE


@pytest.fixture(scope="session")
def gateway():
    with tempfile.TemporaryDirectory() as tmp:
        mock, mock_url = _start_mock()
        slow_mock, slow_url = _start_mock("--token-delay-ms", "50")
        config = Path(tmp) / "fleetgate.toml"
        config.write_text(
            f'listen = "127.0.0.1:0"\n'
            f'database_url = "sqlite://{tmp}/fleetgate.db"\n'
            f'[fleet]\nrequest_window_ms = {WINDOW_S * 1000}\n'
            f'[[models]]\nid = "llama-8b"\ndefault = true\ndecode_tokens_per_second = {FAST_RATE}\n'
            f'[[models.upstreams]]\nurl = "{mock_url}"\ngpu = "gpu-a"\n'
            f'[[models]]\nid = "slow"\ndecode_tokens_per_second = {FAST_RATE}\n'
            f'[[models.upstreams]]\nurl = "{slow_url}"\ngpu = "gpu-slow"\n'
        )
        fleetgate = str(BIN_DIR / "fleetgate")
        created = subprocess.run(
            [fleetgate, "keys", "create", "--name", "sdk", "--config", str(config)],
            capture_output=True, text=True,
        )
        assert created.returncode == 0, created.stderr
        key = created.stdout.strip().splitlines()[-1]
        server = subprocess.Popen(
            [fleetgate, "serve", "--config", str(config)],
            stderr=subprocess.PIPE, text=True,
        )
        address = _wait_for_line(server.stderr, r"fleetgate listening.*?address=(\S+)", server, "fleetgate").group(1)
        try:
            yield {"base_url": f"http://{address}/v1", "root": f"http://{address}", "key": key}
        finally:
            for proc in (server, mock, slow_mock):
                proc.terminate()
                proc.wait(timeout=10)
