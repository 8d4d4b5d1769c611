"""How a job builds a row's prompt: ``prompt_template`` (the prompt made from the row's columns,
Python ``str.format`` syntax), ``apply_chat_template`` (a text prompt sent as a user turn, so the
model's chat template is applied) and ``system_prompt`` (a system turn before it).

A template names input columns in braces, ``"{instruction}\\n\\n{input}"``; ``{{`` and ``}}`` are
literal braces. A list of templates is tried in order: a row takes the first whose every column
is present and non-empty. Running example, Alpaca's two templates
``["{instruction}\\n\\n{input}", "{instruction}"]``: the row ``{"instruction": "Add 2 and 3",
"input": ""}`` takes the second, "Add 2 and 3"; a row without an instruction fits neither and is
an error row naming the template and the column."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from string import Formatter
from typing import Any

from slora_batch.engine.config import ConfigError, check


@dataclass(frozen=True)
class PromptTemplate:
    """One template: its text and the input columns it names, in order of first use."""

    text: str
    fields: tuple[str, ...]

    @classmethod
    def parse(cls, text: Any, where: str = "prompt_template") -> PromptTemplate:
        """Check ``text`` as ``str.format`` does, and allow only plain column names:
        ``{column}``. Raises ``ConfigError`` naming what is not supported."""
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where} must be a non-empty string, got {text!r}")
        fields: list[str] = []
        try:
            parsed = list(Formatter().parse(text))
        except ValueError as exc:  # "Single '}' encountered in format string"
            raise ConfigError(
                f"{where} {text!r}: {exc} (write a literal brace as {{{{ or }}}})"
            ) from exc
        for _, name, spec, conversion in parsed:
            if name is None:
                continue
            shown = (
                "{"
                + name
                + (f"!{conversion}" if conversion else "")
                + (f":{spec}" if spec else "")
                + "}"
            )
            if name == "" or name.isdigit():
                raise ConfigError(
                    f"{where} {text!r}: {shown} is positional; name an input column, "
                    "as in {question} (a literal brace is {{ or }})"
                )
            if "." in name or "[" in name:
                raise ConfigError(
                    f"{where} {text!r}: {shown} reads an attribute or an item, which is not "
                    "supported: name an input column, as in {question}"
                )
            if conversion or spec:
                raise ConfigError(
                    f"{where} {text!r}: {shown} has a conversion or format spec, which is not "
                    f"supported: write {{{name}}} (values are inserted as text)"
                )
            if name not in fields:
                fields.append(name)
        if not fields:
            raise ConfigError(
                f"{where} {text!r} names no input column: every row would get the same prompt "
                "(name columns in braces, as in {question})"
            )
        return cls(text, tuple(fields))

    def missing(self, values: Mapping[str, Any]) -> tuple[str, str] | None:
        """(column, "missing" or "empty") of the first column the row cannot fill, or None."""
        for name in self.fields:
            value = values.get(name)
            if value is None:
                return name, "missing"
            if _text(value).strip() == "":
                return name, "empty"
        return None

    def render(self, values: Mapping[str, Any]) -> str:
        """The prompt: each column's value as text (lists and objects as JSON)."""
        return self.text.format_map({name: _text(values[name]) for name in self.fields})


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list | dict):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def parse_templates(value: Any) -> list[PromptTemplate]:
    """``prompt_template``: one template or a non-empty list of them, each checked."""
    if isinstance(value, list):
        if not value:
            raise ConfigError("prompt_template must be a template or a non-empty list of them")
        templates = [
            PromptTemplate.parse(text, f"prompt_template[{i}]") for i, text in enumerate(value)
        ]
        texts = [t.text for t in templates]
        if len(set(texts)) != len(texts):
            raise ConfigError(f"prompt_template lists a template twice: {value!r}")
        return templates
    return [PromptTemplate.parse(value)]


@dataclass(frozen=True)
class Prompts:
    """A job's prompt settings, as ``rows.to_request`` applies them to each row."""

    templates: tuple[PromptTemplate, ...] = ()  # prompt_template, parsed
    chat: bool = False  # apply_chat_template: a text prompt becomes a user turn
    system: str | None = None  # system_prompt

    @classmethod
    def of(cls, job) -> Prompts:
        """The prompt settings of a ``JobConfig``."""
        templates = () if job.prompt_template is None else parse_templates(job.prompt_template)
        return cls(tuple(templates), job.apply_chat_template, job.system_prompt)

    @property
    def fields(self) -> list[str]:
        """The input columns the templates read, in order of first use."""
        return list(dict.fromkeys(name for t in self.templates for name in t.fields))

    def render(self, values: Mapping[str, Any]) -> tuple[str | None, str | None]:
        """(prompt, None) from the first template the row fills, or (None, why none does)."""
        reasons = []
        for template in self.templates:
            gap = template.missing(values)
            if gap is None:
                return template.render(values), None
            reasons.append(f"{template.text!r} needs column {gap[0]!r}, which is {gap[1]}")
        if len(reasons) == 1:
            return None, f"prompt_template {reasons[0]}"
        listed = "; ".join(f"template {i}: {r}" for i, r in enumerate(reasons))
        return None, f"no prompt_template fits the row ({listed})"

    def sent(
        self, prompt: str | None, messages: list[dict[str, str]] | None
    ) -> tuple[str | None, list[dict[str, str]] | None]:
        """A row's checked prompt as the engine gets it: a messages row's messages with the
        system prompt first (``with_system``), and with apply_chat_template a text prompt as
        chat turns (``turns``), a messages row from here on."""
        if messages is not None:
            return prompt, self.with_system(messages)
        if prompt is not None and self.chat:
            return None, self.turns(prompt)
        return prompt, messages

    def turns(self, prompt: str) -> list[dict[str, str]]:
        """A text prompt as chat turns: the system prompt (when set), then the user's."""
        return self.with_system([{"role": "user", "content": prompt}])

    def with_system(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """``messages`` with the system prompt first when set and they have no system turn."""
        if self.system is None or any(m["role"] == "system" for m in messages):
            return messages
        return [{"role": "system", "content": self.system}, *messages]


def check_prompt_keys(job) -> None:
    """A ``JobConfig``'s prompt keys: prompt_template parsed, the chat keys' types; none of them
    with eval (lm-eval builds its prompts), no template with OpenAI Batch lines (they give
    theirs). Raises ``ConfigError``."""
    if job.prompt_template is not None:
        parse_templates(job.prompt_template)
        if isinstance(job.prompt_template, list):
            job.prompt_template = list(job.prompt_template)
    check(
        isinstance(job.apply_chat_template, bool),
        f"apply_chat_template must be true or false, got {job.apply_chat_template!r}",
    )
    system = job.system_prompt
    check(
        system is None or (isinstance(system, str) and system.strip() != ""),
        f"system_prompt must be a non-empty string or null, got {system!r}",
    )
    given = [key for key in ("prompt_template", "system_prompt") if getattr(job, key)]
    given += ["apply_chat_template"] if job.apply_chat_template else []
    for key in given:
        check(job.eval is None, f"{key} is for input rows: lm-eval builds an eval job's prompts")
    check(
        job.prompt_template is None or job.input_format != "openai",
        "prompt_template builds prompts from input columns: OpenAI Batch lines give their own "
        "(input_format openai)",
    )
