"""``llmgw ctl model add -f FILE`` and ``set-profiles -f FILE`` read the file before anything goes to the
control plane: a file that is not a model.yaml is said to be one, exit 2 (a new user's findings: a .gguf
given as model.yaml printed a traceback; an empty file or a list got the API's "the body is not valid
JSON" or "(body): Input should be a valid dictionary", exit 1, about a body they never wrote)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app

#: Nothing listens here: the file is refused before any request.
SERVER = ["--server", "http://127.0.0.1:9", "--token", "t" * 32]


@pytest.mark.parametrize(("content", "words"), [
    (b"GGUF\x03\x00\x00\x00\xec\xff", "is not UTF-8 text (byte 8 is not): give a YAML file of a model"),
    (b"", "holds nothing; give a YAML file of a model: a mapping of its fields"),
    (b"- name: m\n", "holds a YAML list; give a YAML file of a model"),
    (b"gemma\n", "holds a YAML string; give a YAML file of a model"),
])
def test_model_add_says_the_file_is_not_a_model(tmp_path: Path, content: bytes, words: str) -> None:
    f = tmp_path / "model.yaml"
    f.write_bytes(content)
    r = CliRunner().invoke(app, ["ctl", "model", "add", "-f", str(f), *SERVER])
    assert r.exit_code == 2, r.output
    assert f"Error: {f} {words}" in r.output
    assert "Traceback" not in r.output


def test_set_profiles_takes_a_list_or_a_mapping_and_says_so(tmp_path: Path) -> None:
    f = tmp_path / "profiles.yaml"
    f.write_text("cpu\n")
    r = CliRunner().invoke(app, ["ctl", "model", "set-profiles", "m", "-f", str(f), *SERVER])
    assert r.exit_code == 2, r.output
    assert f"Error: {f} holds a YAML string; give a YAML file of profiles: a list of them, or {{profiles: [...]}}" \
        in r.output
