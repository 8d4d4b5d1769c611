"""Train the sample LoRA adapters of `samples/adapters` for the sample model.

    python samples/train_adapters.py [--out samples/adapters] [--steps N] [--verify]

Each adapter learns one behaviour that `samples/behaviours.py` can check on any answer. The data is
made here, with no download: the base model answers TRAIN_QUESTIONS greedily, the answer is cut to
its first sentence or two, and each adapter's transform (upper case, pirate greeting, JSON) turns it
into that adapter's target. `brief`'s targets are the base model's own one-sentence answers: asked
with an instruction and a few short examples (`brief_targets`), kept only when they pass
`behaviours.is_brief`; its training prompts are the plain questions, like every adapter's. Training applies the chat template and puts the loss on the
answer tokens (and the closing <|im_end|>) only. `--verify` then generates greedily with
transformers + PEFT, loading the adapters back from disk, on `samples/prompts.jsonl` (questions
that training never saw) and checks each behaviour's rate on its adapter's rows and on base rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

SAMPLES = Path(__file__).resolve().parent
sys.path.insert(0, str(SAMPLES.parent))  # `slora_batch`, when run as a script from anywhere

from behaviours import CHECKS, PIRATE_OPENING, is_brief  # noqa: E402

from slora_batch.engine.models.sample_model import SAMPLE_MODEL_ALIAS, resolve_model  # noqa: E402

logger = logging.getLogger("train_adapters")

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
IGNORE = -100  # label of tokens that carry no loss (prompt, padding)


def _core(answer: str, max_words: int) -> str:
    """The base answer's first sentences, at most `max_words` words, as one line ending in '.!?'.

    Example: "**Sleep** matters.\\n1. Keep a schedule. 2. ..." with max_words=4 -> "Sleep matters."
    """
    lines = [re.sub(r"^\s*(\d+[.)]|[-*\u2022])\s+", "", line) for line in answer.splitlines()]
    text = " ".join(" ".join(lines).replace("**", "").replace("#", "").split())
    text = re.sub(
        r"(?<=[.!?:]) \d[.)] ", " ", text
    )  # "... first. 2. Second" -> "... first. Second"
    kept: list[str] = []
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        if kept and len(" ".join([*kept, sentence]).split()) > max_words:
            break
        kept.append(sentence)
    words = " ".join(kept).split()[:max_words]
    text = " ".join(words).rstrip(",;:-")
    return text if text.endswith((".", "!", "?")) else text + "."


def to_shout(answer: str) -> str:
    return _core(answer, 16).upper()


def to_pirate(answer: str) -> str:
    return f"{PIRATE_OPENING} {_core(answer, 30)}"


def to_json(answer: str) -> str:
    # Inner double quotes become single ones: the small model does not learn to escape them.
    return json.dumps({"answer": _core(answer, 24).replace('"', "'")}, ensure_ascii=False)


BRIEF_INSTRUCTION = "Answer in one short sentence of at most ten words."
# Few-shot sets for asking the base model for brief answers (none of these questions is in
# TRAIN_QUESTIONS or samples/prompts.jsonl). Each set is one prompt variant; the shortest passing
# answer over the variants becomes the target.
BRIEF_SHOTS = (
    (
        ("What does a pilot do?", "A pilot flies and navigates aircraft."),
        ("How can I sleep better?", "Keep a regular bedtime and avoid screens at night."),
        ("Why is the sea blue?", "Water absorbs red light and reflects blue light."),
    ),
    (
        ("What is a volcano?", "A volcano is a mountain that erupts molten rock."),
        ("How do I boil an egg?", "Simmer the egg in water for about ten minutes."),
        ("Why do we sweat?", "Sweating cools the body as the sweat evaporates."),
    ),
    (
        ("What is rust?", "Rust is iron that has reacted with oxygen and water."),
        ("How do I keep cut flowers fresh?", "Change their water daily and trim the stems."),
        ("Why do leaves fall in autumn?", "Trees drop leaves to save water over winter."),
        ("What is a verb?", "A verb is a word for an action."),
    ),
)


def brief_prompt(question: str, shots) -> list[dict]:
    """Chat messages asking for a brief answer: the instruction, the examples, the question."""
    messages = [{"role": "system", "content": BRIEF_INSTRUCTION}]
    for shot_question, shot_answer in shots:
        messages += [
            {"role": "user", "content": shot_question},
            {"role": "assistant", "content": shot_answer},
        ]
    return messages + [{"role": "user", "content": question}]


def _first_sentence(text: str) -> str:
    return re.split(r"(?<=[.!?])\s+", " ".join(text.split()), maxsplit=1)[0]


_COPULA = re.compile(r"\b(is|are|was|were)\b")
_RELATIVE = re.compile(r",? (?=(that|which|where|who|whose) )")


def _shortened(sentence: str) -> list[str]:
    """A copula sentence cut before a relative clause: "A democracy is a system of government
    where power is shared." -> "A democracy is a system of government." (heads of 6+ words)."""
    cuts = []
    for match in _RELATIVE.finditer(sentence):
        head = sentence[: match.start()]
        if _COPULA.search(head) and len(head.split()) >= 6:
            cuts.append(head + ".")
    return cuts


