"""The two engine requests of an exchange: what each engine must count, checked against it as verified now, and the
bodies with the gateway-owned fields."""

from __future__ import annotations

import orjson

from gateway.admission.admit import AdmittedRequest
from gateway.errors import GatewayError
from routing.pools import WorkerPair
from routing.workers import Worker


def expected_counts(admitted: AdmittedRequest, pair: WorkerPair) -> tuple[int, int]:
    """Each engine's prompt count as the gateway counted it for that engine's version — checked again against
    the engines as verified now, on the connections about to carry it: a limit that dropped while the request
    was counted or queued (a restart with a smaller pool, another version) must not be met with a prompt
    admitted under the old one. Raises the GatewayError to answer instead."""
    counts = []
    for worker in (pair.prefill, pair.decode):
        identity = worker.verified
        counted = admitted.prompt_tokens_for(identity.version) if identity is not None else None
        if identity is None or counted is None or (
                admitted.route == "/v1/chat/completions"
                and identity.rendering.default_chat_template_kwargs != admitted.engine_defaults_json):
            # (a restart with other default template kwargs would render a chat that was not counted)
            raise GatewayError(503, f"the {worker.role} engine changed while the request was admitted",
                               code="worker_changed", detail=f"{worker.role} worker {worker.url}")
        if counted >= identity.max_req_input_len:
            limit = identity.max_req_input_len - 1
            raise GatewayError(413, f"This model's maximum context length is {limit} tokens for the prompt. "
                               f"However, your prompt resulted in {counted} tokens. Please reduce the length of "
                               f"the prompt. (The {worker.role} engine now admits at most {limit}.)",
                               code="context_length_exceeded", param="messages")
        if worker.role == "decode" and counted + max(admitted.max_new_tokens,
                                                     identity.reserved_decode_tokens) > identity.pool_tokens:
            output = max(admitted.max_new_tokens, identity.reserved_decode_tokens)
            raise GatewayError(413, f"This model's maximum context length is {identity.pool_tokens} tokens. "
                               f"However, you requested {counted + output} tokens ({counted} in the messages, "
                               f"{output} in the completion, as the decode engine reserves it). Please reduce the "
                               "length of the messages or completion.", code="context_length_exceeded",
                               param="max_tokens")
        counts.append(counted)
    return counts[0], counts[1]


def engine_bodies(admitted: AdmittedRequest, prefill: Worker, rid: str, room: int,
              cache_salt: str | None) -> tuple[tuple[memoryview, bytes], tuple[memoryview, bytes]]:
    """The admitted body plus the gateway-owned fields, spliced in as a second part: the body is neither parsed
    nor copied again (it may be megabytes)."""
    base = admitted.engine_body
    owned = b',"rid":%s,"bootstrap_room":%d,"bootstrap_host":%s,"bootstrap_port":%s' % (
        orjson.dumps(rid), room, orjson.dumps(prefill.bootstrap_host),
        orjson.dumps(prefill.bootstrap_port))
    if cache_salt is not None:
        owned += b',"extra_key":' + orjson.dumps(cache_salt)
    # A streaming client's decode reports usage in every OpenAI event (each count is verified before release); a
    # client that does not stream gets decode's whole answer, with its usage.
    if not admitted.stream:
        decode_extra = b',"stream":false'
    elif admitted.route == "/generate":
        decode_extra = b',"stream":true'
    else:
        decode_extra = b',"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}'
    head = memoryview(base)[:-1]
    return (head, owned + b',"stream":false}'), (head, owned + decode_extra + b"}")
