"""The offline job tool: a job file's rows through one engine into a resumable output directory.

config.py    JobConfig and the YAML loader (unknown keys named, paths resolved)
io.py        streaming readers (JSONL, Parquet), row checks, the input scan
ordering.py  bounded windows sorted by adapter and prompt length, fan-out
writer.py    the output directory: parts, commit protocol, resume keys, stats, markers, lock
run.py       running a job: check, resume, feed the engine, write, summarize
validate.py  every check a run makes, and a sample of rows, without running
"""
