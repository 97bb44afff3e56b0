"""Token-exact 413 admission in front of real emulated engines: the boundary, parity with the engine's count, and
the promise that a refused prompt never reaches an engine."""

from __future__ import annotations

import gzip
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.admission.chat_template import ChatTemplate
from gateway.admission.tokenizer import ModelTokenizer
from loadtests.engine.harness import EnginePair
from tests.engine_records import generation_records
from tests.gateway_harness import (
    GLM5_TEMPLATE,
    GLM5_TOKENIZER,
    RunningGateway,
    model_entry,
    running_gateway,
    write_config,
)

LIMIT = 3000


@pytest.fixture(scope="module")
def pair(glm_pair: EnginePair) -> EnginePair:
    return glm_pair


@pytest.fixture(scope="module")
def gateway(pair: EnginePair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    config = write_config(tmp_path_factory.mktemp("gw"), [
        model_entry("glm-5", [pair.prefill], [pair.decode], max_prompt_tokens=LIMIT, default_max_tokens=4)])
    with running_gateway(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(gateway: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def tokenizer(glm_tokenizer: ModelTokenizer) -> ModelTokenizer:
    return glm_tokenizer


def _chat_of_exactly(tokens: int, tokenizer: ModelTokenizer) -> list[dict[str, str]]:
    """A one-message chat whose rendered prompt is exactly `tokens` tokens (" hello" is one GLM token)."""
    template = ChatTemplate.for_tokenizer(GLM5_TOKENIZER, GLM5_TEMPLATE)

    def count(words: int) -> int:
        rendered = template.render([{"role": "user", "content": "hello" + " hello" * words}])
        return len(tokenizer.tokenizer.encode(rendered, add_special_tokens=False).ids)

    words = tokens - count(0)
    assert count(words) == tokens
    return [{"role": "user", "content": "hello" + " hello" * words}]


def _engine_request_count(pair: EnginePair) -> int:
    return len(generation_records(pair.prefill)) + len(generation_records(pair.decode))


def test_chat_prompt_exactly_at_the_limit_passes(client: httpx.Client, tokenizer: ModelTokenizer) -> None:
    response = client.post("/v1/chat/completions", json={
        "model": "glm-5", "messages": _chat_of_exactly(LIMIT, tokenizer), "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == LIMIT
    assert response.headers["x-kvgate-prompt-tokens"] == str(LIMIT)


def test_chat_prompt_one_over_the_limit_gets_413_and_reaches_no_engine(
        client: httpx.Client, tokenizer: ModelTokenizer, pair: EnginePair) -> None:
    before = _engine_request_count(pair)
    for stream in (False, True):
        response = client.post("/v1/chat/completions", json={
            "model": "glm-5", "messages": _chat_of_exactly(LIMIT + 1, tokenizer), "max_tokens": 2, "stream": stream})
        assert response.status_code == 413
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded"
        assert error["param"] == "messages"
        assert str(LIMIT + 1) in error["message"] and str(LIMIT) in error["message"]
    assert _engine_request_count(pair) == before


@pytest.mark.parametrize(("length", "status"), [(LIMIT, 200), (LIMIT + 1, 413)])
def test_generate_input_ids_boundary(client: httpx.Client, pair: EnginePair, length: int, status: int) -> None:
    before = _engine_request_count(pair)
    response = client.post("/generate", json={"input_ids": [9703] * length, "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == status, response.text
    if status == 200:
        assert response.json()["meta_info"]["prompt_tokens"] == length
    else:
        assert _engine_request_count(pair) == before


def test_prompt_plus_max_tokens_reaching_context_gets_413(client: httpx.Client, tokenizer: ModelTokenizer) -> None:
    messages = _chat_of_exactly(LIMIT, tokenizer)
    response = client.post("/v1/chat/completions", json={"model": "glm-5", "messages": messages,
                                                          "max_tokens": 8192 - LIMIT})
    assert response.status_code == 413
    assert response.json()["error"]["param"] == "max_tokens"
    fits = client.post("/v1/chat/completions", json={"model": "glm-5", "messages": messages,
                                                      "max_tokens": 8192 - LIMIT - 1})
    assert fits.status_code == 200, fits.text


def test_body_over_the_cap_is_refused_before_it_is_read(gateway: RunningGateway) -> None:
    cap = gateway.gateway.config.max_body_bytes
    port = int(gateway.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        # Announce a body one byte over the cap but send only 16 bytes: the answer must not wait for the rest.
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     + f"content-length: {cap + 1}\r\n\r\n".encode() + b"x" * 16)
        answer = b""
        while b"}}" not in answer:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
        head = answer.decode()
    assert head.startswith("HTTP/1.1 413")
    assert "body_too_large" in head


def test_streamed_body_over_the_cap_is_refused(gateway: RunningGateway) -> None:
    cap = gateway.gateway.config.max_body_bytes

    def chunks() -> Iterator[bytes]:
        for _ in range(cap // 2**20 + 2):
            yield b" " * 2**20

    response = httpx.post(gateway.url + "/v1/completions", content=chunks(), timeout=30)
    assert response.status_code == 413


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate", "/v1/tokenize"])
def test_a_compressed_body_is_refused_not_guessed_at(gateway: RunningGateway, pair: EnginePair, path: str) -> None:
    body = gzip.compress(b'{"model": "glm-5", "messages": [{"role": "user", "content": "hi"}], "text": "hi"}')
    seen = len(generation_records(pair.prefill))
    response = httpx.post(gateway.url + path, content=body, timeout=10,
                          headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_content_encoding"
    assert len(generation_records(pair.prefill)) == seen


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/v1/chat/completions", b"{oops", 400),
    ("/v1/chat/completions", b'{"model": "glm-5", "messages": [{"role": "user", "content": "\\ud800"}]}', 400),
    ("/v1/chat/completions", b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', 404),
    ("/v1/chat/completions", b'{"model": "glm-5", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}', 400),
    ("/v1/completions", b'{"model": "glm-5", "prompt": "hi", "max_tokens": 100000000000}', 400),
    ("/generate", b'{"text": 12}', 400),
])
def test_bad_input_gets_a_clear_4xx_and_is_not_forwarded(client: httpx.Client, pair: EnginePair, path: str,
                                                         body: bytes, status: int) -> None:
    before = _engine_request_count(pair)
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    assert response.json()["error"]["message"]
    assert _engine_request_count(pair) == before


PARITY_CHATS = [
    [{"role": "user", "content": "Plain English question about the weather?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "你好，世界！今天天气怎么样？"}],
    [{"role": "user", "content": "Emoji 😀👍🏽🇫🇷 and combining é é"}],
    [{"role": "user", "content": "def f(x):\n    return x ** 2\n\n\n# trailing spaces   \t\n"}],
    [{"role": "user", "content": "   leading and trailing whitespace runs      "},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "\n\n\n\t\t  again  \n"}],
    [{"role": "user", "content": "Multi"}, {"role": "assistant", "content": "turn"},
     {"role": "user", "content": "conversation with <|user|> lookalike text and [gMASK] inside"}],
    [{"role": "user", "content": "Ünïcödé ßtraße ﬁ ligature ｆｕｌｌｗｉｄｔｈ Ελληνικά русский العربية"}],
    [{"role": "user", "content": "x" * 700 + " " * 300 + "y"}],
]
PARITY_PROMPTS = ["Hello", "  spaced  out  ", "日本語のテキストと English mixed", "🙂" * 50, "code:\n\tif (a) {b();}\n",
                  "<|assistant|> in a raw prompt", "\u200b zero width \ufeff bom"]


@pytest.mark.parametrize("messages", PARITY_CHATS)
def test_chat_count_equals_the_engines(client: httpx.Client, messages: list[dict[str, str]]) -> None:
    response = client.post("/v1/chat/completions", json={"model": "glm-5", "messages": messages, "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert int(response.headers["x-kvgate-prompt-tokens"]) == response.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("prompt", PARITY_PROMPTS)
def test_completion_and_generate_counts_equal_the_engines(client: httpx.Client, prompt: str) -> None:
    completion = client.post("/v1/completions", json={"model": "glm-5", "prompt": prompt, "max_tokens": 1})
    assert completion.status_code == 200, completion.text
    assert int(completion.headers["x-kvgate-prompt-tokens"]) == completion.json()["usage"]["prompt_tokens"]
    generate = client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 1}})
    assert generate.status_code == 200, generate.text
    assert int(generate.headers["x-kvgate-prompt-tokens"]) == generate.json()["meta_info"]["prompt_tokens"]


def test_models_endpoint_reports_the_effective_limit(client: httpx.Client) -> None:
    entry = client.get("/v1/models").json()["data"][0]
    assert entry["id"] == "glm-5" and entry["max_prompt_tokens"] == LIMIT and entry["max_model_len"] == 8192


def test_health_and_readiness(client: httpx.Client) -> None:
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").json() == {"status": "ready"}


@pytest.fixture(scope="module")
def tight_gateway(pair: EnginePair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    config = write_config(tmp_path_factory.mktemp("tight"), [model_entry("glm-5", [pair.prefill], [pair.decode])],
                          max_headers=20, max_header_bytes=4096, max_connections=4,
                          max_connections_per_client=8)  # one address may take the whole (tiny) cap here
    with running_gateway(config) as running:
        yield running


@pytest.mark.parametrize("headers", [{f"x-h{i}": "v" for i in range(30)}, {"x-big": "v" * 8000}])
def test_header_floods_get_431_before_they_are_buffered(tight_gateway: RunningGateway, headers: dict[str, str]) -> None:
    response = httpx.get(tight_gateway.url + "/healthz", headers=headers, timeout=10)
    assert response.status_code == 431 and response.json()["error"]["code"] == "headers_too_large"
    assert len(response.headers["x-request-id"]) == 32  # answered below the app, and still traceable
    assert httpx.get(tight_gateway.url + "/healthz", timeout=10).status_code == 200


def test_connections_beyond_max_connections_get_503(tight_gateway: RunningGateway) -> None:
    port = int(tight_gateway.url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
    try:
        time.sleep(0.2)
        refused = httpx.get(tight_gateway.url + "/healthz", timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"] == {"message": "the gateway is at its limit of 4 open connections",
                                           "type": "service_unavailable", "param": None, "code": "overloaded"}
        assert len(refused.headers["x-request-id"]) == 32
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    assert httpx.get(tight_gateway.url + "/healthz", timeout=10).status_code == 200
