"""tokens.py: the incremental detokenizer against whole-output decoding on three kinds of
tokenizer, its cost per call, and chat template errors."""

import copy
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import BatchEncoding, PreTrainedTokenizerFast

from slora_batch.engine.requests.request import Request
from slora_batch.engine.requests.tokens import Detokenizer, load_tokenizer, tokenize

MULTIBYTE_STOPS = ["답변:", "質問：", "🛑"]
CORPUS = "ab 답변: 質問： 🛑 é\n\nab it's a . b , 答 🙂🛑 ab\n\n"


@pytest.fixture(scope="module")
def smollm2(sample_model_dir):
    """The sample model's tokenizer: byte-level BPE (GPT-2 style), one CJK character or emoji
    over several tokens."""
    return load_tokenizer(sample_model_dir)


def sentencepiece():
    """A Llama-2 style tokenizer: "▁" for spaces, a dropped leading space, bytes for what is not
    in the vocabulary (<0xE8> ...), <s> and </s> that decode skips."""
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab |= {f"<0x{b:02X}>": len(specials) + b for b in range(256)}
    pieces = ["▁", "a", "b", "▁a", "▁b", "ab", "▁ab", ":", "\n", "답", "변", "답변", "▁답변"]
    vocab |= {piece: len(vocab) + i for i, piece in enumerate(pieces)}
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b"), ("답", "변"), ("▁", "답변")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(token, special=True) for token in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def wordpiece():
    """A BERT style tokenizer whose decode cleans up spaces across tokens: "it ' s" -> "it's",
    "a ." -> "a." (and writes [UNK] for what is not in the vocabulary)."""
    words = ["it", "do", "n", "'", "t", "s", ".", ",", "a", "b", "##s", "##t", "##n"]
    vocab = {token: i for i, token in enumerate(["[UNK]", "[CLS]", "[SEP]", *words])}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(token, special=True) for token in ["[CLS]", "[SEP]"]])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        clean_up_tokenization_spaces=True,
    )


def reference(tokenizer, ids: list[int], stops: list[str]) -> tuple[str, bool]:
    """What ``text`` must be: the whole decode cut before the earliest stop, and whether one was."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def random_ids(tokenizer, rng: random.Random) -> list[int]:
    """Ids of the corpus cut and glued at random token boundaries (so inside characters), with
    single ids drawn from its vocabulary and special tokens among them."""
    corpus = tokenizer.encode(CORPUS, add_special_tokens=False)
    pool = sorted(set(corpus) | set(tokenizer.all_special_ids))
    ids: list[int] = []
    for _ in range(rng.randint(1, 6)):
        if rng.random() < 0.7:
            start = rng.randrange(len(corpus))
            ids += corpus[start : start + rng.randint(1, 12)]
        else:
            ids += [rng.choice(pool) for _ in range(rng.randint(1, 4))]
    return ids


def chunked(ids: list[int], rng: random.Random, one_by_one: bool) -> list[list[int]]:
    if one_by_one:
        return [[i] for i in ids]
    chunks, start = [], 0
    while start < len(ids):
        size = rng.randint(1, 5)
        chunks.append(ids[start : start + size])
        start += size
    return chunks


def check_against_reference(tokenizer, ids: list[int], chunks: list[list[int]], stops: list[str]):
    """Feeds `chunks` (which make up `ids`): after every call ``text`` is the reference of the
    ids so far, ``add`` is True from the first call whose ids complete a stop string on, and the
    text stays as it was then."""
    detok, done = Detokenizer(tokenizer, stops), 0
    stopped_text = None
    for chunk in chunks:
        done += len(chunk)
        stopped = detok.add(chunk)
        if stopped_text is not None:
            assert stopped and detok.text == stopped_text
            continue
        text, has_stop = reference(tokenizer, ids[:done], stops)
        assert (stopped, detok.text) == (has_stop, text), ids[:done]
        if stopped:
            stopped_text = text


@pytest.mark.parametrize("one_by_one", [True, False], ids=["one-by-one", "chunks"])
@pytest.mark.parametrize("kind", ["smollm2", "sentencepiece", "wordpiece"])
def test_text_and_stops_match_whole_decode(kind, one_by_one, request):
    tokenizer = request.getfixturevalue("smollm2") if kind == "smollm2" else globals()[kind]()
    rng = random.Random(f"{kind}{one_by_one}")
    # "é\n" straddles the " é" and "\n" tokens; "b ," and "it's" need the space cleanup.
    stop_sets = [[], [*MULTIBYTE_STOPS, "\n\n"], ["é\n", "b a"], ["b ,", "it's", "a."]]
    for trial in range(120):
        ids = random_ids(tokenizer, rng)
        stops = stop_sets[trial % len(stop_sets)]
        check_against_reference(tokenizer, ids, chunked(ids, rng, one_by_one), stops)


@pytest.mark.parametrize("stop", [*MULTIBYTE_STOPS, "\n\n"])
def test_stop_found_at_the_token_that_completes_it(smollm2, stop):
    ids = smollm2.encode(f"Q: 質問 😀 b {stop} more text after it", add_special_tokens=False)
    # The first prefix of ids whose text holds the stop: its last token completes the stop.
    complete = next(n for n in range(len(ids) + 1) if stop in smollm2.decode(ids[:n]))
    detok = Detokenizer(smollm2, [stop])
    found = [detok.add([i]) for i in ids]
    assert found.index(True) == complete - 1
    assert detok.text == "Q: 質問 😀 b "


def test_output_in_one_chunk_is_cut_at_the_first_stop(smollm2):
    ids = smollm2.encode("one 답변: two 🛑 three 답변:", add_special_tokens=False)
    detok = Detokenizer(smollm2, ["🛑", "답변:"])
    assert detok.add(ids)
    assert detok.text == "one "


@pytest.mark.parametrize("kind", ["smollm2", "sentencepiece"])
def test_unfinished_character_at_the_end_is_written_as_decode_writes_it(kind, request):
    tokenizer = request.getfixturevalue("smollm2") if kind == "smollm2" else globals()[kind]()
    ids = tokenizer.encode("ab 質", add_special_tokens=False)[:-1]
    text = tokenizer.decode(ids)
    assert text.endswith("\ufffd")  # the test's premise: "質" is several tokens
    detok = Detokenizer(tokenizer, ["🛑"])
    assert not detok.add(ids)
    assert detok.text == text


class CountingTokenizer:
    """Passes decode on to a tokenizer and counts the calls and the ids decoded."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = self.ids = 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def decode(self, ids, **kwargs):
        self.calls += 1
        self.ids += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def test_cost_per_token_does_not_grow_with_the_output(smollm2):
    n = 2000
    text = "The answer: 質問： 🛑 é, 답변: yes.\n\n" * 200
    ids = smollm2.encode(text, add_special_tokens=False)[:n]
    # A row that ignores EOS may draw special tokens over and over.
    ids[1000:1300] = [smollm2.eos_token_id] * 300
    counting = CountingTokenizer(smollm2)
    detok = Detokenizer(counting, ["never appears"])
    for i in ids:
        assert not detok.add([i])
    assert detok.text == smollm2.decode(ids, skip_special_tokens=True)
    assert counting.calls <= 2 * n
    assert counting.ids < 10 * n


