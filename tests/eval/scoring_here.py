"""Eval jobs of a test scored in the job's process alone."""

from __future__ import annotations


def without_scoring_process(monkeypatch) -> None:
    """The eval jobs run next start no scoring process (``eval/worker.py``): each adapter is
    scored in the job's process, as where no second interpreter starts (``sweep.run_eval``).
    The process is a fresh interpreter that imports torch, transformers and lm-eval, several
    CPU seconds, and whether it answers before the job ends depends on the machine's load; its
    answers equal scoring here (test_eval_scoring.py), and a killed job leaves none behind
    (test_sweep.py's first run)."""
    import slora_batch.eval.sweep as sweep

    def refuse(*args, **kwargs):
        raise OSError("no scoring process in this test: every adapter is scored in the job's")

    monkeypatch.setattr(sweep, "ScoringProcess", refuse)