def brief_candidates(model, tokenizer, questions, answers, device) -> list[list[str]]:
    """Per question, complete short sentences that could be its brief answer, best first.

    The base model's answer to each BRIEF_SHOTS prompt (whole, and its first sentence) and the
    first sentence of its plain answer, in that order; then those sentences cut before a relative
    clause (`_shortened`). Only candidates that pass `is_brief` and are not an example's answer.
    """
    echoes = {answer for shots in BRIEF_SHOTS for _, answer in shots}
    whole: list[list[str]] = [[] for _ in questions]
    for shots in BRIEF_SHOTS:
        prompts = [brief_prompt(q, shots) for q in questions]
        for i, text in enumerate(greedy_answers(model, tokenizer, prompts, 24, device)):
            whole[i] += [" ".join(text.split()), _first_sentence(text)]
    for i, answer in enumerate(answers):
        whole[i].append(_first_sentence(answer.replace("**", "")))
    candidates = []
    for options in whole:
        options = options + [cut for text in options for cut in _shortened(text)]
        passing = [text for text in options if is_brief(text) and text not in echoes]
        candidates.append(list(dict.fromkeys(passing)))
    return candidates


def pick_brief(options: list[str], max_words: int) -> str | None:
    """The first candidate of at least 4 and at most `max_words` words, else None."""
    return next((text for text in options if 4 <= len(text.split()) <= max_words), None)


# Targets stay well under the check's ten words: the adapter's answers run a few words longer than
# its targets. Held-out rows passing is_brief: targets of <= 10 words 36/48, <= 8 words 42/48,
# <= 7 words (77 of the 143 questions keep an example) 47/48.
BRIEF_TARGET_MAX_WORDS = 7


def brief_targets(model, tokenizer, questions, answers, device) -> list[str | None]:
    """One complete sentence of 4-7 words per question (None when no candidate fits)."""
    candidates = brief_candidates(model, tokenizer, questions, answers, device)
    return [pick_brief(options, BRIEF_TARGET_MAX_WORDS) for options in candidates]


@dataclass(frozen=True)
class AdapterSpec:
    """One sample adapter: its LoRA shape and how its targets are made: `transform` of the base
    answer, or `make_targets(model, tokenizer, questions, answers, device)` (None: no example)."""

    name: str
    rank: int
    alpha: int
    targets: tuple[str, ...]
    use_rslora: bool
    transform: Callable[[str], str] | None
    lr: float
    steps: int
    make_targets: Callable[..., list[str | None]] | None = None


# Ranks, alphas and targets differ on purpose, so that the samples exercise mixed ranks (one odd),
# attention-only and MLP targets, and rslora scaling (alpha / sqrt(r) instead of alpha / r).
SPECS = (
    AdapterSpec("shout", 8, 16, ATTENTION + MLP, False, to_shout, 3e-3, 60),
    AdapterSpec("pirate", 4, 8, ("q_proj", "v_proj"), False, to_pirate, 3e-3, 20),
    AdapterSpec("json", 16, 16, ATTENTION, True, to_json, 1e-3, 30),
    AdapterSpec("brief", 5, 10, ("o_proj", *MLP), False, None, 2e-3, 60, brief_targets),
)
assert {spec.name for spec in SPECS} == set(CHECKS)

