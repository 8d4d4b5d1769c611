"""A million input rows stream through reader, requests and window sort in bounded memory.

The streaming runs in a subprocess so that its peak resident memory (``ru_maxrss``) is its own:
holding every row would take about 1 GB here, the bound is 300 MB of growth.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROWS = 1_000_000
MAX_GROWTH_MB = 300

STREAM = """
import json, resource, sys
from slora_batch.config import SamplingConfig
from slora_batch.io import iter_input_files, read_rows, to_request
from slora_batch.ordering import sorted_windows
from slora_batch.request import Request

columns = {"id": "id", "adapter": "adapter", "prompt": "prompt", "messages": "messages"}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rows = (to_request(row, SamplingConfig()) for row in read_rows(iter_input_files(sys.argv[1]), columns))
count = errors = 0
for item in sorted_windows(rows, window=8192):
    count += 1
    errors += not isinstance(item, Request)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"count": count, "errors": errors, "growth_kb": after - before}))
"""


@pytest.mark.slow
def test_million_rows_stream_in_bounded_memory(tmp_path):
    path = tmp_path / "rows.jsonl"
    adapters = ['"shout"', '"calm"', "null", '"adapter-0042"']
    with open(path, "w", buffering=1 << 20) as handle:
        for i in range(ROWS):
            prompt = "lorem ipsum " * (1 + i % 7)
            handle.write(
                f'{{"id": "row-{i}", "adapter": {adapters[i % 4]}, "prompt": "{prompt}", '
                f'"max_new_tokens": {1 + i % 64}}}\n'
            )
        handle.write("{broken\n")  # one bad row on the way: it must not stop the stream
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", STREAM, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["count"] == ROWS + 1
    assert report["errors"] == 1
    assert report["growth_kb"] < MAX_GROWTH_MB * 1024, report
