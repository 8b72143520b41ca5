"""The docs hold: the YAML examples in docs/operating.md are valid (a reader who copies them gets no
error), and every module and function docs/architecture.md names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

from llmgw.catalog import Model, Profile
from llmgw.config import UiConfig
from llmgw.guard.config import GuardConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "operating.md"


def _examples() -> dict[str, dict]:
    """docs/operating.md's YAML examples by their top-level keys joined with "," (``"routing,queue"``)."""
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)]
    return {",".join(b): b for b in blocks if isinstance(b, dict)}


def test_the_model_and_guard_examples_validate() -> None:
    ex = _examples()
    model_yaml = next(b for k, b in ex.items() if k.startswith("name,"))
    groups = [Profile.model_validate(p) for p in ex["profiles"]["profiles"]]
    assert [(p.nodes, p.engine.value) for p in groups] == [(3, "llamacpp"), (2, "vllm")]
    model = Model.model_validate(model_yaml)
    assert [p.name for p in model.profiles_by_priority()] == ["gpu-l4", "cpu"]
    # "Routing" and "Autoscaling": their fields on that model validate too.
    routed = Model.model_validate({**model_yaml, **ex["routing,queue"]})
    assert (routed.routing, routed.queue.size) == (ex["routing,queue"]["routing"], ex["routing,queue"]["queue"]["size"])
    scaled = Model.model_validate({**model_yaml, **ex["scaling"]})
    assert scaled.scaling.max > scaled.scaling.min
    guard = GuardConfig.model_validate(ex["guard"]["guard"])
    assert guard.on()
    scrape = ex["scrape_configs"]  # the Prometheus scrape config in "Metrics"
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"][0].endswith(":9090")
    ui = UiConfig.model_validate(ex["ui"]["ui"])  # "The dashboard"
    assert (ui.listen, ui.session_ttl_s) == (":9443", 8 * 3600)


ARCH = DOC.parent / "architecture.md"
SRC = DOC.parents[1] / "src" / "llmgw"


def _defined(path: Path) -> set[str]:
    """Every function and class in ``path`` (handlers nested in an app builder included), every
    ``Class.method``, and every module-level assignment."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        if isinstance(node, ast.ClassDef):
            methods = [sub for sub in node.body if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef))]
            out.update(f"{node.name}.{m.name}" for m in methods)
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def test_architecture_names_modules_and_functions_that_exist() -> None:
    """Each ``pkg/module.py: Name`` in docs/architecture.md names a module and a definition in it."""
    text = ARCH.read_text()
    refs = re.findall(r"`([a-z_/]+\.py):\s+([A-Za-z_][\w.]*)`", text)
    assert len(refs) >= 20
    missing = [f"{m}: {n}" for m, n in refs if not (SRC / m).is_file() or n not in _defined(SRC / m)]
    assert missing == []
    modules = set(re.findall(r"`([a-z_]+/[a-z_/]+\.py)", text))
    assert [m for m in sorted(modules) if not (SRC / m).is_file()] == []


def test_every_ha_citation_names_a_section_of_docs_ha_md() -> None:
    """The code cites the HA reasoning it relies on as ``docs/ha.md §N``: each such section is in
    the repo (it was a file beside the checkout, which a clone never has)."""
    root = DOC.parents[1]
    sections = set(re.findall(r"^#+ (\d+(?:\.\d+)?)\.? ", (DOC.parent / "ha.md").read_text(), re.M))
    cited: dict[str, str] = {}
    for path in [*root.glob("src/**/*.py"), *root.glob("tests/**/*.py"), *root.glob("bench/*.py"),
                 root / "scripts" / "assets"]:
        text = path.read_text()
        assert "../" + "shared/" not in text, f"{path} cites a file outside the repo"
        for n in re.findall(r"docs/ha\.md`*\s*§(\d+(?:\.\d+)?)", text):
            cited.setdefault(n, str(path))
    assert len(cited) >= 5
    assert {n: p for n, p in cited.items() if n not in sections} == {}
