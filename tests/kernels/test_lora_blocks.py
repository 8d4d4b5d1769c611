"""``SLORA_LORA_BLOCKS``: a process's LoRA kernel knobs from the environment, so engine runs
side by side can each take a variant (``slora_kernels.lora_blocks.overrides``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from slora_kernels.lora_blocks import BLOCKS, overrides


def test_overrides_take_known_knobs():
    assert overrides('{"valign": 1, "at": 32}') == {"valign": 1, "at": 32}
    assert overrides("{}") == {}


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('{"vlaign": 1}', "unknown knob 'vlaign'"),
        ('{"valign": "1"}', "knob 'valign' takes an int"),
        ('{"valign": true}', "knob 'valign' takes an int"),
        ("[1]", "must be a JSON object"),
        ("valign=1", "is not JSON"),
    ],
)
def test_overrides_refuse_what_is_not_a_knob(text, said):
    with pytest.raises(ValueError, match="SLORA_LORA_BLOCKS") as info:
        overrides(text)
    assert said in str(info.value)


def test_a_process_started_with_the_variable_runs_its_knobs():
    """The variable reaches the launchers: a graph decode step's meta is an aligned step there,
    and BLOCKS here (no variable) is left as it was."""
    code = (
        "from slora_kernels.lora_blocks import BLOCKS\n"
        "from slora_kernels.lora_paths import aligned_step\n"
        "from types import SimpleNamespace\n"
        "from slora_kernels.meta import VECTOR_ALL\n"
        "print(BLOCKS['valign'], BLOCKS['vsorted'],"
        " aligned_step(SimpleNamespace(vector_max=VECTOR_ALL)))\n"
    )
    env = {**os.environ, "SLORA_LORA_BLOCKS": '{"valign": 1, "vsorted": 0}'}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["1", "0", "True"]
    assert BLOCKS["valign"] == 0 and BLOCKS["vsorted"] == 1
