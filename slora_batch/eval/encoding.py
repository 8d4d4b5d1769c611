"""lm-eval's requests as token ids, by the rules of lm-eval's ``hf`` model (``HFLM``), so that
this engine and ``hf`` score the same tokens:

- ``tok_encode``: the tokenizer's own special-token rule, except that a text already starting
  with the BOS string gets none added;
- loglikelihood: a context ending in whitespace gives that whitespace to the continuation
  (``"Q: 2+2=" , " 4"`` and ``"Q: 2+2= ", "4"`` both score ``" 4"``), the pair is encoded whole
  and split at the context's length; an empty context becomes the prefix token (BOS, else EOS);
  a pair longer than the engine takes loses context tokens from the left;
- loglikelihood_rolling: lm-eval's disjoint rolling windows.

Both score up to ``max_length + 1`` tokens per pass: the last continuation token is never fed
(the engine's scored rows feed all their tokens but the last), so pairs are cut and rolling
windows made exactly as in ``hf``.
- generate_until: the context left-truncated to ``max_length - max_gen_toks``, the answer
  decoded without special tokens and cut at the first ``until`` string.
"""

from __future__ import annotations

from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)


class Encoder:
    """Token ids for lm-eval requests. ``max_length``: the model's context (HFLM's rule: the
    config's ``max_position_embeddings``); ``max_gen_toks``: generate_until's default."""

    def __init__(self, tokenizer, max_length: int, max_gen_toks: int = 256) -> None:
        if tokenizer is None:
            raise ValueError("lm-eval tasks need the model's tokenizer; the model ships none")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_gen_toks = max_gen_toks
        bos = tokenizer.bos_token_id
        self.prefix_token_id = bos if bos is not None else tokenizer.eos_token_id
        self.eos_text = tokenizer.decode(tokenizer.eos_token_id, skip_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        prefix = self.tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and has_bos_prefix(text, prefix):
            kwargs = {"add_special_tokens": False}
        return self.tokenizer.encode(text, **kwargs)

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) of a loglikelihood request, truncated as HFLM does."""
        if context == "":
            cont = self.encode(continuation, add_special_tokens=False)
            if cont and cont[0] == self.prefix_token_id:
                ctx, cont = cont[:1], cont[1:]
            else:
                ctx = [self.prefix_token_id]
        else:
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = self.encode(context + continuation)
            ctx = self.encode(context)
            cont = whole[len(ctx) :]
        return self.truncate(ctx, cont)

    def truncate(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
        """The context loses its oldest tokens so that the pair fits the engine, which feeds
        all but the last token (e.g. max_length 4, ctx [1,2,3,4], cont [7,8] -> [2,3,4], [7,8]),
        as HFLM's ``[-(max_length+1):]``."""
        excess = len(ctx) + len(cont) - (self.max_length + 1)
        return (ctx[excess:], cont) if excess > 0 else (ctx, cont)

    def rolling(self, text: str) -> list[tuple[list[int], list[int]]]:
        """The (context ids, continuation ids) windows whose loglikelihoods sum to the text's."""
        windows = lm_utils.get_rolling_token_windows(
            token_list=self.encode(text),
            prefix_token=self.prefix_token_id,
            max_seq_len=self.max_length,  # a window: max_length + 1 tokens, the last not fed
            context_len=1,
        )
        return [tuple(map(list, lm_utils.make_disjoint_window(w))) for w in windows]

    def generation(
        self, context: str, gen_kwargs: dict[str, Any]
    ) -> tuple[dict[str, Any], list[str]]:
        """(the ``Request`` fields of a generate_until request, its ``until`` strings)."""
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.eos_text)
        max_gen_toks = int(kwargs.pop("max_gen_toks"))
        limit = (
            self.max_length - max_gen_toks if max_gen_toks < self.max_length else self.max_length
        )
        fields: dict[str, Any] = {
            "prompt_token_ids": self.encode(context)[-limit:],
            "max_new_tokens": max_gen_toks,
            "temperature": float(kwargs.get("temperature") or 0.0)
            if kwargs.get("do_sample")
            else 0.0,
            "stop": [u for u in until if u and u != self.eos_text] or None,
        }
        for name in ("top_p", "top_k", "seed"):
            if kwargs.get(name) is not None:
                fields[name] = kwargs[name]
        return fields, until

    def answer(self, token_ids: list[int], until: list[str]) -> str:
        """The generated text as HFLM returns it: decoded, cut at the first ``until`` string."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return postprocess_generated_text(text, until, None)