LLAMA2_STYLE_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% for message in messages %}[INST] {{ message['content'] }} [/INST]{% endfor %}"
)


@pytest.fixture
def sample_copy(smollm2):
    """A copy of the sample tokenizer that a test may change."""
    return copy.deepcopy(smollm2)


def chat(*roles: str) -> Request:
    return Request(id=0, messages=[{"role": role, "content": "Hi"} for role in roles])


def test_template_that_raises_is_a_value_error_naming_its_message(sample_copy):
    sample_copy.chat_template = LLAMA2_STYLE_TEMPLATE
    with pytest.raises(ValueError, match="chat template: Conversation roles must alternate"):
        tokenize(chat("system", "user"), sample_copy, len(sample_copy))
    assert tokenize(chat("user"), sample_copy, len(sample_copy)) == sample_copy.encode(
        "[INST] Hi [/INST]"
    )


def test_template_that_does_not_compile_is_a_value_error(sample_copy):
    sample_copy.chat_template = "{% for m in messages %}{{ m | no_such_filter }}{% endfor %}"
    with pytest.raises(ValueError, match="chat template: No filter named 'no_such_filter'"):
        tokenize(chat("user"), sample_copy, len(sample_copy))


def test_tokenizer_without_chat_template_is_a_value_error(sample_copy):
    sample_copy.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        tokenize(chat("user"), sample_copy, len(sample_copy), model="m")


def test_chat_ids_are_a_plain_list_of_ints(smollm2, sample_copy, monkeypatch):
    expected = smollm2.apply_chat_template(
        chat("user").messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    ids = tokenize(chat("user"), smollm2, len(smollm2))
    assert type(ids) is list and all(type(t) is int for t in ids) and ids == expected
    # Some transformers versions return a BatchEncoding whatever return_dict says.
    monkeypatch.setattr(
        sample_copy, "apply_chat_template", lambda *a, **k: BatchEncoding({"input_ids": expected})
    )
    assert tokenize(chat("user"), sample_copy, len(sample_copy)) == expected


def test_a_directory_loads_its_tokenizer_once_until_its_files_change(sample_model_dir, tmp_path):
    """A job's validation and its engine, and engines built again, share one load; a changed
    file loads it anew, and another directory has its own."""
    import shutil

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for f in sample_model_dir.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy(f, tmp_path / name / f.name)
    first = load_tokenizer(tmp_path / "a")
    assert load_tokenizer(tmp_path / "a") is first
    other = load_tokenizer(tmp_path / "b")
    assert other is not first and other.get_vocab() == first.get_vocab()
    config = tmp_path / "a" / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")
    again = load_tokenizer(tmp_path / "a")
    assert again is not first and load_tokenizer(tmp_path / "a") is again


def test_a_generic_fast_tokenizer_loads_as_auto_tokenizer_loads_it(sample_model_dir):
    """The sample model's tokenizer (tokenizer_class PreTrainedTokenizerFast), loaded by its own
    class: what AutoTokenizer gives, ids, special tokens and chat template alike."""
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(sample_model_dir), AutoTokenizer.from_pretrained(sample_model_dir)
    assert type(ours) is type(auto) and len(ours) == len(auto)
    text = "Hello <|im_start|>user\nsé 12345 ünïcode<|im_end|>"
    assert ours.encode(text) == auto.encode(text)
    assert ours.all_special_tokens == auto.all_special_tokens
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == (
        auto.eos_token_id,
        auto.pad_token_id,
        auto.bos_token_id,
    )
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(
        messages, tokenize=False
    )
