"""OpenAI batch files (issue 29): Batch API lines in (``input_format: openai`` or detected), the
OpenAI-shaped output and error files out (``output_format: openai``), validated with the
``openai`` package's own models; bad lines become error lines naming the line and custom_id;
a re-run after a kill writes both files whole, each custom_id once."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from test_jobrun import PAGES, WORDS, build_tiny, load_job, one_thread, write_job  # noqa: F401
from warm_runs import run_script

from slora_batch import Engine, EngineConfig, Request
from slora_batch.jobs.check import check_job
from slora_batch.jobs.openai_output import ERRORS_FILE, OUTPUT_FILE
from slora_batch.jobs.preview import preview
from slora_batch.jobs.run import run_job
from slora_batch.jobs.validate import validate_job

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
KEYS = dict(
    input="batch.jsonl", output_format="openai", part_rows=3, sampling={"max_new_tokens": 6}
)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, sample_model_dir):
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


def line(custom_id, url, body, method="POST") -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def good_lines(count: int) -> list[dict]:
    """Chat and completion lines over the base model (named three ways) and adapters a, b."""
    lines = []
    for i in range(count):
        text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 5))
        model = ["", "a", "b", "model", None, "a"][i % 6]
        if i % 2:
            body = {"model": model, "messages": [{"role": "user", "content": text}],
                    "max_completion_tokens": 4 + i % 3}  # fmt: skip
            lines.append(line(f"chat-{i}", CHAT, body))
        else:
            lines.append(
                line(f"cmpl-{i}", COMPLETIONS, {"model": model, "prompt": text, "max_tokens": 5})
            )
    return lines


def write_batch(path: Path, lines: list, raw: tuple[str, ...] = ()) -> None:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + "".join(r + "\n" for r in raw))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_batch_file_in_openai_files_out(tmp_path, tiny):
    lines = good_lines(8)
    lines[0]["body"].update(logprobs=2, temperature=0.0, stop=["zzz"], logit_bias={"1": 5})
    lines[1]["body"].update(logprobs=True, top_logprobs=3, frequency_penalty=0.5)
    lines[3]["body"].update(logit_bias={})
    lines[2]["metadata"] = {"run": "nightly"}
    lines.append(line("sampled", CHAT, {"model": "b", "n": 3, "temperature": 1.0, "seed": 7,
                                        "messages": [{"role": "user", "content": "hex"}]}))  # fmt: skip
    bad = [
        line(
            "unknown-model",
            CHAT,
            {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]},
        ),
        line("malformed", CHAT, {"model": "a", "messages": "hello"}),
        line("chat-1", COMPLETIONS, {"model": "a", "prompt": "dup"}),  # chat-1 repeated
        line("wrong-url", "/v1/embeddings", {"model": "a", "input": "x"}),
        line("wrong-method", CHAT, {"model": "a", "messages": []}, method="GET"),
    ]
    write_batch(tmp_path / "batch.jsonl", lines + bad, raw=("{not json",))
    summary = run_job(load_job(tmp_path, tiny, **KEYS))
    out = tmp_path / "out"
    output, errors = read_jsonl(out / OUTPUT_FILE), read_jsonl(out / ERRORS_FILE)

    assert sorted(x["custom_id"] for x in output) == sorted(x["custom_id"] for x in lines)
    engine = Engine(str(tiny.model), adapters=str(tiny.adapters),
                    config=EngineConfig(device="cpu", dtype="float32", num_pages=PAGES))  # fmt: skip
    by_id = {x["custom_id"]: x for x in output}
    expected_model = {None: "model", "": "model", "model": "model", "a": "a", "b": "b"}
    for given in lines:
        got = by_id[given["custom_id"]]
        assert got["error"] is None and got["id"].startswith("batch_req_")
        assert got["response"]["status_code"] == 200 and got["response"]["request_id"]
        body = given["body"]
        if given["url"] == CHAT:
            parsed = ChatCompletion.model_validate(got["response"]["body"])
            texts = [c.message.content for c in parsed.choices]
            assert parsed.object == "chat.completion"
        else:
            parsed = Completion.model_validate(got["response"]["body"])
            texts = [c.text for c in parsed.choices]
            assert parsed.object == "text_completion"
        assert parsed.model == expected_model[body["model"]]
        assert len(parsed.choices) == body.get("n", 1)
        assert [c.index for c in parsed.choices] == list(range(body.get("n", 1)))
        usage = parsed.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens > 0
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or 6
        for choice in parsed.choices:
            assert choice.finish_reason in ("stop", "length")
        if body.get("n", 1) == 1:  # greedy: the engine's own answer for the same request
            adapter = body["model"] if body["model"] in ("a", "b") else None
            (result,) = engine.generate([Request(
                id=0, adapter=adapter, prompt=body.get("prompt"), messages=body.get("messages"),
                max_new_tokens=limit, stop=body.get("stop"))])  # fmt: skip
            assert texts == [result.text] and usage.completion_tokens == result.completion_tokens
            assert usage.prompt_tokens == result.prompt_tokens
            assert (parsed.choices[0].finish_reason == "length") == (
                result.finish_reason == "length"
            )
    engine.close()

    # logprobs in OpenAI's two shapes: one entry per generated token, the asked alternatives
    completion = Completion.model_validate(by_id["cmpl-0"]["response"]["body"])
    lp = completion.choices[0].logprobs
    n_tokens = completion.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_tokens
    assert "".join(lp.tokens) == completion.choices[0].text
    assert all(len(top) <= 2 and max(top.values()) >= v for top, v in
               zip(lp.top_logprobs, lp.token_logprobs, strict=True))  # fmt: skip
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n_tokens)]
    chat = ChatCompletion.model_validate(by_id["chat-1"]["response"]["body"])
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob for e in content)
    assert all(e.bytes == list(e.token.encode()) for e in content)
    assert (
        ChatCompletion.model_validate(by_id["chat-3"]["response"]["body"]).choices[0].logprobs
        is None
    )

    # every bad line in the error file, its message naming the line and the custom_id; a
    # custom_id in one file only: a repeated one's first line is in the output file, the later
    # line an error line without a custom_id of its own
    failed = {x["custom_id"]: x for x in errors if x["custom_id"] is not None}
    unnamed = [x["error"]["message"] for x in errors if x["custom_id"] is None]
    assert len(errors) == len(bad) + 1 and all(x["response"] is None for x in errors)
    assert not set(failed) & {x["custom_id"] for x in output}
    first = len(lines) + 1  # the first bad line's number
    for offset, (custom_id, reason) in enumerate((
        ("unknown-model", "unknown model 'gpt-4o'"), ("malformed", "body.messages must be"),
        ("chat-1", "duplicate custom_id (first on batch.jsonl line 2)"),
        ("wrong-url", "url must be"), ("wrong-method", "method must be"),
    )):  # fmt: skip
        if custom_id == "chat-1":
            (message,) = [m for m in unnamed if "duplicate custom_id" in m]
        else:
            message = failed[custom_id]["error"]["message"]
        assert f"batch.jsonl line {first + offset}" in message and custom_id in message, message
        assert reason in message, message
    assert all(x["error"]["code"] for x in errors)
    (malformed,) = [m for m in unnamed if "malformed JSON" in m]
    assert f"line {first + len(bad)}" in malformed

    # unknown body fields reported with their counts, in the summary and by validate
    notes = [n for n in summary.notes if "OpenAI batch" in n]
    assert any("'logit_bias' in 2 lines" in n for n in notes), summary.notes
    assert any("'frequency_penalty' in 1 line " in n for n in notes), summary.notes
    assert any("line field 'metadata' in 1 line " in n for n in notes), summary.notes
    assert len(notes) == 3  # a line with a wrong url has no known fields to report against
    shown = preview(load_job(tmp_path, tiny, **KEYS), limit=20)  # the summary's examples
    assert {row.id for row in shown} == {x["custom_id"] for x in lines}
    report = validate_job(load_job(tmp_path, tiny, **KEYS, output="out-validate"))
    assert sorted(report.notes) == sorted(summary.notes)
    assert sum("unknown model 'gpt-4o'" in p for p in report.problems) == 1


def test_detection_from_the_first_line_and_input_format(tmp_path, tiny):
    write_batch(tmp_path / "batch.jsonl", good_lines(2))
    (tmp_path / "rows.jsonl").write_text(json.dumps({"id": 1, "prompt": "hi", "body": {}}) + "\n")
    assert check_job(load_job(tmp_path, tiny, input="batch.jsonl")).openai is not None
    assert check_job(load_job(tmp_path, tiny, input="rows.jsonl")).openai is None
    job = load_job(tmp_path, tiny, input="batch.jsonl", input_format="rows")
    assert check_job(job).openai is None  # told: rows, read as rows (no prompt column: errors)
    summary = run_job(job)
    assert summary.stats["error_rows"] == summary.stats["rows"] == 2
    job = load_job(tmp_path, tiny, input="rows.jsonl", input_format="openai", output="o2")
    assert check_job(job).openai is not None  # told: openai, a line without custom_id fails
    summary = run_job(job)
    assert summary.stats["error_rows"] == 1 and "custom_id must be" in summary.errors[0]


DRIVER = """
import os, signal, sys
from slora_batch.jobs import openai_output, writer

