"""The tokenizer side: loading it from the model directory, prompts to ids, and output ids to
text with stop strings."""

from __future__ import annotations

import json
import os
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

# What `decode` writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_LOADED: OrderedDict[tuple, object] = OrderedDict()  # (directory, its files' state) -> tokenizer
LOADED_TOKENIZERS = 4


def load_tokenizer(model_dir: Path):
    """The model's Hugging Face tokenizer, or None when the directory ships none.

    Loaded once a process for a directory whose files have not changed since (name, size and
    modification time of every file but the weights): a job's validation and its engine, or
    engines built one after another, share it (a load costs ~0.25 s for a 49k-token vocabulary,
    besides transformers' imports). Nothing here changes a tokenizer once loaded."""
    root = Path(model_dir)
    if not any((root / name).exists() for name in TOKENIZER_FILES):
        return None
    files = [f for f in root.iterdir() if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES)]
    state = tuple(sorted((f.name, st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()]))
    key = (str(root.resolve()), state)
    tokenizer = _LOADED.get(key)
    if tokenizer is None:
        tokenizer = _LOADED[key] = _from_pretrained(root)
        while len(_LOADED) > LOADED_TOKENIZERS:
            _LOADED.popitem(last=False)
    else:
        _LOADED.move_to_end(key)
    return tokenizer


