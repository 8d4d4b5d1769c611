"""``slora-batch bench``: the workload of benchmarks/README.md through every system, in one process.

bench.py       settings, the plan of runs, orchestration
cli.py         the ``bench`` command (Typer options)
model.py       the random-weight model of a preset's shapes and its rank-cycling PEFT adapters
workload.py    the requests (standard, scoring, shared-prefix), their adapters and order
engine_run.py  one timed engine run: slora, base, slora-dora, the ablations from engine parts
warmup.py      the untimed warm-up groups before an engine run's clock starts
timed_run.py   the clock: requests fed until the time limit, the engine's counters over it
row_fields.py  a run's results row: outcome, step counters, rates and roofline fraction, builds
peft_run.py    transformers + PEFT in padded static batches
score_run.py   the scoring workload through the engine (``score``)
peft_score_run.py  the scoring workload through transformers + PEFT (``peft-score``)
prefix_run.py  the prefix cache's workloads through the engine (``prefix``, ``samples``, ...)
job_run.py     the real ``slora-batch run`` path on the bench's requests (``job``)
report.py      results.parquet, results.md, summary.json
acceptance.py  the checks against the bench's targets that end results.md
plot.py        throughput.png
run_meta.py    the results header: date, card, commit, versions, measured rates, settings
formatting.py  how a figure is written in results.md (blank or n/a where missing)
roofline.py    the card's measured rates and each run's floor
"""
