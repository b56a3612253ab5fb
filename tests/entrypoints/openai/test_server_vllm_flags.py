"""A vLLM launch script runs: one dedicated server started with vLLM's flags (some from a
`--config` YAML file, some in underscore spelling), over TLS behind a root path, at DEBUG with a
short stats interval. Each flag works or logs at start-up that it has no effect."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ferrum.default_model import DEFAULT_MODEL_NAME
from tests.utils.remote_server import API_KEY, RemoteServer

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


class _TLSServer(RemoteServer):
    """A RemoteServer reached over https, trusting its self-signed certificate."""

    cert: Path

    def wait_healthy(self, timeout: float) -> None:
        self.url = self.url.replace("http://", "https://")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if self.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy in {timeout} s:\n{self.log()}")

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, verify=self.context(), timeout=30)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(
            self.url + path, json=body, headers=self.headers, verify=self.context(), timeout=60
        )

    def context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.cert))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_TLSServer]:
    folder = tmp_path_factory.mktemp("vllm_flags")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    config = folder / "config.yaml"
    config.write_text(
        "max-model-len: 256\nenable-chunked-prefill: true\ntrust_remote_code: true\n"
        f"ssl-keyfile: {key}\nssl-certfile: {cert}\nroot-path: /api\n"
    )
    _TLSServer.cert = cert
    args = ["--config", str(config), "--max_logprobs", "2", "--cpu-offload-gb", "0"]
    args += ["--swap-space", "4", "--max-seq-len-to-capture", "8192", "-O3"]
    args += ["--tokenizer-mode", "auto", "--generation-config", "vllm"]
    args += ["--enable-log-requests", "--max-log-len", "30"]
    args += ["--response-role", "bot", "--return-tokens-as-token-ids"]
    args += ["--max-request-body-bytes", "65536", "--timeout-request-body", "1"]
    env = {"FERRUM_LOGGING_LEVEL": "DEBUG", "FERRUM_LOG_STATS_INTERVAL": "0.2"}
    remote = _TLSServer(args, folder / "server.log", env=env, api_key=API_KEY)
    yield remote
    assert remote.stop() == 0, remote.log()


def test_no_op_flags_say_so_at_start_up(tls_server: _TLSServer) -> None:
    log = tls_server.log_path.read_text()
    for name in (
        "enable_chunked_prefill",
        "cpu_offload_gb",
        "swap_space",
        "trust_remote_code",
        "max_seq_len_to_capture",
        "optimization_level 3 (-O3)",
    ):
        assert f"{name}: has no effect" in log, name
    assert "ready: serving at https://127.0.0.1:" in log and "/api/v1" in log


def test_tls_and_the_root_path(tls_server: _TLSServer) -> None:
    assert tls_server.get("/api/v1/models").json()["data"][0]["id"] == DEFAULT_MODEL_NAME
    assert tls_server.get("/v1/models").status_code == 200
    assert tls_server.get("/api/ping").status_code == 200
    plain = tls_server.url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(plain + "/health", timeout=5)


def test_max_logprobs(tls_server: _TLSServer) -> None:
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "logprobs": 3}
    response = tls_server.post("/api/v1/completions", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "logprobs"
    assert "max_logprobs=2" in response.json()["error"]["message"]
    response = tls_server.post("/v1/completions", body | {"logprobs": 2})
    assert response.status_code == 200
    # The top 2, and the sampled token when it is not among them.
    assert 2 <= len(response.json()["choices"][0]["logprobs"]["top_logprobs"][0]) <= 3


def test_debug_request_lines_and_the_stats_line(tls_server: _TLSServer) -> None:
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8}
    assert tls_server.post("/v1/completions", body).status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        log = tls_server.log_path.read_text()
        if "finished request cmpl-" in log and "Avg prompt throughput" in log:
            break
        time.sleep(0.2)
    assert "INFO" in log and 'request to /v1/completions: {"model": "ferrum-tiny-q' in log
    assert "generated, length" in log
    assert "Running: " in log and "KV cache usage: " in log and "Prefix cache hit rate: " in log


def test_response_role_and_tokens_as_token_ids(tls_server: _TLSServer) -> None:
    body = {
        "model": DEFAULT_MODEL_NAME,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 1,
    }
    choice = tls_server.post("/v1/chat/completions", body).json()["choices"][0]
    assert choice["message"]["role"] == "bot"
    (entry, *_) = choice["logprobs"]["content"]
    assert entry["token"].startswith("token_id:") and int(entry["token"][9:]) >= 0
    assert entry["top_logprobs"][0]["token"].startswith("token_id:")
    events = tls_server.post("/v1/chat/completions", body | {"stream": True}).text.split("\n\n")
    assert '"delta":{"role":"bot","content":""}' in events[0]
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "logprobs": 1}
    logprobs = tls_server.post("/v1/completions", body).json()["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in logprobs["tokens"])
    assert all(k.startswith("token_id:") for top in logprobs["top_logprobs"] for k in top)


def test_a_stalled_body_over_tls_is_cut_and_closed(tls_server: _TLSServer) -> None:
    # TLS has no half-close: the 408 goes out and the connection closes (no lingering read).
    host, port = tls_server.url.removeprefix("https://").split(":")
    raw = socket.create_connection((host, int(port)), timeout=30)
    with tls_server.context().wrap_socket(raw, server_hostname=host) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: 1000\r\n\r\n".encode()
            + b'{"a'
        )
        answer = b""
        while chunk := conn.recv(65536):  # ends when the server closes
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert "NotImplementedError" not in tls_server.log_path.read_text()
