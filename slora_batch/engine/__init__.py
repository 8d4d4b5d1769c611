"""One base model and many LoRA adapters: requests in, results out (S-LoRA).

request.py    Request, Result: what goes in and what comes out
config.py     EngineConfig, SamplingConfig: every engine and sampling default, validated
engine.py     Engine: the public iterator over the continuous-batching loop
data_parallel.py  DataParallelEngine: Engine's surface over worker processes, one device each
dp_worker.py  a data-parallel worker: its device(s), its engine, its pipes to the driver
dp_handle.py  the driver's handle on a worker: its share of the stream, what rows still owe
tp.py         S-LoRA tensor parallelism: the cuts, rank 0's plan to the other ranks, a rank's loop
parts.py      what an engine builds on its device (store, model, pool, residency, runner)
prepare.py    a request becomes a sequence, or an error result saying why
scheduler.py  owns a sequence's life: admit, chunked prefill, finish, hold, release, preempt
admission.py  how waiting rows join a step: clustering by adapter, room, prefix waits
kv_pages.py   the pages of sequences: KV pages, cached prefix blocks, the room a row needs
prefix_cache.py  full prompt blocks of KV kept and shared by rows of the same adapter
sequence.py   one admitted row: tokens, pages, how far its KV is computed
batch.py      the one step planner: a scheduled step as flat arrays for the model and kernels
outputs.py    a step's outputs on the device (tokens, scores, logprobs) until they are read back
scoring.py    scored rows (continuations, choices), their tokenization and results; logprobs
runner.py     runs a planned step: eager, or a replayed CUDA graph for decode steps
model.py      the Llama family forward over the page pool, base and LoRA decomposed
loader.py     weights from Hugging Face safetensors into the model
sample_model.py  the built-in sample (SmolLM2-135M-Instruct from its GGUF, converted once)
spec.py       a model directory's shapes and the page geometry they imply
pool.py       the unified page pool: one tensor, one free list, KV and adapter weights alike
residency.py  adapters resident in the pool: slots, refcounts, LRU eviction
adapters.py   PEFT adapters: parsing, validation, the host store and its loader thread
prefetch.py   adapters ahead of their rows: disk -> host, host -> device pages
memory.py     device, dtype and how many pages the pool gets
sampling.py   greedy, temperature, top-k, top-p with per-row noise keys
tokens.py     the tokenizer, chat templates and incremental detokenization with stop strings
counters.py   what an engine run counts (steps, loads, evictions, time)

``Engine`` is imported on first use (``from slora_batch.engine import Engine`` works), so the
settings and request types load without torch.
"""


def __getattr__(name: str):
    if name == "Engine":
        from slora_batch.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'slora_batch.engine' has no attribute {name!r}")