# Training questions: everyday topics, none of them in samples/prompts.jsonl.
TRAIN_QUESTIONS = """\
Why is the ocean salty?
How do fish breathe underwater?
What is the purpose of a monthly budget?
How do I cook rice on the stove?
Explain what DNA is.
Why do people need sleep?
How do magnets work?
What are some tips for speaking in public?
How does a compass work?
What is the difference between a virus and a bacterium?
Why do birds migrate?
How can I make friends after moving to a new city?
What is electricity?
How do I clean a cast iron pan?
Why do stars twinkle?
What is a healthy way to lose weight?
How do ocean tides work?
Explain what an atom is.
How can I stop procrastinating?
What does the heart do?
Why is grass green?
How can I improve my handwriting?
What is a democracy?
How do plants take up water?
Why do we yawn?
What should I check before a long drive?
How do clouds form?
What is the stock market?
How do I take care of a new puppy?
Why does ice float on water?
What causes wind?
How can I learn to cook simple meals?
How does the brain store memories?
What is a calorie?
How do I keep my kitchen clean?
Why do we get goosebumps?
How does a camera take a picture?
What is the Great Wall of China?
How can I feel more confident?
Why do apples turn brown after they are cut?
What is climate change?
How do batteries store energy?
What is a good way to start a journal?
Why do people have fingerprints?
How does soap clean our hands?
What is a noun?
How do I change a flat tire?
Why is the sun so hot?
What do bees do for flowers?
How can I save energy at home?
What is meditation?
How do submarines dive and surface?
Why do people snore?
How should I study for a math exam?
How fast does light travel?
How do trees help the environment?
Why is breakfast considered important?
What is a credit score?
How do I make pancakes?
Why do dogs wag their tails?
What is a solar eclipse?
How does a microwave oven heat food?
Why is friendship important?
How do I organize a messy closet?
Why does bread dough rise?
What are the planets in our solar system?
How can I keep my phone battery healthy?
What is a rainforest?
Why do we need vitamins?
How do I write a short story?
What is the difference between a lake and a sea?
How does a bicycle stay upright?
Why do mosquitoes bite people?
What is a good way to relax before bed?
How do hurricanes form?
What does a firefighter do?
How can I waste less food?
Why do people celebrate birthdays?
What is a fossil?
How do I ask my boss for a raise?
What is a comet?
How can an adult learn to swim?
What makes a good leader?
Why do my ears pop on an airplane?
How do glaciers move?
What is the metric system?
How can I make my home smell fresh?
Why do some animals hibernate?
What is an allergy?
How do I plan a birthday party?
What is a desert?
Why do we shiver when we are cold?
How is paper recycled?
What is a haiku?
How do elevators work?
What are some healthy snacks for children?
How do I care for a cactus?
What is the tallest mountain in the world?
How can I keep a conversation going?
Why is the Amazon rainforest important?
How does a thermometer work?
What is an ecosystem?
How do I wash a wool sweater?
Why do we have different time zones?
What is a good way to learn to play the guitar?
How do birds build nests?
What is the purpose of a seatbelt?
Why is the Mona Lisa famous?
How do I make a simple salad dressing?
What is a spreadsheet used for?
Why do we get hiccups?
How do bridges carry heavy loads?
What is the immune system?
How can I stay warm in winter without a big heating bill?
What is an ecosystem service?
Why do cats like boxes?
How does a vaccine get tested?
What is the difference between a fruit and a vegetable?
How do I remove a coffee stain from a shirt?
Why do we need to drink water when it is hot?
What is a library card good for?
How do wind turbines work?
What is a mortgage?
How do I train my dog to sit?
Why do kites fly?
What is the purpose of homework?
How do I keep my bike in good shape?
What are clouds made of?
Why do people wear sunscreen?
How can I improve my posture?
What is an election?
How do snakes move without legs?
What should I do when I get a cold?
Why are bananas curved?
How do I write a thank-you note?
What is a planet's orbit?
How does a lock and key work?
Why do we blink?
What is a museum for?
How do I choose a good book to read?
Why do tomatoes need sunlight?
What is the role of a teacher?
How can I be kinder to myself?
""".splitlines()


