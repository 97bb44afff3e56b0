"""Names in `chat_template_kwargs` that are not template variables: the configuration refuses them in a model's
allowlist, admission refuses them from a client, and no engine default is merged under them."""

from __future__ import annotations

# Parameters of transformers' `apply_chat_template` (4.57 and 5.19 alike): as kwargs they are not template
# variables but change the call itself (a replacement template, padding to any length, ...). Never a client's.
APPLY_CHAT_TEMPLATE_PARAMETERS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
# Keys SGLang takes out of chat_template_kwargs itself (serving_chat.py: _convert_to_internal_request).
SGLANG_HANDLED_KWARGS = frozenset({"reasoning_effort"})
# Keys of chat_template_kwargs that change how the engine renders or tokenizes, not what the template reads: never
# allowed to a client, never merged as an engine's default. (`documents` is a parameter of apply_chat_template, but
# it only feeds the template variable of that name.)
NOT_TEMPLATE_VARIABLES = (APPLY_CHAT_TEMPLATE_PARAMETERS - {"documents"}) | SGLANG_HANDLED_KWARGS
