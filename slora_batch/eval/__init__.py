"""The lm-evaluation-harness bridge (the optional ``[eval]`` extra).

- the job file's ``eval:`` keys are the job tool's (``jobs/eval_keys.py``, loaded without lm-eval);
  ``slora_batch.runner`` hands a job that has them to ``sweep``;
- ``encoding``: lm-eval's requests as token ids, by the rules of lm-eval's ``hf`` model (the
  token boundary of a context ending in whitespace, rolling windows, left truncation);
- ``rows``: one lm-eval request as engine ``Request`` fields, and results back as lm-eval answers;
- ``lm``: the lm-eval model ``slora-batch`` (``import slora_batch.eval.lm`` registers it);
- ``sweep``: an eval job: every task for the base model and every adapter in one engine pass,
  scored per adapter by lm-eval's own ``evaluate`` (``tasks``) as soon as its rows are in
  (``scoring``), in a process of its own (``worker``); ``report``: _eval_results.parquet and the JSONs.

Only these modules import ``lm_eval``, and nothing outside an eval job imports them: an eval
job runs and validates through ``slora_batch.runner``, which sits above this package and the
job tool (``jobs/`` imports nothing of this package; the sweep calls the job's run with its
hooks: ``run_plan(on_result=..., build_engine=...)``).
"""