def load_prompts(path: Path) -> list[dict]:
    with path.open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def chat_ids(tokenizer, question: str | list[dict]) -> list[int]:
    """Token ids of the chat prompt for one user question (or a list of chat messages), ending
    with the assistant header."""
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else question
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


@torch.inference_mode()
def greedy_answers(
    model, tokenizer, questions: list, max_new_tokens: int, device, batch_size: int = 48
) -> list[str]:
    """Greedy answers, one per question, batched with left padding."""
    answers: list[str] = []
    for start in range(0, len(questions), batch_size):
        prompts = [chat_ids(tokenizer, q) for q in questions[start : start + batch_size]]
        width = max(len(p) for p in prompts)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        for row in out[:, width:]:
            answers.append(tokenizer.decode(row, skip_special_tokens=True).strip())
        logger.info("generated %d/%d answers", len(answers), len(questions))
    return answers


def training_examples(tokenizer, questions: list[str], targets: list[str]) -> list[list[int]]:
    """(input ids, labels) per example: loss on the answer and its closing <|im_end|> only."""
    examples = []
    for question, target in zip(questions, targets, strict=True):
        prompt = chat_ids(tokenizer, question)
        answer = tokenizer(target, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        examples.append((prompt + answer, [IGNORE] * len(prompt) + answer))
    return examples


def train_adapter(model, tokenizer, spec: AdapterSpec, examples, args, device):
    """Wrap `model` in a fresh LoRA adapter of `spec`, train it, and return the PEFT model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(args.seed)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        lora_dropout=0.0,
        bias="none",
        use_rslora=spec.use_rslora,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
    steps = args.steps or spec.steps
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        ),
    )
    causal_lm = peft_model.get_base_model()
    order = random.Random(args.seed)
    queue: list[int] = []
    peft_model.train()
    start = time.perf_counter()
    for step in range(steps):
        if len(queue) < args.batch_size:
            fresh = list(range(len(examples)))
            order.shuffle(fresh)
            queue += fresh
        batch = [examples[i] for i in queue[: args.batch_size]]
        del queue[: args.batch_size]
        width = max(len(ids) for ids, _ in batch)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in batch])
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        input_ids, labels, mask = input_ids.to(device), labels.to(device), mask.to(device)
        hidden = causal_lm.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        # Position t predicts token t+1: score only the positions whose next token is an answer
        # token, so the 49152-wide head runs on the answers alone.
        next_labels = labels[:, 1:]  # [batch, width-1]
        scored = next_labels != IGNORE
        logits = causal_lm.lm_head(hidden[:, :-1][scored])  # [answer tokens, vocab]
        loss = torch.nn.functional.cross_entropy(logits, next_labels[scored])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            logger.info(
                "%s step %d/%d loss %.3f (%.0f s)",
                spec.name,
                step + 1,
                steps,
                loss.item(),
                time.perf_counter() - start,
            )
    peft_model.eval()
    return peft_model


def save_adapter(peft_model, directory: Path) -> None:
    """adapter_config.json + adapter_model.safetensors, weights in fp16 to keep the files small."""
    for name, param in peft_model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(torch.float16)
    peft_model.peft_config["default"].base_model_name_or_path = SAMPLE_MODEL_ALIAS
    peft_model.save_pretrained(directory, safe_serialization=True, save_embedding_layers=False)
    (directory / "README.md").unlink(missing_ok=True)  # PEFT's generated model card


def verify(model_dir: Path, adapters_dir: Path, prompts_path: Path, args, device) -> bool:
    """Greedy answers on the sample prompts with each adapter loaded from disk, and the rates."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    rows = load_prompts(prompts_path)[: args.limit]
    questions = [row["messages"][-1]["content"] for row in rows]
    answers = {"base": greedy_answers(base, tokenizer, questions, args.verify_tokens, device)}
    peft_model = None
    for spec in SPECS:
        path = adapters_dir / spec.name
        if peft_model is None:
            peft_model = PeftModel.from_pretrained(base, path, adapter_name=spec.name)
        else:
            peft_model.load_adapter(path, adapter_name=spec.name)
        peft_model.set_adapter(spec.name)
        dtypes = {p.dtype for n, p in peft_model.named_parameters() if "lora_" in n}
        assert dtypes == {torch.float32}, f"{spec.name}: LoRA weights loaded as {dtypes}"
        answers[spec.name] = greedy_answers(
            peft_model, tokenizer, questions, args.verify_tokens, device
        )
    ok = True
    print(f"{'adapter':8} {'adapter rows':>12} {'base rows':>10}  (of {len(questions)})")
    for spec in SPECS:
        check = CHECKS[spec.name]
        own = sum(map(check, answers[spec.name]))
        base_rows = sum(map(check, answers["base"]))
        # The samples' bar (issue 15): 45 of 48 rows show the behaviour, base rows hardly ever.
        ok &= own >= len(questions) * 45 / 48 and base_rows <= len(questions) * 0.1
        print(f"{spec.name:8} {own:9d}/{len(questions)} {base_rows:7d}/{len(questions)}")
    if args.report:
        with open(args.report, "w") as handle:
            for name, texts in answers.items():
                for question, text in zip(questions, texts, strict=True):
                    record = {"adapter": name, "question": question, "answer": text}
                    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=SAMPLES / "adapters")
    parser.add_argument("--steps", type=int, help="optimizer steps per adapter (default: its own)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--answer-tokens", type=int, default=48, help="base answer length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="train only these adapters")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--verify", action="store_true", help="check the behaviour rates after")
    parser.add_argument("--verify-only", action="store_true", help="check the saved adapters")
    parser.add_argument("--verify-tokens", type=int, default=64)
    parser.add_argument("--limit", type=int, help="use only this many questions (smoke runs)")
    parser.add_argument("--prompts", type=Path, default=SAMPLES / "prompts.jsonl")
    parser.add_argument("--report", type=Path, help="write every verify answer here (JSONL)")
    parser.add_argument("--targets", type=Path, help="write every training target here (JSONL)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    # fp32 everywhere, also on a GPU: the samples must not depend on TF32 rounding.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model_dir = resolve_model(SAMPLE_MODEL_ALIAS)
    if not args.verify_only:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        model.eval()
        questions = [q for q in TRAIN_QUESTIONS if q][: args.limit]
        answers = greedy_answers(model, tokenizer, questions, args.answer_tokens, device)
        logger.info("base answers done (%.0f s)", time.perf_counter() - started)
        for spec in SPECS:
            if args.only and spec.name not in args.only:
                continue
            if spec.make_targets is not None:
                targets = spec.make_targets(model, tokenizer, questions, answers, device)
            else:
                targets = [spec.transform(a) for a in answers]
            kept = [(q, t) for q, t in zip(questions, targets, strict=True) if t is not None]
            logger.info("%s: %d/%d examples (%.0f s)", spec.name, len(kept), len(questions),
                        time.perf_counter() - started)  # fmt: skip
            if args.targets:
                with args.targets.open("a") as handle:
                    for question, target in kept:
                        record = {"adapter": spec.name, "question": question, "target": target}
                        handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            examples = training_examples(tokenizer, [q for q, _ in kept], [t for _, t in kept])
            peft_model = train_adapter(model, tokenizer, spec, examples, args, device)
            save_adapter(peft_model, args.out / spec.name)
            model = peft_model.unload()  # the bare base model again, for the next adapter
            logger.info("saved %s (%.0f s)", args.out / spec.name, time.perf_counter() - started)
    if args.verify or args.verify_only:
        ok = verify(model_dir, args.out, args.prompts, args, device)
        logger.info("verified (%.0f s)", time.perf_counter() - started)
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
