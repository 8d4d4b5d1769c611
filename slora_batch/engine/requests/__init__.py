"""Requests and results: what goes in, what comes out, and a row's state in between.

request.py   Request, Result: what goes in and what comes out
tokens.py    the tokenizer, chat templates and incremental detokenization with stop strings
scoring.py   scored rows (continuations, choices), their tokenization and results; logprobs
sequence.py  one admitted row: tokens, pages, how far its KV is computed
sampling.py  greedy, temperature, top-k, top-p with per-row noise keys

May import: the foundations (``config``, ``counters``, ``device``, ``pool``).
"""
