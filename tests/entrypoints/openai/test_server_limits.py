"""One client's huge request costs the others nothing: bodies over the limit get 413 before they
are parsed, prompts that cannot fit get 400 before they are tokenized, and the tokenizer works
off the event loop, so /health and running streams are served meanwhile."""

from __future__ import annotations

import json
import select
import socket
import threading

import httpx

from ferrum.default_model import DEFAULT_MODEL_NAME
from ferrum.entrypoints.openai.http_limits import HttpLimits
from tests.utils.remote_server import RemoteServer

DEFAULT_LIMIT = HttpLimits().max_request_body_bytes


def test_body_over_the_limit_is_413_naming_it(server: RemoteServer) -> None:
    huge = json.dumps({"prompt": "x" * DEFAULT_LIMIT}).encode()
    headers = {**server.headers, "Content-Type": "application/json"}
    for path in ("/tokenize", "/v1/completions"):
        response = httpx.post(server.url + path, content=huge, headers=headers, timeout=60)
        assert response.status_code == 413, response.text
        message = response.json()["error"]["message"]
        assert (
            f"limit of {DEFAULT_LIMIT} bytes" in message and "--max-request-body-bytes" in message
        )


def test_prompt_that_cannot_fit_is_400_before_tokenizing(server: RemoteServer) -> None:
    prompt = "word " * 200_000
    for path, body in (
        ("/v1/completions", {"prompt": prompt, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}),
        ("/tokenize", {"prompt": prompt}),
    ):
        response = httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)
        assert response.status_code == 400, response.text
        assert "1000000 characters cannot fit in max_model_len=512" in response.text


def _stream(server: RemoteServer, chunks: list[str]) -> None:
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "Once", "max_tokens": 64, "ignore_eos": True}
    body["stream"] = True
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=120
    ) as response:
        chunks.extend(response.iter_lines())


def test_huge_detokenize_leaves_health_and_streams_served(server: RemoteServer) -> None:
    ids = httpx.post(
        server.url + "/tokenize",
        json={"prompt": "hello world", "add_special_tokens": False},
        headers=server.headers,
        timeout=10,
    ).json()["tokens"]
    repeats = 1_000_000 // len(ids)
    body = json.dumps({"tokens": ids * repeats}).encode()
    assert len(body) < DEFAULT_LIMIT
    chunks: list[str] = []
    streamer = threading.Thread(target=_stream, args=(server, chunks))
    streamer.start()
    with socket.create_connection(("127.0.0.1", server.port)) as big:
        big.settimeout(120)
        head = (
            f"POST /detokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        big.sendall(head.encode() + body)
        # The whole body is sent: decoding it takes the server about half a second. /health
        # answers before the first byte of that answer (a blocked event loop answers after it).
        assert httpx.get(server.url + "/health", timeout=120).status_code == 200
        readable, _, _ = select.select([big], [], [], 0)
        assert not readable, "the huge request finished before /health was answered"
        answer = b""
        while not answer.endswith(b"}"):
            chunk = big.recv(1 << 20)
            assert chunk, answer[:200]
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200")
    text = json.loads(answer.partition(b"\r\n\r\n")[2])["prompt"]
    assert text == "hello world" * repeats
    streamer.join(120)
    assert "data: [DONE]" in chunks and not any('"error"' in chunk for chunk in chunks)
