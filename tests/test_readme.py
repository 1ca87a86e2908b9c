"""The README as a newcomer meets it: each Python snippet runs on its own, as written, from the
clone's root (a fresh interpreter per snippet, so none leans on another's names), and the
client snippet talks to a server started with the README's own command."""

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import require_module

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
SERVE_COMMAND = re.search(r"```bash\n(python -m mie serve --model \S+)\n```", README).group(1)
CLIENT_PORT = "http://127.0.0.1:8000"


def run_snippet(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_the_readme_has_its_snippets():
    assert len(SNIPPETS) >= 3
    assert sum(CLIENT_PORT in s for s in SNIPPETS) == 1


@pytest.mark.parametrize(
    "index", [i for i, s in enumerate(SNIPPETS) if CLIENT_PORT not in s], ids=lambda i: f"#{i}"
)
def test_each_offline_snippet_runs_alone_as_written(index):
    done = run_snippet(SNIPPETS[index])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()  # it printed what it generated


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_client_snippet_runs_against_the_readme_server_command(tmp_path):
    require_module("openai")
    httpx = require_module("httpx")
    require_module("starlette")
    # The README's command and snippet, on a free port instead of 8000 (which may be taken).
    port = free_port()
    command = [sys.executable, *SERVE_COMMAND.split()[1:], "--port", str(port)]
    (snippet,) = [s for s in SNIPPETS if CLIENT_PORT in s]
    snippet = snippet.replace(CLIENT_PORT, f"http://127.0.0.1:{port}")
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        done = run_snippet(snippet)
        assert done.returncode == 0, done.stderr
        completion, chat = done.stdout.splitlines()[:2]
        assert completion.strip() and chat.strip()
    finally:
        server.terminate()
        server.wait(30)
