"""The ASCII path gives exactly the tokenizer's own ids: GLM-5 on generated ASCII of every class the split regex
tells apart; the translated split regexes of other GPT-style families against `tokenizers`' own Split step; and
everything the translation is not sure of refused."""

from __future__ import annotations

import gzip
import json
import re

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.ascii_bpe import AsciiBpe, split_pieces, translate_to_ascii
from gateway.admission.counting import TokenCounter
from gateway.admission.tokenizer import ModelTokenizer
from tests.conftest import GLM5_TOKENIZER

# Every ASCII character, weighted towards what the split regex treats specially (apostrophes before its
# contractions, whitespace runs before a word, digits in runs, \r\n, characters Python's isspace calls space).
_ASCII = st.lists(st.one_of(st.sampled_from(list("'sStTdDlLmMrReEvV0 \t\n\r\x0b\x0c\x1c\x1f") + ["  ", "\r\n", "'LL"]),
                            st.characters(max_codepoint=127)), max_size=60).map("".join)

LLAMA3_CL100K_GLM = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                     r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
         r"\s+(?!\S)|\s+")
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


@pytest.fixture(scope="module")
def fast(glm_tokenizer: ModelTokenizer) -> AsciiBpe:
    path = AsciiBpe.for_tokenizer(glm_tokenizer)
    assert path is not None, "GLM-5's tokenizer passes the load-time check"
    return path


@settings(max_examples=600, deadline=None)
@given(text=_ASCII)
def test_glm_ids_equal_encode(fast: AsciiBpe, glm_tokenizer: ModelTokenizer, text: str) -> None:
    expected = glm_tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    assert fast.ids(text, "t") == expected
    assert fast.count(text, "t") == len(expected)


def test_glm_code_and_prose(fast: AsciiBpe, glm_tokenizer: ModelTokenizer) -> None:
    texts = [open(re.__file__).read(), json.__doc__ or "", "It's   12345678 o'clock;\r\n\r\n\tDON'T\n  \n x"]
    for text in texts:
        assert text.isascii()
        for at in range(0, len(text), 1500):
            piece = text[at:at + 1500]
            assert fast.count(piece, "t") == len(glm_tokenizer.tokenizer.encode(piece, add_special_tokens=False).ids)


@pytest.mark.parametrize("pattern", [LLAMA3_CL100K_GLM, QWEN2, GPT2])
@settings(max_examples=300, deadline=None)
@given(text=_ASCII)
def test_translated_split_equals_the_split_step(pattern: str, text: str) -> None:
    translated = translate_to_ascii(pattern)
    assert translated is not None
    step = tokenizers.pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated")
    assert split_pieces(re.compile(translated, re.ASCII), text) == [p for p, _ in step.pre_tokenize_str(text)]


@pytest.mark.parametrize("pattern", [
    r"\p{L}+|\p{M}+",  # a class without an ASCII translation here
    r"\d+|\w+", r"\b\p{L}+", r".+", r"^\s+", r"\s+$", r"(?<=a)b", r"(?i)\p{L}", r"[\p{L}&&[^a]]", r"(a)\1",
    r"[[:alpha:]]+", r"\p{Lu}",
    # Read otherwise by Python's re (hostile review): Oniguruma's `{n}+` repeats, `{n}?` is optional, `&&` intersects.
    r"\p{N}{1,3}+", r"\p{N}{4}+", r"xa{2}?", r"a+?", r"[a-z&&b]",
    # Could match the empty string: the engines step past an empty match differently.
    r"|ab", r"(?:)|ab", r"a|(?=b)", r"\s*", r"(?!a)",
    # Compiled by Oniguruma, refused by Python (a tokenizer with one must still load).
    r"\p{N}{1,3}{1}", r"a{2}*", r"a+{2}", r"(?!a)*b", r"(a", r"a)", r"a{4294967296}",
    # A second attack: case-insensitive, Oniguruma folds a class member to several letters (ß → ss, ﬂ → fl) ...
    r"(?i:[\p{L}])t", r"(?i:\p{L}+)", "(?i:[\u212a])", "[\u00df]",
    # ... and steps differently through a loop whose body can be empty around a look-ahead.
    r"x(?:a|(?=a)b?){2}", r"x(?:a|(?i:(?=a))){2}", r"zq(?:u|(?=u)b?){2}", r"x(?:a?){2}", r"\s+(?!\S)x",
    r"[a||b]", r"[a~~b]", r"[a--b]",
    # A third: a quantified alternation or nested quantifier backtracks exponentially in Python (Oniguruma fails fast).
    r"(?:[a-z]|[^\s])+(?=')", r"(?:a+)+b", r"(?:a|ab)*c",
])
def test_uncertain_constructs_are_refused(pattern: str) -> None:
    assert translate_to_ascii(pattern) is None


def test_only_short_ascii_is_taken(fast: AsciiBpe) -> None:
    assert fast.takes("plain text") and not fast.takes("naïve") and not fast.takes("x" * 100_000)


def test_a_tokenizer_with_a_normalizer_gets_no_fast_path() -> None:
    config = json.loads(gzip.decompress(GLM5_TOKENIZER.read_bytes()))
    config["normalizer"] = {"type": "Lowercase"}
    assert AsciiBpe.for_tokenizer(ModelTokenizer(json.dumps(config).encode())) is None


