"""LoRA adapters through a live server: `--lora-modules` at start-up, the request's `model`
picking the adapter (greedy tokens equal transformers + PEFT), `/v1/models` listing adapters with
their parent, `POST /v1/load_lora_adapter` / `unload_lora_adapter` behind the API key while
streams run, and bad adapter folders answered with 400s (never a 5xx)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ferrum.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME
from tests.utils.lora_adapters import make_peft_adapter, peft_greedy
from tests.utils.remote_server import API_KEY, RemoteServer

PROMPT = [9, 81, 23, 40, 5, 77, 12]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server_adapters")
    return {
        "sql": make_peft_adapter(DEFAULT_MODEL_DIR, root / "sql", rank=4, seed=1),
        "chat": make_peft_adapter(
            DEFAULT_MODEL_DIR, root / "chat", rank=8, seed=2, targets=("q_proj", "down_proj")
        ),
    }


@pytest.fixture(scope="module")
def lora_server(
    adapters: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("lora_server") / "server.log"
    args = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-model-len", "256"]
    args.append("--return-tokens-as-token-ids")
    sql = {"name": "sql", "path": adapters["sql"], "base_model_name": DEFAULT_MODEL_NAME}
    remote = RemoteServer([*args, "--lora-modules", json.dumps(sql)], log, api_key=API_KEY)
    yield remote
    assert remote.stop() == 0, remote.log()


def _post(server: RemoteServer, route: str, body: dict, key: bool = True) -> httpx.Response:
    headers = server.headers if key else {}
    return httpx.post(server.url + route, json=body, headers=headers, timeout=120)


def _greedy_ids(server: RemoteServer, model: str) -> list[int]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_adapters_are_listed_and_picked_by_model(lora_server, adapters) -> None:
    models = httpx.get(lora_server.url + "/v1/models", headers=lora_server.headers).json()
    cards = {card["id"]: card for card in models["data"]}
    assert cards["sql"]["parent"] == DEFAULT_MODEL_NAME and cards["sql"]["root"] == adapters["sql"]
    assert cards[DEFAULT_MODEL_NAME]["parent"] is None
    assert (
        _greedy_ids(lora_server, "sql")
        == peft_greedy(DEFAULT_MODEL_DIR, adapters["sql"], [PROMPT], MAX_TOKENS)[0]
    )
    assert (
        _greedy_ids(lora_server, DEFAULT_MODEL_NAME)
        == peft_greedy(DEFAULT_MODEL_DIR, None, [PROMPT], MAX_TOKENS)[0]
    )
    chat = {"model": "sql", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    assert _post(lora_server, "/v1/chat/completions", chat).status_code == 200
    response = _post(lora_server, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert response.status_code == 404 and "'sql'" in response.json()["error"]["message"]


def test_load_and_unload_while_streams_run(lora_server, adapters) -> None:
    body = {"lora_name": "chat", "lora_path": adapters["chat"]}
    assert _post(lora_server, "/v1/load_lora_adapter", body, key=False).status_code == 401
    stream_body = {"prompt": "Once upon a time", "max_tokens": 24, "stream": True}

    def stream(model: str) -> str:
        with httpx.stream(
            "POST",
            lora_server.url + "/v1/completions",
            json=stream_body | {"model": model},
            headers=lora_server.headers,
            timeout=120,
        ) as response:
            assert response.status_code == 200
            return "".join(response.iter_text())

    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream, m) for m in ("sql", DEFAULT_MODEL_NAME) * 2]
        seen = set()
        for _ in range(50):  # the metric names the adapters of requests in flight
            text = httpx.get(lora_server.url + "/metrics", headers=lora_server.headers).text
            line = next(x for x in text.splitlines() if x.startswith("ferrum:lora_requests_info"))
            seen.add('running_lora_adapters="sql"' in line and 'max_lora="2"' in line)
            if True in seen or all(s.done() for s in streams):
                break
        loaded = _post(lora_server, "/v1/load_lora_adapter", body)
        assert loaded.status_code == 200, loaded.text
        assert (
            _greedy_ids(lora_server, "chat")
            == peft_greedy(DEFAULT_MODEL_DIR, adapters["chat"], [PROMPT], MAX_TOKENS)[0]
        )
        # The same name, other files: load_inplace swaps them in (new id, no stale cache).
        again = body | {"lora_path": adapters["sql"], "load_inplace": True}
        assert _post(lora_server, "/v1/load_lora_adapter", again).status_code == 200
        assert _greedy_ids(lora_server, "chat") == _greedy_ids(lora_server, "sql")
        unload = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "chat"})
        assert unload.status_code == 200, unload.text
        assert all(s.result().rstrip().endswith("data: [DONE]") for s in streams)
    assert True in seen
    assert _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 404
    response = _post(lora_server, "/v1/completions", {"model": "chat", "prompt": "x"})
    assert response.status_code == 404


def test_bad_adapters_are_400s(lora_server, adapters, tmp_path) -> None:
    dora = tmp_path / "dora"
    shutil.copytree(adapters["sql"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    broken = tmp_path / "broken"
    shutil.copytree(adapters["sql"], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 3)
    for name, path, message in (
        ("dora", str(dora), "DoRA adapters are not supported"),
        ("broken", str(broken), "not a safetensors file"),
        ("missing", str(tmp_path / "nowhere"), "not a folder"),
        ("sql", adapters["sql"], "'sql' is already served"),
        (DEFAULT_MODEL_NAME, adapters["sql"], "is already served"),
    ):
        response = _post(
            lora_server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}
        )
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
    response = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert response.status_code == 400  # lora_path missing


def test_bench_serve_spreads_requests_over_adapters(lora_server, tmp_path) -> None:
    from ferrum.entrypoints.cli import main as cli_main

    result_file = tmp_path / "lora.json"
    code = cli_main(
        [
            "bench", "serve", "--base-url", lora_server.url, "--api-key", API_KEY,
            "--model", DEFAULT_MODEL_NAME, "--tokenizer", DEFAULT_MODEL_DIR,
            "--lora-modules", "sql", DEFAULT_MODEL_NAME,
            "--num-prompts", "6", "--random-input-len", "12", "--random-output-len", "4",
            "--max-concurrency", "3", "--disable-tqdm", "--result-filename", str(result_file),
        ]
    )  # fmt: skip
    result = json.loads(result_file.read_text())
    assert code == 0 and result["completed"] == 6 and result["failed"] == 0


def test_lora_modules_flag_forms() -> None:
    import argparse

    from ferrum.entrypoints.openai.lora_args import parse_lora_module

    assert parse_lora_module("a=/x/y") == ("a", "/x/y", None)
    assert parse_lora_module('{"name": "a", "path": "/x", "base_model_name": "m"}') == (
        "a",
        "/x",
        "m",
    )
    for bad in ("a", "=x", '{"name": "a"}', '{"name": "a", "path": "/x", "rank": 8}'):
        with pytest.raises(argparse.ArgumentTypeError, match="invalid LoRA module"):
            parse_lora_module(bad)
