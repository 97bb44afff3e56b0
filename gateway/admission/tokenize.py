"""What `/v1/tokenize` and `/v1/detokenize` answer, as a pure function of the body (no I/O): run on a thread of the
gateway for a small body, in an admission worker process for a large one (`gateway.http.tokenize` serves them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import orjson

from gateway.admission.admit import Admission
from gateway.admission.requests import decode_json_object
from gateway.errors import GatewayError, bad_request

Kind = Literal["tokenize", "detokenize"]
FindAdmission = Callable[[str | None], Admission]

_MAX_ITEMS = 1024
# Returning ids builds one Python int each: beyond this an answer is tens of megabytes (count with /generate
# instead: admission counts any size without building ids).
_MAX_CHARS = 2 * 2**20
_MAX_IDS = 2**21  # detokenize: ids checked and decoded per request


def answer(kind: Kind, raw: bytes, find: FindAdmission) -> bytes:
    """The JSON answer to a tokenize or detokenize body (raises GatewayError). Pure: it runs on a thread of the
    gateway for a small body, in an admission worker process for a large one."""
    data = decode_json_object(raw)
    name = data.get("model")
    if name is not None and not isinstance(name, str):
        raise bad_request("model must be a string", param="model")
    admission = find(name)
    return orjson.dumps(_tokenize(data, admission) if kind == "tokenize" else _detokenize(data, admission))


def _tokenize(data: dict[str, Any], admission: Admission) -> dict[str, Any]:
    prompt = data.get("prompt")
    single = isinstance(prompt, str)
    prompts = [prompt] if single else prompt
    if not isinstance(prompts, list) or not prompts or len(prompts) > _MAX_ITEMS \
            or not all(isinstance(p, str) for p in prompts):
        raise bad_request(f"prompt must be a string or a list of at most {_MAX_ITEMS} strings", param="prompt")
    if sum(len(p) for p in prompts) > _MAX_CHARS:
        raise GatewayError(413, f"tokenize answers at most {_MAX_CHARS} characters of text", code="body_too_large",
                           param="prompt")
    special = data.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise bad_request("add_special_tokens must be a boolean", param="add_special_tokens")
    encoded = admission.tokenizer.tokenizer.encode_batch_fast(prompts, add_special_tokens=special)
    ids = [list(e.ids) for e in encoded]
    limits = admission.limits
    return {"tokens": ids[0] if single else ids, "count": len(ids[0]) if single else [len(i) for i in ids],
            "max_model_len": limits.context_length, "max_prompt_tokens": limits.prompt_tokens}


def _detokenize(data: dict[str, Any], admission: Admission) -> dict[str, Any]:
    tokens = data.get("tokens")
    if not isinstance(tokens, list):
        raise bad_request("tokens must be a list of token ids, or a list of such lists", param="tokens")
    single = not tokens or not isinstance(tokens[0], list)
    batches = [tokens] if single else tokens
    total = sum(len(b) if isinstance(b, list) else 1 for b in batches)  # lengths only: cheap
    if len(batches) > _MAX_ITEMS or total > _MAX_IDS:
        raise GatewayError(413, f"detokenize answers at most {_MAX_IDS} token ids", code="body_too_large",
                           param="tokens")
    tokenizer = admission.tokenizer.tokenizer
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if not all(isinstance(b, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                           for t in b) for b in batches):
        raise bad_request(f"tokens must be a list of token ids in [0, {vocab}), or a list of such lists",
                          param="tokens")
    texts = tokenizer.decode_batch(batches, skip_special_tokens=False)
    return {"text": texts[0] if single else texts}
