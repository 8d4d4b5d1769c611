"""The offline job tool: a job file's rows through one engine into a resumable output directory.

config.py    JobConfig and the YAML loader (unknown keys named, paths resolved)
check.py     check_job -> JobPlan: everything that can fail a job, before any work; JobError
reader.py    input files (JSONL, Parquet) and their rows, streamed
rows.py      a row into a Request or an error Result; its identity (RowSource, row_key)
scoring.py   a row's scoring columns (continuation, choices, answer) and logprobs, checked
scan.py      the input scan: id type, kept columns' types, duplicates, unused columns
text.py      UTF-8 checks, short descriptions of values for messages
ordering.py  bounded windows sorted by adapter and prompt, fan-out
schema.py    the output parts' schema: id type, core and scoring columns, kept columns
outdir.py    the output directory's files: atomic commit, parts, _SUCCESS, clearing
fsio.py      input files and output directories on other pyarrow.fs filesystems (Ray runner)
lock.py      OutputLock: one run per output directory
writer.py    OutputWriter: buffered rows committed as parts by rows and by time; text repair
manifest.py  _job.json: the fingerprint of what decides the rows, the columns read, the resume check
resume.py    keys of the rows already committed, and the input rows not yet among them
samples.py   n samples per row: which of a row's samples are committed, which it still owes
progress.py  JobProgress: what a progress display is told
feed.py      RunRecord: requests into the engine, results to the writer, this run's account
stats.py     _stats.parquet: its schema, the job and adapter rows, output counts, accuracy
preference.py  which choice each adapter prefers, from the parts (for the run summary)
lifecycle.py one job's run over its output (lock, manifest, resume, scan, stats, marker), its rows
             run by an executor: run.EngineRows here, ray.job.RayRows on Ray
run.py       running a job in this process: the engine (or data-parallel engines) as the executor
eval_keys.py the job file's eval: keys (EvalConfig); slora_batch.eval runs them
summary.py   JobSummary and JobFailure: what a run returns (the eval sweep names them too)
preview.py   a few finished outputs next to their prompts
validate.py  every check a run makes, and a sample of rows, without running
reference.py the job-key reference (docs/job-keys.md) from the settings' field comments
"""
