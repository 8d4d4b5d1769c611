"""Feeding the engine: ``RunRecord`` hands one run's requests to the engine and writes every
result as it comes, bad rows' too; it keeps the run's account as it goes: progress events,
times, per-adapter spans and a few error messages.

Rows are output rows: one sample of one input row for one adapter (``samples.py``). A request
of n samples is n rows; one that fails is one error row, and the total drops by the rest."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from slora_batch.engine.requests.request import Request, Result
from slora_batch.jobs.progress import JobProgress, ProgressCallback
from slora_batch.jobs.samples import SamplesDue
from slora_batch.jobs.writer import OutputWriter

ERROR_EXAMPLES = 3  # error messages of a run kept for the summary


class RunRecord:
    """This run's accounting: progress, times, per-adapter spans, a few error messages."""

    def __init__(
        self,
        job: str,
        done: int,
        total: int | None,
        notify: ProgressCallback,
        on_result: Callable[[Result], None] | None = None,
    ) -> None:
        self.job, self.done, self.total, self.notify = job, done, total, notify
        self.skipped = done  # rows committed before this run
        self.on_result = on_result  # handed every result once it is written (an eval job's)
        self.due = SamplesDue()
        self.counters = None  # the engine's, once it runs
        self.device: str | None = None  # the engine's device and dtype, once it runs
        self.dtype: str | None = None
        self.rows = 0
        self.tokens = 0  # completion tokens of this run's rows
        self.prompt_tokens = 0  # prompt tokens of this run's rows (error rows compute none)
        self.row_tokens = 0  # all the tokens this run's rows took: ``row_work``
        self.error_rows = 0
        self.errors: list[str] = []
        self.first_in: dict[str | None, float] = {}  # adapter -> first row handed to the engine
        self.last_out: dict[str | None, float] = {}  # adapter -> its last result
        # adapter -> this run's rows and their tokens ("rows", "prompt_tokens",
        # "completion_tokens"; error rows count as rows and compute no tokens)
        self.per_adapter: dict[str | None, dict[str, int]] = {}
        self.generated_rows = 0  # ok rows of this run that generated (not scored)
        self.empty_rows = 0  # those of them whose text is empty (or only whitespace)
        self.requests = self.raw_prompts = 0  # requests handed to the engine; raw text ones
        self.started = time.perf_counter()
        self.load_s = self.read_s = self.write_s = self.engine_s = 0.0
        self._writer: OutputWriter | None = None  # the loop's, for its write time so far
        self._read_base = self._write_base = 0.0  # read and write time before the loop

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @property
    def engine_elapsed(self) -> float:
        """This run's engine time so far: since the engine was ready, less the loop's reading
        of input and writing of parts (``engine_s`` once the loop ends)."""
        if self._writer is None:
            return self.elapsed
        read = self.read_s - self._read_base
        write = self._writer.write_s - self._write_base
        return max(self.elapsed - read - write, 0.0)

    @property
    def resident(self) -> int:
        return 0 if self.counters is None else self.counters.adapters_resident

    def feed(
        self, engine, items: Iterator[tuple[Request | Result, int]], writer: OutputWriter
    ) -> None:
        """Hand the requests to the engine and write every result as it comes: the engine's,
        and the bad rows' that never reach it (written as the engine pulls past them, so a long
        run of bad rows is never held in memory). Each item comes with the rows it owes (the
        samples it asks for; ``resume.pending_items``)."""
        self.counters = engine.counters
        self.device, self.dtype = str(engine.device), str(engine.dtype).removeprefix("torch.")
        self.started = time.perf_counter()
        self._writer, self._read_base, self._write_base = writer, self.read_s, writer.write_s

        def requests() -> Iterator[Request]:
            while True:
                pulled = time.perf_counter()
                item, samples = next(items, (None, 0))
                self.read_s += time.perf_counter() - pulled
                if item is None:
                    return
                if isinstance(item, Result):
                    self._done(item, writer, samples)
                else:
                    self.due.add(item, samples)
                    self.requests += 1
                    self.raw_prompts += item.prompt is not None  # no chat template applied
                    self.first_in.setdefault(item.adapter, time.perf_counter())
                    writer.tick()  # commits by time also while no row finishes
                    yield item

        for result in engine.generate(requests()):
            self.last_out[result.adapter] = time.perf_counter()
            self._done(result, writer, self.due.finished(result))
        self.engine_s = self.engine_elapsed  # the loop's time less reading and writing

    def _done(self, result: Result, writer: OutputWriter, samples: int = 1) -> None:
        """Write ``result``, which stands for ``samples`` rows of the total (an error row for
        a row of n samples stands for n)."""
        writer.write(result)
        if self.on_result is not None:
            self.on_result(result)
        if self.total is not None:
            self.total -= samples - 1
        self.done += 1
        self.rows += 1
        adapter = self.per_adapter.setdefault(
            result.adapter, {"rows": 0, "prompt_tokens": 0, "completion_tokens": 0}
        )
        adapter["rows"] += 1
        if result.error is None:
            self.tokens += result.completion_tokens
            self.prompt_tokens += result.prompt_tokens
            self.row_tokens += row_work(result)
            adapter["prompt_tokens"] += result.prompt_tokens
            adapter["completion_tokens"] += result.completion_tokens
            if result.finish_reason != "score":
                self.generated_rows += 1
                self.empty_rows += not result.text.strip()
        else:
            self.error_rows += 1
            if len(self.errors) < ERROR_EXAMPLES:
                self.errors.append(result.error)
        self.notify(
            JobProgress(
                self.job,
                "running",
                self.done,
                self.total,
                self.tokens,
                self.engine_elapsed,
                self.resident,
                self.rows,
                self.computed,
                self.row_tokens,
            )
        )

    def finished(self, rows: int) -> JobProgress:
        """The run's last progress event: the output complete with ``rows`` (an error row
        stands for its samples), at the stats' rates."""
        return JobProgress(
            self.job,
            "done",
            rows,
            rows,
            self.tokens,
            self.engine_s,
            self.resident,
            self.rows,
            self.computed,
            self.row_tokens,
        )

    @property
    def computed(self) -> int:
        """Tokens the engine computed this run: prefill (scored continuations included) and
        decode."""
        c = self.counters
        return getattr(c, "prefill_tokens", 0) + getattr(c, "decode_tokens", 0)


def row_work(result: Result) -> int:
    """The tokens a finished row took: its prompt, its output and its scored continuations."""
    scored = (result.continuation_tokens or 0) + sum(result.choice_tokens or ())
    return result.prompt_tokens + result.completion_tokens + scored