# tokenizer_config.json's classes that name no model's own tokenizer: the generic fast
# tokenizer over tokenizer.json, which AutoTokenizer would load as well
GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _from_pretrained(root: Path):
    """``AutoTokenizer.from_pretrained``; a generic fast tokenizer (the sample model's) is
    loaded by its own class, which skips AutoTokenizer's import of the model's configuration
    classes (half of a load's CPU time: ~1.6 s in every process that tokenizes)."""
    import transformers

    try:
        settings = json.loads((root / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        settings = {}
    name = settings.get("tokenizer_class") if isinstance(settings, dict) else None
    if name in GENERIC_CLASSES and (root / "tokenizer.json").is_file():
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(root))
    return transformers.AutoTokenizer.from_pretrained(str(root))


_SKIPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def skipped_ids(tokenizer) -> frozenset[int]:
    """The ids that ``tokenizer.decode(ids, skip_special_tokens=True)`` leaves out: the special
    tokens that decode to text alone and to nothing when skipped. Worked out once per tokenizer
    (Llama-3 has 256 special tokens)."""
    if tokenizer not in _SKIPPED:
        special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        _SKIPPED[tokenizer] = frozenset(
            i
            for i in special | set(tokenizer.all_special_ids)
            if tokenizer.decode([i], skip_special_tokens=False)
            and not tokenizer.decode([i], skip_special_tokens=True)
        )
    return _SKIPPED[tokenizer]


class Detokenizer:
    """A row's output text, built as its ids arrive, and the first stop string in it.

    After ids added one by one or in chunks, ``text`` is ``tokenizer.decode(ids,
    skip_special_tokens=True)`` cut before the earliest occurrence of a stop string; an
    unfinished character at the end is in it as decode writes it (U+FFFD). ``add`` says True at
    the call whose ids complete a stop string. Each call decodes a window of the last few ids,
    never the whole output: about 7 ids per id added, whatever the output's length.

    The window (the prefix_offset / read_offset technique of vLLM and TGI, with a longer
    prefix): the new text is what ``decode(window)`` gives beyond what it gave the previous
    call, whose decode started at the same id, so whatever a tokenizer does at the start of a
    slice (SentencePiece drops the first token's "▁" space) happens to both. Example,
    Llama-2 style: the window ["▁It", "▁is"] decodes to "It is"; "▁me" arrives, the window
    decodes to "It is me", so " me" is new. The window starts only where the text was complete
    (no U+FFFD of an unfinished character at its end), and keeps at least CONTEXT ids before
    the new ones: clean_up_tokenization_spaces rewrites up to 4 characters across tokens
    ("it '" + "s" -> "it's"), and the window must see them to redo them. Costs more: a text
    that keeps ending in U+FFFD (a row of invalid bytes) or a long run of byte fallback tokens
    (<0xE8>), which are decoded whole.
    """

    CONTEXT = 4

    def __init__(self, tokenizer, stops: list[str]) -> None:
        if not all(stops):
            raise ValueError(f"stop strings must be non-empty, got {stops!r}")
        self.tokenizer = tokenizer
        self.skipped = skipped_ids(tokenizer)
        self.stops = list(stops)
        self.max_stop_len = max(map(len, stops), default=0)
        self.window: list[int] = []  # the last ids; those before are in _text for good
        self.starts: list[int] = []  # indices in window after which the text was complete
        self.window_text = ""  # decode(window)
        # The start of window_text that is in _text: all of it but an unfinished character.
        # _text ends with it, except for what decode does at the window's first id.
        self.shown = ""
        self._text = ""
        self.stopped = False

    def add(self, ids: list[int]) -> bool:
        """Appends newly drawn token ids; True once a stop string is complete in the text (and
        then for every later call, which changes nothing)."""
        # Special tokens that decode skips stay out of the window: a row that draws EOS over and
        # over would decode ever longer windows, and they would take the place of the context.
        ids = [i for i in ids if i not in self.skipped]
        if self.stopped or not ids:
            return self.stopped
        self.window.extend(ids)
        self.window_text = self.tokenizer.decode(self.window, skip_special_tokens=True)
        # Bytes of an unfinished character decode to U+FFFD; the text before them is final.
        changed_from = self._show(self.window_text.rstrip(REPLACEMENT_CHAR))
        if self.window_text == self.shown:
            self._slide()
        self._text, self.stopped = self._cut(self._text, changed_from)
        return self.stopped

    @property
    def text(self) -> str:
        """The whole output text so far, cut before the first stop string when one was found.
        An unfinished character at the end is there as U+FFFD, as in ``tokenizer.decode``."""
        if self.stopped or self.window_text == self.shown:
            return self._text
        return self._cut(self._text + self.window_text[len(self.shown) :], len(self._text))[0]

    def _show(self, new: str) -> int:
        """Makes `new` the shown window text, fixing the end of ``_text`` to match; returns the
        index in ``_text`` from which it changed. Text only grows, except where decode rewrites
        what came before: clean_up_tokenization_spaces turns "it '" + "s" into "it's"."""
        kept = len(os.path.commonprefix([self.shown, new]))
        changed_from = len(self._text) - (len(self.shown) - kept)
        self._text = self._text[:changed_from] + new[kept:]
        self.shown = new
        return changed_from

    def _slide(self) -> None:
        """Notes that the window's text is complete, and once the window is 2 * CONTEXT ids
        long, drops its ids before the last CONTEXT or more, starting it where the text was
        complete: one decode of the shorter window per CONTEXT calls."""
        # Byte fallback (Llama-2: "<0xE8>") decodes a run of byte tokens as one: all of it, or
        # every byte as U+FFFD when any is amiss, so "質" turns back into U+FFFD x 3 when an odd
        # byte follows. The window never starts right after a byte token: a run is decoded whole.
        if _is_byte_token(self.tokenizer.convert_ids_to_tokens(self.window[-1])):
            return
        self.starts.append(len(self.window))
        if len(self.window) < 2 * self.CONTEXT:
            return
        # Example, CONTEXT 4, one id per call: window 8 ids, starts [1, .., 8]: start at 4, the
        # window keeps its last 4 ids, starts [1, 2, 3, 4].
        start = max((i for i in self.starts if i <= len(self.window) - self.CONTEXT), default=0)
        if start == 0:
            return
        self.window = self.window[start:]
        self.starts = [i - start for i in self.starts if i > start]
        self.window_text = self.shown = self.tokenizer.decode(self.window, skip_special_tokens=True)

    def _cut(self, text: str, changed_from: int) -> tuple[str, bool]:
        """`text` cut before its earliest stop string, and whether there was one, given that
        none is in ``text[:changed_from]``: only a match ending after it, so starting at most
        one stop length before it, is new."""
        start = max(0, changed_from - self.max_stop_len + 1)
        hits = [i for i in (text.find(stop, start) for stop in self.stops) if i >= 0]
        return (text[: min(hits)], True) if hits else (text, False)


def _is_byte_token(token: str | None) -> bool:
    """Whether `token` is a byte fallback token such as "<0xE8>"."""
    return token is not None and len(token) == 6 and token.startswith("<0x") and token.endswith(">")


PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")


def tokenize(request, tokenizer, vocab_size: int, model: object = "the model") -> list[int]:
    """A request's prompt ids: its token ids as given, its text with the tokenizer's BOS rule,
    or its chat messages through the model's chat template. Raises ValueError / TypeError."""
    given = [name for name in PROMPT_FIELDS if getattr(request, name) is not None]
    if len(given) != 1:
        raise ValueError(
            f"exactly one of prompt, messages, prompt_token_ids is needed, got {given or 'none'}"
        )
    if request.prompt_token_ids is not None:
        ids = list(map(int, request.prompt_token_ids))
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):  # min and max run in C
            bad = [t for t in ids if not 0 <= t < vocab_size]
            raise ValueError(f"token ids {bad[:3]} outside the vocabulary of {vocab_size}")
        return ids
    if tokenizer is None:
        raise ValueError(f"model {model} has no tokenizer: pass prompt_token_ids")
    if request.prompt is not None:
        if not isinstance(request.prompt, str):
            raise TypeError(f"prompt must be a string, got {type(request.prompt).__name__}")
        return tokenizer(request.prompt)["input_ids"] if request.prompt else []
    return _chat_ids(tokenizer, request.messages, model)


def _chat_ids(tokenizer, messages, model: object) -> list[int]:
    """`messages` through the tokenizer's chat template, with the generation prompt."""
    from jinja2.exceptions import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {model} has no chat template: pass prompt or prompt_token_ids")
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except TemplateError as error:
        # Llama-2, Mistral and Gemma templates raise_exception() on a system turn or roles that
        # do not alternate: a bad row, not a broken job.
        raise ValueError(f"chat template: {error.message or type(error).__name__}") from error
    # Some transformers versions give a BatchEncoding even with return_dict=False.
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
