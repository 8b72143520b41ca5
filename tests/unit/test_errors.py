"""The one exception tree: what :mod:`llmgw.errors` draws is what exists, and it lives there."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import llmgw
from llmgw import errors
from llmgw.errors import HttpError, JsonBodyError, LlmgwError

SRC = Path(llmgw.__file__).parent


def drawn() -> dict[str, tuple[str, int]]:
    """Each class in the docstring's tree: its parent (by indentation) and its exit code."""
    doc = errors.__doc__ or ""
    out: dict[str, tuple[str, int]] = {}
    stack: list[tuple[int, str]] = []
    for line in doc.splitlines():
        m = re.match(r"^    ([│├└─ ]*)(\w+)\s+exit (\d)", line)
        if not m:
            continue
        depth, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        out[name] = (stack[-1][1] if stack else "", int(m.group(3)))
        stack.append((depth, name))
    return out


def all_llmgw_errors() -> set[type[LlmgwError]]:
    """Every LlmgwError subclass defined anywhere in the package (every module imported but
    ``__main__``, which runs the CLI)."""
    for info in pkgutil.walk_packages(llmgw.__path__, "llmgw."):
        if not info.name.endswith(".__main__"):
            importlib.import_module(info.name)
    seen: set[type[LlmgwError]] = set()
    todo: list[type[LlmgwError]] = [LlmgwError]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("llmgw.") and cls not in seen:
            seen.add(cls)
            todo.extend(cls.__subclasses__())
    return seen


def test_the_tree_draws_each_class_of_errors_py_with_its_parent_and_exit_code() -> None:
    tree = drawn()
    classes = {n: c for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, LlmgwError)}
    assert set(tree) == set(classes)
    for name, (parent, code) in tree.items():
        cls = classes[name]
        assert cls.exit_code == code, name
        if parent:
            assert cls.__bases__[0] is classes[parent], name


def test_every_llmgw_error_lives_in_errors_py() -> None:
    found = all_llmgw_errors()
    assert len(found) >= len(drawn())
    assert {c.__name__ for c in found if c.__module__ != "llmgw.errors"} == set()


def test_no_bare_llmgw_error_is_raised() -> None:
    bare = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                if isinstance(func, ast.Name) and func.id == "LlmgwError":
                    bare.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert bare == []


def test_a_json_body_error_is_an_http_error_and_a_value_error() -> None:
    e = JsonBodyError(413, "body_too_large", "too big")
    assert isinstance(e, HttpError)
    assert isinstance(e, ValueError)
    assert (e.status, e.code, e.message, str(e), e.headers) == (413, "body_too_large", "too big", "too big", None)
