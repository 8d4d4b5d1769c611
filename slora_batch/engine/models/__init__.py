"""Models: what a checkpoint is and how its forward runs over the page pool.

spec.py          a model directory's shapes and the page geometry they imply (no torch)
registry.py      the model families, keyed by the checkpoint's ``architectures``
llama.py         the Llama family (Llama, Mistral, Qwen2) forward, base and LoRA decomposed
layers.py        what the families share: RoPE variants, the LoRA deltas of a projection group
shard.py         tensor parallelism's cuts of the weights that need no process group
loader.py        weights from Hugging Face safetensors into the model of their family
sample_model.py  the built-in sample (SmolLM2-135M-Instruct from its GGUF, converted once)

RMSNorm, attention and the activation run through the kernel backend (``kernels``).
May import: the foundations (``config``, ``counters``, ``device``, ``pool``) and ``kernels``;
``execution.tp``'s ``TensorParallel`` for annotations only (TYPE_CHECKING).
"""
