"""The lm-eval model ``slora-batch``: lm-eval's requests on the engine, one engine call per
request list (the engine sorts and batches them itself).

``lm_eval.simple_evaluate(model="slora-batch", model_args="pretrained=DIR,adapter=NAME,
adapters=DIR,dtype=float32,device=cpu")`` after ``import slora_batch.eval.lm``; ``adapter``
left out (or empty) is the base model. Other ``model_args`` that are ``EngineConfig`` fields
(``num_pages``, ``max_num_seqs``, ...) go to the engine; ``max_gen_toks`` is generate_until's
default length (lm-eval's 256).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from slora_batch.eval.encoding import Encoder
from slora_batch.eval.rows import answer, request_rows
from slora_batch.eval.scoring import result_fields

logger = logging.getLogger(__name__)
IGNORED = ("batch_size", "max_batch_size")  # lm-eval passes these; the engine sizes its batches


@register_model("slora-batch")
class SloraBatchLM(LM):
    def __init__(
        self,
        pretrained: str,
        adapter: str | None = None,
        adapters: str | None = None,
        max_gen_toks: int = 256,
        **engine_args: Any,
    ) -> None:
        super().__init__()
        from slora_batch import Engine, EngineConfig

        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_args) - known - set(IGNORED))
        if unknown:
            raise ValueError(
                f"slora-batch model_args: unknown {unknown[0]!r} (engine fields: "
                f"{', '.join(sorted(known))})"
            )
        config = EngineConfig(**{k: v for k, v in engine_args.items() if k in known})
        self.engine = Engine(pretrained, adapters=adapters, config=config)
        self.adapter = adapter or None
        self.encoder = Encoder(self.engine.tokenizer, self.engine.max_model_len, int(max_gen_toks))

    def _answers(self, request_type: str, requests) -> list[Any]:
        from slora_batch import Request

        args = [request.args for request in requests]
        rows: dict[str, dict[str, Any]] = {}
        for one in args:
            for row in request_rows(self.encoder, request_type, one):
                rows[row["id"]] = row
        logger.info(
            "slora-batch: %d %s requests, %d engine rows", len(args), request_type, len(rows)
        )
        requests_in = (Request(adapter=self.adapter, **row) for row in rows.values())
        results = {r.id: result_fields(r) for r in self.engine.generate(requests_in)}
        return [answer(self.encoder, request_type, one, results, self.adapter) for one in args]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._answers("loglikelihood", requests)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return self._answers("loglikelihood_rolling", requests)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return self._answers("generate_until", requests)
