"""A prompt's leading token ids as the engine's tokenizer gives them, for cache-aware routing (which matches them
against what each prefill's radix cache holds).

Counting (`counting.py`) never needs the ids, only their number; routing does, so it pays for them once per new
text: the prompt is split at added tokens exactly as the tokenizer splits it (`segmenting.py`: it never merges
across them), each plain piece's ids are cached per tenant, and only pieces not seen before are encoded. A chat's
next turn repeats every earlier message, so it encodes only what is new. Only the first `max_tokens` ids are made:
routing reads no further, and a 1M-token prompt costs no more than the window.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator

from gateway.admission.ascii_bpe import AsciiBpe
from gateway.admission.gil import start_pacing
from gateway.admission.segmenting import AddedTokenSplitter, UnsupportedSplit
from gateway.admission.tokenizer import ModelTokenizer
from routing.prefix_index.blocks import ids_to_bytes

_CHARS_PER_TOKEN_BOUND = 8  # a window of this many characters per wanted token holds the tokens in any prose


class PromptIds:
    def __init__(self, tokenizer: ModelTokenizer, splitter: AddedTokenSplitter | None, *,
                 cache_bytes: int = 32 * 2**20, on_encoded: Callable[[str, str, int], None] | None = None) -> None:
        """`splitter`: None where splitting at added tokens is not proven exact for this tokenizer (then a window
        of the prompt is encoded whole); `on_encoded(piece, tenant, tokens)` for every whole piece encoded."""
        self._on_encoded = on_encoded
        self._tok = tokenizer.tokenizer
        self._splitter = splitter
        self._ascii = AsciiBpe.for_tokenizer(tokenizer)
        self._cache: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._held = 0
        self._lock = threading.Lock()  # admission may run in threads
        self._added = {t.content: t.id for t in tokenizer.added_tokens}
        self._specials = self._special_tokens()

    def ids(self, text: str, *, tenant: str, special: bool, max_tokens: int) -> bytes:
        """The first `max_tokens` ids of `encode(text, add_special_tokens=special)` (4-byte little-endian each;
        near the window's end they may differ from the engine's)."""
        start_pacing()  # inline on the event loop for a short prompt: its split must not hand the GIL over there
        head, tail = self._specials if special else (b"", b"")
        parts = [head]
        want = max_tokens * 4
        held = len(head)
        try:
            for part in self._pieces(text, tenant, want - held):
                parts.append(part)
                held += len(part)
                if held >= want:
                    break
            else:
                parts.append(tail)
        except UnsupportedSplit:
            window = text[:max_tokens * _CHARS_PER_TOKEN_BOUND]
            ids = self._tok.encode_batch_fast([window], add_special_tokens=special)[0].ids
            return ids_to_bytes(ids[:max_tokens])
        return b"".join(parts)[:want]

    def _pieces(self, text: str, tenant: str, want: int) -> Iterator[bytes]:
        if self._splitter is None:
            raise UnsupportedSplit
        held = 0
        for start, stop, token_id in self._splitter.segments(text):
            if token_id is not None:
                piece = ids_to_bytes((token_id,))
            else:
                piece = self._plain(text[start:stop], tenant, want - held)
            held += len(piece)
            yield piece
            if held >= want:
                return

    def _plain(self, text: str, tenant: str, want: int) -> bytes:
        key = (tenant, text)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        if len(text) > (want // 4) * _CHARS_PER_TOKEN_BOUND:  # longer than the window needs: encode the window only
            window = text[:(want // 4) * _CHARS_PER_TOKEN_BOUND]
            return ids_to_bytes(self._tok.encode_batch_fast([window], add_special_tokens=False)[0].ids)
        ids = ids_to_bytes(self._encode(text, tenant))
        if self._on_encoded is not None:
            self._on_encoded(text, tenant, len(ids) // 4)
        with self._lock:
            self._cache[key] = ids
            self._held += len(ids) + len(text)
            while self._held > self._cache_bytes and self._cache:
                (_, old_text), old = self._cache.popitem(last=False)
                self._held -= len(old) + len(old_text)
        return ids

    def _encode(self, text: str, tenant: str) -> list[int]:
        fast = self._ascii
        if fast is not None and fast.takes(text):
            try:
                return fast.ids(text, tenant)
            except UnsupportedSplit:
                pass  # a piece too long for the ASCII path
        return self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def _special_tokens(self) -> tuple[bytes, bytes]:
        """The ids `add_special_tokens=True` puts before and after a text (the tokenizer's post-processor)."""
        probe = "a"
        plain = self._tok.encode_batch_fast([probe], add_special_tokens=False)[0].ids
        full = self._tok.encode_batch_fast([probe], add_special_tokens=True)[0].ids
        for at in range(len(full) - len(plain) + 1):
            if full[at:at + len(plain)] == plain:
                return ids_to_bytes(full[:at]), ids_to_bytes(full[at + len(plain):])
        return b"", b""
