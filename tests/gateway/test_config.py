"""A bad configuration fails at startup naming the key and the reason."""

from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config
from tests.gateway_harness import GLM5_TOKENIZER


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvgate.yaml"
    path.write_text(text)
    return path


MODEL = f"""
models:
  - name: glm-5
    tokenizer: {GLM5_TOKENIZER}
    context_length: 8192
    prefill: [{{url: "http://127.0.0.1:30000", bootstrap_port: 8998}}]
    decode: [{{url: "http://127.0.0.1:30001"}}]
"""


def test_valid_config_loads_with_defaults(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, MODEL))
    model = config.models[0]
    assert model.configured_prompt_limit == 8191
    assert model.on_pool_mismatch == "refuse" and model.on_old_engine == "warn"
    assert model.min_engine_version == "0.5.22"


def test_max_prompt_tokens_lowers_the_configured_limit(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, MODEL.replace("context_length: 8192", "context_length: 8192\n    max_prompt_tokens: 4000")))
    assert config.models[0].configured_prompt_limit == 4000


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:0", "http://127.0.0.1:30000/v1",
                                 "http://user:pw@127.0.0.1:30000"])
def test_a_worker_url_that_cannot_be_connected_to_as_given_is_refused(tmp_path: Path, url: str) -> None:
    with pytest.raises(ConfigError, match="models.0.prefill.0.url"):
        load_config(_write(tmp_path, MODEL.replace("http://127.0.0.1:30000", url)))


@pytest.mark.parametrize(("replacement", "key", "reason"), [
    ("context_length: 8192", "models.0.context_length", "integer"),
    ("decode: [{url: \"http://127.0.0.1:30001\"}]", "models.0.decode", "at least 1"),
    ("on_pool_mismatch", "models.0.on_pool_mismatch", "refuse"),
    ("url: \"http://127.0.0.1:30000\"", "models.0.prefill.0.url", "http(s) URL"),
])
def test_bad_value_names_key_and_reason(tmp_path: Path, replacement: str, key: str, reason: str) -> None:
    broken = {
        "context_length: 8192": "context_length: lots",
        "decode: [{url: \"http://127.0.0.1:30001\"}]": "decode: []",
        "on_pool_mismatch": "on_pool_mismatch: sometimes\n    context_length: 8192",
        "url: \"http://127.0.0.1:30000\"": "url: \"ftp:/nowhere\"",
    }[replacement]
    text = MODEL.replace(replacement, broken) if replacement != "on_pool_mismatch" else MODEL.replace(
        "context_length: 8192", broken)
    with pytest.raises(ConfigError) as caught:
        load_config(_write(tmp_path, text))
    assert key in str(caught.value) and reason in str(caught.value)


def test_unknown_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="models.0.context_lenght"):
        load_config(_write(tmp_path, MODEL.replace("context_length", "context_lenght")))


def test_missing_tokenizer_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="models.0.tokenizer: file not found"):
        load_config(_write(tmp_path, MODEL.replace(str(GLM5_TOKENIZER), "/nope/tokenizer.json")))
