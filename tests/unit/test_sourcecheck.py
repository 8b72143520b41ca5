"""sourcecheck: every accepted form, and the reasons for the rejected ones (one table each)."""

from __future__ import annotations

import pathlib

import pytest

from llmgw.errors import SourceError
from llmgw.sourcecheck import Download, is_download, to_download

NOHOME = pathlib.Path("/nonexistent-home")


@pytest.mark.parametrize(
    ("source", "env", "want"),
    [
        (
            "hf:unsloth/gemma-3-270m-it-GGUF/gemma-3-270m-it-Q4_K_M.gguf",
            {},
            Download(
                "hf",
                "https://huggingface.co/unsloth/gemma-3-270m-it-GGUF/resolve/main/gemma-3-270m-it-Q4_K_M.gguf",
            ),
        ),
        (
            "hf:org/repo/sub/dir/model file.gguf",
            {"HF_ENDPOINT": "http://hf-proxy.local:8000/"},
            Download("hf", "http://hf-proxy.local:8000/org/repo/resolve/main/sub/dir/model%20file.gguf"),
        ),
        ("https://example.com/m.gguf", {}, Download("http", "https://example.com/m.gguf")),
        ("http://10.0.0.5:8081/gemma/1/m.gguf", {}, Download("http", "http://10.0.0.5:8081/gemma/1/m.gguf")),
        (
            "file:/srv/in/m.gguf",
            {},
            Download("file", "file:///srv/in/m.gguf", pathlib.Path("/srv/in/m.gguf")),
        ),
        (
            "file:///srv/in/m.gguf",
            {},
            Download("file", "file:///srv/in/m.gguf", pathlib.Path("/srv/in/m.gguf")),
        ),
        (
            "file://localhost/srv/a%20b.gguf",
            {},
            Download("file", "file:///srv/a%20b.gguf", pathlib.Path("/srv/a b.gguf")),
        ),
    ],
)
def test_accepted(source: str, env: dict[str, str], want: Download) -> None:
    got = to_download(source, env=env, home=NOHOME)
    assert got == want
    assert got.headers == {}
    assert is_download(source)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("", "it is empty"),
        ("gemma.gguf", "it has no scheme"),
        ("s3://bucket/m.gguf", "'s3:' is not a source scheme"),
        ("ftp://host/m.gguf", "'ftp:' is not a source scheme"),
        ("hf:org/repo", "three parts at least"),
        ("hf:org//m.gguf", "empty part"),
        ("hf:org/repo/../x.gguf", "'..' are not allowed"),
        ("https:///m.gguf", "no host"),
        ("https://example.com/", "names no file"),
        ("file:relative/m.gguf", "must be absolute"),
        ("file:/srv/../etc/passwd", "'..' is not allowed"),
        ("file://otherhost/srv/m.gguf", "this machine only"),
        ("file:/srv/models/", "names a directory"),
    ],
)
def test_rejected(source: str, reason: str) -> None:
    with pytest.raises(SourceError) as ei:
        to_download(source, env={}, home=NOHOME)
    msg = str(ei.value)
    assert msg.startswith(f"cannot turn '{source}' into a download: ")
    assert reason in msg
    assert "hf:ORG/REPO/FILE" in msg  # names the accepted forms
    assert not is_download(source)


def test_hf_token_from_env_wins_over_file(tmp_path: pathlib.Path) -> None:
    (tmp_path / ".cache" / "huggingface").mkdir(parents=True)
    (tmp_path / ".cache" / "huggingface" / "token").write_text("hf_file\n")
    d = to_download("hf:o/r/f.gguf", env={"HF_TOKEN": "hf_env"}, home=tmp_path)
    assert d.headers == {"Authorization": "Bearer hf_env"}
    d = to_download("hf:o/r/f.gguf", env={}, home=tmp_path)
    assert d.headers == {"Authorization": "Bearer hf_file"}
    assert "hf_file" not in repr(d)


def test_hf_token_from_hf_home(tmp_path: pathlib.Path) -> None:
    (tmp_path / "token").write_text("hf_home_tok")
    d = to_download("hf:o/r/f.gguf", env={"HF_HOME": str(tmp_path)}, home=NOHOME)
    assert d.headers == {"Authorization": "Bearer hf_home_tok"}