job_file, moment = sys.argv[1], sys.argv[2]
real_commit = writer.commit_file

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def after_part(path, write):
    real_commit(path, write)
    die()

def half_file(path, write):
    with open(path.with_name("." + path.name + ".tmp-x"), "wb") as handle:
        class Dying:
            def write(self, data):
                handle.write(data[: len(data) // 2])
                handle.flush()
                die()
        write(Dying())

if moment == "after-part":
    writer.commit_file = after_part
else:
    openai_output.commit_file = half_file

from cli import app
app(["run", job_file, "--quiet"])
"""


@pytest.mark.slow
def test_rerun_after_a_kill_writes_every_custom_id_once(tmp_path, tiny):
    lines = good_lines(10)
    write_batch(tmp_path / "batch.jsonl", lines + [lines[0]])  # one duplicate: an error line
    job_file = write_job(tmp_path, tiny, **KEYS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for moment in ("after-part", "openai-half"):  # each in a process forked from a warm one
        done = run_script(DRIVER, job_file, moment, cwd=tmp_path, env=env)
        assert done.returncode == -signal.SIGKILL, (moment, done.stderr[-2000:])
    out = tmp_path / "out"
    assert not (out / OUTPUT_FILE).exists()  # killed halfway: never a partial file
    summary = run_job(load_job(tmp_path, tiny, **KEYS))
    assert summary.rows_skipped > 0 and summary.rows_this_run < len(lines) + 1
    output, errors = read_jsonl(out / OUTPUT_FILE), read_jsonl(out / ERRORS_FILE)
    assert sorted(x["custom_id"] for x in output) == sorted(x["custom_id"] for x in lines)
    assert [x["custom_id"] for x in errors] == [None]  # the repeated line: its id is taken
    assert f'custom_id "{lines[0]["custom_id"]}": duplicate' in errors[0]["error"]["message"]
    (out / OUTPUT_FILE).unlink()  # a complete job rebuilds a missing file, the same lines
    run_job(load_job(tmp_path, tiny, **KEYS))
    rebuilt = read_jsonl(out / OUTPUT_FILE)
    strip = [{**x, "response": {**x["response"], "body": {**x["response"]["body"], "created": 0}}}
             for x in rebuilt]  # fmt: skip
    again = [{**x, "response": {**x["response"], "body": {**x["response"]["body"], "created": 0}}}
             for x in output]  # fmt: skip
    assert sorted(strip, key=str) == sorted(again, key=str)
