"""sourcecheck: every accepted form, and the reasons for the rejected ones (one table each)."""

from __future__ import annotations

import ipaddress
import pathlib

import pytest

from llmgw.errors import SourceError
from llmgw.sourcecheck import Download, carried_ipv4, host_address, is_download, link_local, to_download

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


@pytest.mark.parametrize(
    ("host", "address"),
    [
        ("169.254.169.254", "169.254.169.254"),
        ("0xa9fea9fe", "169.254.169.254"),  # passed the admin API's check (a security tester's finding)
        ("2852039166", "169.254.169.254"),
        ("169.254.43518", "169.254.169.254"),
        ("[::ffff:169.254.169.254]", "169.254.169.254"),
        ("[::a9fe:a9fe]", "169.254.169.254"),  # IPv4-compatible
        ("[64:ff9b::a9fe:a9fe]", "169.254.169.254"),  # NAT64
        ("[2002:a9fe:a9fe::1]", "169.254.169.254"),  # 6to4
        ("[fe80::1%25eth0]", "fe80::1"),
    ],
)
def test_link_local_in_every_form_a_resolver_reads(host: str, address: str) -> None:
    assert str(link_local(host)) == address


@pytest.mark.parametrize("host", ["mirror.example", "10.0.0.1", "[::1]", "[::]", "[2001:db8::1]", "0xzz", "1.2.3.4.5"])
def test_not_link_local(host: str) -> None:
    assert link_local(host) is None


def test_what_an_address_carries() -> None:
    assert carried_ipv4(ipaddress.ip_address("::7f00:1")) == ipaddress.ip_address("127.0.0.1")
    assert carried_ipv4(ipaddress.ip_address("::1")) == ipaddress.ip_address("::1")  # IPv6's own loopback
    assert carried_ipv4(ipaddress.ip_address("2001:db8::1")) == ipaddress.ip_address("2001:db8::1")
    assert host_address("example.org") is None

