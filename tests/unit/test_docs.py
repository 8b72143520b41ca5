"""The YAML examples in docs/operating.md are valid: a reader who copies them gets no error."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from llmgw.catalog import Model
from llmgw.guard.config import GuardConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "operating.md"


def test_the_model_and_guard_examples_validate() -> None:
    model_yaml, guard_yaml = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    model = Model.model_validate(yaml.safe_load(model_yaml))
    assert [p.name for p in model.profiles_by_priority()] == ["gpu-l4", "cpu"]
    guard = GuardConfig.model_validate(yaml.safe_load(guard_yaml)["guard"])
    assert guard.on()
