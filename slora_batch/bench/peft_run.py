"""The ``peft`` system: transformers + PEFT mixed-adapter ``generate`` over padded static batches.

Up to 100 adapters are loaded into one ``PeftModel`` over the shared base model; each batch of
``peft_batch`` left-padded rows names its adapter per row (``adapter_names``, PEFT's mixed-batch
inference), runs greedy to its longest output, and counts only the tokens each row asked for.
With ``peft_max_seconds`` no batch starts after the limit and the one running is cut there
(``max_time``); a cut batch counts min(asked, generated) per row, which favours PEFT.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from pathlib import Path

import torch

from slora_batch.bench.roofline import Work
from slora_batch.bench.row_fields import figures
from slora_batch.bench.timed_run import COUNTERS, sync
from slora_batch.bench.workload import adapter_sources

log = logging.getLogger(__name__)

PAD_ID = 0


def load_peft(hf_model, sources: dict[str, Path]):
    """One ``PeftModel`` over ``hf_model`` holding every adapter of ``sources`` (by name), in
    eval mode. The caller calls ``unload()`` after, to give the base model its modules back."""
    from peft import PeftModel

    names = list(sources)
    # PEFT upcasts bf16 adapters to fp32 unless told not to: keep them in the model's dtype
    keep = {"autocast_adapter_dtype": False}
    if "autocast_adapter_dtype" not in inspect.signature(PeftModel.load_adapter).parameters:
        keep = {}
    peft_model = PeftModel.from_pretrained(
        hf_model, sources[names[0]], adapter_name=names[0], **keep
    )
    try:
        for name in names[1:]:
            peft_model.load_adapter(sources[name], adapter_name=name, **keep)
    except BaseException:
        peft_model.unload()
        raise
    return peft_model.eval()


def run_peft(ctx, n: int) -> dict:
    cfg, model = ctx.config, ctx.model
    device = model.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    peft_model = load_peft(model.hf_model, adapter_sources(n, ctx.rank_dirs))
    try:
        rows = list(
            zip(
                ctx.workload.prompts,
                ctx.workload.output_lens,
                ctx.workload.adapters(n),
                strict=True,
            )
        )[: cfg.peft_requests]
        _generate(peft_model, rows[:2], device, max_new=2, deadline=None)  # warm-up, not counted
        sync(device)
        setup_s = time.perf_counter() - start
        work, finished, batches, cut = Work(), 0, 0, False
        start = time.perf_counter()
        deadline = start + cfg.peft_max_seconds if cfg.peft_max_seconds else None
        for first in range(0, len(rows), cfg.peft_batch):
            if deadline is not None and time.perf_counter() >= deadline:
                cut = True
                break
            batch = rows[first : first + cfg.peft_batch]
            want = max(out for _, out, _ in batch)
            steps = _generate(peft_model, batch, device, want, deadline)
            batches += 1
            if steps < want:
                cut = True
                if deadline is None or time.perf_counter() < deadline:
                    log.warning(
                        "peft batch stopped after %d of %d tokens before the time limit",
                        steps,
                        want,
                    )
            for prompt, out, _ in batch:
                work.add(len(prompt), min(out, steps))
                finished += steps >= out
            if cut:
                break
        sync(device)
        wall_s = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else math.nan
    finally:
        peft_model.unload()  # gives the base model its own modules back for the next runs
        del peft_model
    log.info("peft: %d adapters, %d batches of up to %d rows", n, batches, cfg.peft_batch)
    row = dict(
        system="peft",
        adapters=n,
        requests=len(rows),
        fed=min(len(rows), batches * cfg.peft_batch),
        finished=finished,
        error_rows=0,
        length_mismatches=0,
        truncated=cut,
        setup_s=setup_s,
        peak_mem_gib=peak,
    )
    row.update(figures(ctx, work, finished, wall_s))
    row.update(dict.fromkeys(COUNTERS, math.nan))  # engine counters: none of them apply
    row.update(
        adapter_loads=float(n),
        host_share=math.nan,
        decode_host_share=math.nan,
        decode_batch=float(cfg.peft_batch),
    )
    return row


def _generate(
    peft_model,
    batch: list[tuple[list[int], int, str]],
    device: torch.device,
    max_new: int,
    deadline: float | None,
) -> int:
    """Greedy generation of one left-padded batch; returns the number of new positions."""
    width = max(len(prompt) for prompt, _, _ in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)  # [B, width]
    mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, width], 0 on padding
    for row, (prompt, _, _) in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    kwargs = dict(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        adapter_names=[name for _, _, name in batch],
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=PAD_ID,
    )
    if deadline is not None:
        kwargs["max_time"] = max(deadline - time.perf_counter(), 1e-3)
    with torch.inference_mode():
        out = peft_model.generate(**kwargs)  # [B, width + steps]
    return out.shape[1] - width