def test_a_regex_the_fast_path_misreads_is_caught_at_load() -> None:
    """The load-time check compares with the tokenizer itself: a translation that went wrong is never used."""
    config = json.loads(gzip.decompress(GLM5_TOKENIZER.read_bytes()))
    config["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\p{N}+|[^\p{L}\p{N}]+"
    tokenizer = ModelTokenizer(json.dumps(config).encode())
    assert AsciiBpe.for_tokenizer(tokenizer) is not None  # translatable, and right
    wrong = AsciiBpe(tokenizer, re.compile(r"[A-Za-z]+|[0-9]+|[^A-Za-z0-9]"))  # one character at a time: wrong
    assert not wrong._agrees(tokenizer.tokenizer)


def test_counter_counts_chats_with_added_tokens(glm_tokenizer: ModelTokenizer) -> None:
    chat = "[gMASK]<sop><|system|>Be brief.<|user|>What's 2+2?\n\n<|assistant|><think></think>4<|user|>ok<|assistant|>"
    with TokenCounter(glm_tokenizer, cache_bytes=1 << 20, single_pass_chars=1024) as counter:
        for special in (False, True):
            assert counter.count_sync(chat, add_special_tokens=special) == \
                len(glm_tokenizer.tokenizer.encode(chat, add_special_tokens=special).ids)


def test_a_short_prompt_counted_on_the_loop_never_hands_the_gil_over(glm_tokenizer: ModelTokenizer,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Splitting at added tokens paces itself (sleep(0) once its clock is 1 ms old): a short prompt counted inline
    on the event loop starts that clock first, or a stale one would make the loop give the GIL away mid-request."""
    from gateway.admission import gil
    from gateway.admission.prompt_ids import PromptIds

    def no_sleep(_: float) -> None:
        raise AssertionError("the event loop slept")

    chat = "[gMASK]<sop><|user|>" + "word " * 100 + "<|assistant|>"
    with TokenCounter(glm_tokenizer, cache_bytes=1 << 20, single_pass_chars=1024) as counter:
        builder = PromptIds(glm_tokenizer, counter.splitter)
        gil._handed_over.at = 0.0  # a clock left stale by whatever ran on this thread long ago
        monkeypatch.setattr(gil.time, "sleep", no_sleep)
        assert counter.count_sync(chat) == len(glm_tokenizer.tokenizer.encode(chat, add_special_tokens=False).ids)
        gil._handed_over.at = 0.0
        builder.ids(chat, tenant="t", special=False, max_tokens=64)


def test_a_regex_python_reads_otherwise_is_refused_though_probes_miss_it() -> None:
    """`\\p{N}{4}+` is `(?:\\p{N}{4})+` in Oniguruma and possessive in Python: they differ only on 8+ digits in a
    row, which no load-time probe held (hostile review: the check passed, then `03640741` counted 4 against 5)."""
    config = json.loads(gzip.decompress(GLM5_TOKENIZER.read_bytes()))
    split = config["pre_tokenizer"]["pretokenizers"][0]["pattern"]
    split["Regex"] = split["Regex"].replace(r"\p{N}{1,3}", r"\p{N}{4}+")
    tokenizer = ModelTokenizer(json.dumps(config).encode())
    assert AsciiBpe.for_tokenizer(tokenizer) is None
    with TokenCounter(tokenizer, cache_bytes=1 << 20, single_pass_chars=1024) as counter:
        assert counter.count_sync("03640741") == len(tokenizer.tokenizer.encode("03640741").ids)


def test_one_tenants_pieces_are_not_anothers(glm_tokenizer: ModelTokenizer) -> None:
    """A piece one tenant sent is encoded again for another: a shared cache would tell the second, by timing, that
    the first had sent it (the count cache is per tenant for the same reason)."""
    fast = AsciiBpe(glm_tokenizer, re.compile(translate_to_ascii(LLAMA3_CL100K_GLM) or "", re.ASCII))
    tokenized: list[str] = []
    model = glm_tokenizer.tokenizer.model
    fast._model = type("Spy", (), {"tokenize": lambda _, piece: tokenized.append(piece) or model.tokenize(piece)})()
    text = "the quarterly revenue figures of Acme"
    fast.count(text, "a")
    first = len(tokenized)
    fast.count(text, "a")
    assert len(tokenized) == first  # the same tenant: every piece known
    assert fast.count(text, "b") == fast.count(text, "a")
    assert len(tokenized) == 2 * first  # another tenant: every piece encoded afresh


def test_a_text_with_a_long_piece_goes_to_the_tokenizer(fast: AsciiBpe, glm_tokenizer: ModelTokenizer) -> None:
    """A piece over 255 characters (a run of letters or spaces) is never encoded, nor kept, here: one BPE call over
    it holds the GIL for milliseconds, and kept it would let 65,536 of them take half a GiB."""
    from gateway.admission.segmenting import UnsupportedSplit

    for text in ("a" * 256, "x " + " " * 300 + "y", "<|user|>" + "b" * 5000):
        if "<" not in text:
            with pytest.raises(UnsupportedSplit):
                fast.count(text, "t")
        with TokenCounter(glm_tokenizer, cache_bytes=1 << 20, single_pass_chars=8192) as counter:
            assert counter.count_sync(text) == len(glm_tokenizer.tokenizer.encode(text).ids)
    assert fast.count("a" * 255, "t") == len(glm_tokenizer.tokenizer.encode("a" * 255).ids)


def test_one_tenant_filling_its_pieces_clears_only_its_own(glm_tokenizer: ModelTokenizer,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.admission import ascii_bpe

    monkeypatch.setattr(ascii_bpe, "_PIECES_PER_TENANT", 8)
    fast = AsciiBpe(glm_tokenizer, re.compile(translate_to_ascii(LLAMA3_CL100K_GLM) or "", re.ASCII))
    fast.count("kept pieces of b", "b")
    held = dict(fast._pieces["b"])
    for n in range(100):
        fast.count(f"flood{n} words{n}", "a")
    assert fast._pieces["b"] == held and len(fast._pieces["a"]) <= 8
    assert fast._kept == sum(map(len, fast._pieces.values()))
