"""Starts mock-vllm and a real fleetgate (the built binaries) for the SDK suite.

Both listen on port 0; their addresses are read from what they print. The binaries come
from FLEETGATE_BIN_DIR (default: target/debug), built beforehand by `.ci/run`.
"""

import os
import re
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN_DIR = Path(os.environ.get("FLEETGATE_BIN_DIR", ROOT / "target" / "debug"))
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


@pytest.fixture(scope="session")
def gateway():
    with tempfile.TemporaryDirectory() as tmp:
        mock = subprocess.Popen(
            [str(BIN_DIR / "mock-vllm"), "--listen", "127.0.0.1:0",
             "--served-model-name", CHECKPOINT],
            stdout=subprocess.PIPE, text=True,
        )
        mock_url = _wait_for_line(mock.stdout, r"listening on (http://\S+)", mock, "mock-vllm").group(1)
        config = Path(tmp) / "fleetgate.toml"
        config.write_text(
            f'listen = "127.0.0.1:0"\n'
            f'database_url = "sqlite://{tmp}/fleetgate.db"\n'
            f'[[models]]\nid = "llama-8b"\ndefault = true\n'
            f'[[models.upstreams]]\nurl = "{mock_url}"\ngpu = "gpu-a"\n'
        )
        fleetgate = str(BIN_DIR / "fleetgate")
        created = subprocess.run(
            [fleetgate, "keys", "create", "--name", "sdk", "--config", str(config)],
            check=True, capture_output=True, text=True,
        )
        key = created.stdout.strip().splitlines()[-1]
        server = subprocess.Popen(
            [fleetgate, "serve", "--config", str(config)],
            stderr=subprocess.PIPE, text=True,
        )
        address = _wait_for_line(server.stderr, r"fleetgate listening.*?address=(\S+)", server, "fleetgate").group(1)
        try:
            yield {"base_url": f"http://{address}/v1", "key": key}
        finally:
            for proc in (server, mock):
                proc.terminate()
                proc.wait(timeout=10)
