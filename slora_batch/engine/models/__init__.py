"""Models: what a checkpoint is and how its forward runs over the page pool.

spec.py          a model directory's shapes and the page geometry they imply (no torch)
configs.py       each family's config.json switches (RoPE, windows, norms, soft-caps, experts;
                 no torch)
registry.py      the model families, keyed by the checkpoint's ``architectures``
step.py          what one forward step reads besides the weights (StepInput)
decoder.py       the forward every family runs, base and LoRA decomposed, switched by the spec
llama.py         the Llama family (Llama, Mistral, Qwen2): its layer weights
qwen3.py         Qwen3: Llama's plus q/k norms
gemma.py         Gemma 2 and 3: (1 + w) norms folded, the extra norms, q/k norms (Gemma 3)
phi3.py          Phi-3/3.5/4: fused qkv and gate_up weights (and fused LoRA targets)
moe_families.py  Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: their MoE layers' weights
moe.py           the mixture-of-experts block: its weights, routing, and the experts' forward
layers.py        what the families share: RoPE variants, the LoRA deltas of a projection group
shard.py         tensor parallelism's cuts of the weights that need no process group
weights.py       the checkpoint's tensors by name, cut per rank, fp8 or (1 + w) as a family needs
loader.py        weights from Hugging Face safetensors into the model of their family
sample_model.py  the built-in sample (SmolLM2-135M-Instruct from its GGUF, converted once)

RMSNorm, attention and the activation run through the kernel backend (``slora_kernels``).
May import: the foundations (``config``, ``counters``, ``device``, ``pool``) and ``slora_kernels``;
nothing of execution: a rank's group is ``shard.RankGroup`` (execution.tp's TensorParallel is one).
"""
