"""``slora-batch bench``: the workload of benchmarks/README.md through every system, in one process.

bench.py       settings, the plan of runs, orchestration
cli.py         the ``bench`` command (Typer options)
workload.py    the model (random weights), adapters and requests
engine_run.py  one timed engine run; the ablations composed from engine parts
peft_run.py    transformers + PEFT in padded static batches
score_run.py   the scoring workload through the engine (``score``)
peft_score_run.py  the scoring workload through transformers + PEFT (``peft-score``)
prefix_run.py  the prefix cache's workloads through the engine (``prefix``, ``samples``, ...)
report.py      results.parquet, results.md, summary.json, the plot
roofline.py    the card's measured rates and each run's floor
"""
