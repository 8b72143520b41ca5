"""The mirror's serving speed, side by side with nginx, and a node fetching the gemma file.

1. A 1 GiB file is put into a temp mirror store (``llmgw mirror add``'s direct path: copied and
   hashed), then served over loopback by ``llmgw mirror serve`` (a real process) and by nginx
   (Debian's ``nginx-light``, ``sendfile on``, one worker, a temp config on a free port) from the
   same file. ``curl -o /dev/null`` fetches it ``RUNS`` times from each, alternating; the best run
   of each counts (the page cache is warm for both; the first run warms it). Target: the mirror
   at least 70% of nginx.
2. The gemma-3-270m GGUF (253 MB, ``scripts/assets``) is added to the mirror, and a node cache
   (:class:`~llmgw.agent.node.cache.NodeCache`, the agent's own) fetches it from the mirror on loopback:
   download, sha256 verification against the mirror's digest, fsync, rename. Target: <= 2 s.

Prints its figures last, one ``name: value unit`` per line. Needs ``nginx`` on PATH (or
/usr/sbin/nginx) and ``curl``; without nginx it says so and prints the mirror's figures only.

    python bench/mirror.py
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

from llmgw.agent.node.cache import NodeCache
from llmgw.mirror.fetch import Fetcher
from llmgw.mirror.models import FetchRequest, FetchStatus
from llmgw.mirror.policy import SourcePolicy
from llmgw.mirror.store import Store
from llmgw.protocol import ReplicaSpec

RUNS = 4
SIZE = 1 << 30
GEMMA = Path(os.environ.get("MODEL") or Path.home() / ".cache/llmgw/models/gemma-3-270m-q4_k_m.gguf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, limit_s: float = 20) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
        except httpx.TransportError:
            time.sleep(0.1)
        else:
            return
    raise SystemExit(f"nothing answered at {url}")


def make_file(path: Path) -> None:
    block = os.urandom(16 << 20)
    with path.open("wb") as f:
        for _ in range(SIZE // len(block)):
            f.write(block)


async def add(store: Path, src: Path, model: str) -> FetchStatus:
    fetcher = Fetcher(Store(store), base="", policy=SourcePolicy.build(import_dirs=[src.parent]))
    await fetcher.start(resume=False)
    try:
        await fetcher.fetch(FetchRequest(source=f"file:{src}", model=model, version="1"))
        st = await fetcher.wait(model, "1")
    finally:
        await fetcher.close()
    assert st is not None
    assert st.state == "present", st.err
    return st


def curl_bps(url: str) -> float:
    out = subprocess.run(
        ["curl", "-s", "-o", "/dev/null", "-w", "%{speed_download} %{size_download}", url],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    if int(float(out[1])) != SIZE:
        raise SystemExit(f"{url}: got {out[1]} bytes, expected {SIZE}")
    return float(out[0])


def start_nginx(tmp: Path, root: Path, port: int) -> subprocess.Popen[bytes] | None:
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if binary is None:
        print("nginx not found (apt-get install -y nginx-light); comparing nothing", flush=True)
        return None
    conf = tmp / "nginx.conf"
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf.write_text(
        f"{user}worker_processes 1;\ndaemon off;\npid {tmp}/nginx.pid;\nerror_log {tmp}/nginx-error.log;\n"
        "events { worker_connections 64; }\n"
        "http {\n  access_log off;\n  sendfile on;\n  tcp_nopush on;\n"
        f"  client_body_temp_path {tmp}/nb;\n  proxy_temp_path {tmp}/np;\n  fastcgi_temp_path {tmp}/nf;\n"
        f"  uwsgi_temp_path {tmp}/nu;\n  scgi_temp_path {tmp}/ns;\n"
        f"  server {{\n    listen 127.0.0.1:{port};\n    root {root};\n  }}\n}}\n"
    )
    return subprocess.Popen([binary, "-c", str(conf), "-p", str(tmp)], stderr=subprocess.DEVNULL)


async def node_fetch(url: str, sha: str, cache_dir: Path) -> float:
    spec = ReplicaSpec.model_validate({
        "id": "r", "model": "gemma", "version": "1", "profile": "cpu", "engine": "llamacpp",
        "source_url": url, "sha256": sha, "file_name": GEMMA.name, "key": "k",
    })  # fmt: skip
    cache = NodeCache(cache_dir)
    async with aiohttp.ClientSession() as session:
        t0 = time.perf_counter()
        await cache.ensure(session, spec)
        return time.perf_counter() - t0


def main() -> None:
    figures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-mirror-") as t:
        tmp = Path(t)
        store = tmp / "store"
        big = tmp / "big.bin"
        print(f"writing a {SIZE >> 20} MiB file ...", flush=True)
        make_file(big)
        t0 = time.perf_counter()
        st = asyncio.run(add(store, big, "big"))
        add_s = time.perf_counter() - t0
        big.unlink()
        print(f"added to the store (copy + sha256) in {add_s:.1f} s", flush=True)
        gemma = None
        if GEMMA.exists():
            gemma = asyncio.run(add(store, GEMMA, "gemma"))
        else:
            print(f"{GEMMA} missing (scripts/assets); skipping the node fetch", flush=True)

        bytes_port, api_port, nginx_port = free_port(), free_port(), free_port()
        mirror = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "mirror", "serve", "--dir", str(store),
             "--listen", f"127.0.0.1:{bytes_port}", "--api-listen", f"127.0.0.1:{api_port}",
             "--base", f"http://127.0.0.1:{bytes_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        nginx = start_nginx(tmp, store, nginx_port)
        try:
            wait_http(f"http://127.0.0.1:{api_port}/api/v1/health")
            mirror_url = f"http://127.0.0.1:{bytes_port}/big/1/{st.file}"
            nginx_url = f"http://127.0.0.1:{nginx_port}/big/1/{st.file}"
            if nginx is not None:
                wait_http(f"http://127.0.0.1:{nginx_port}/")
            best = {"mirror": 0.0, "nginx": 0.0}
            for i in range(RUNS):
                for name, url in (("mirror", mirror_url), ("nginx", nginx_url)):
                    if name == "nginx" and nginx is None:
                        continue
                    bps = curl_bps(url)
                    best[name] = max(best[name], bps)
                    print(f"run {i + 1} {name}: {bps / 1e6:.0f} MB/s", flush=True)
            node_s = None
            if gemma is not None:
                url = f"http://127.0.0.1:{bytes_port}/gemma/1/{gemma.file}"
                times = [asyncio.run(node_fetch(url, gemma.sha256, tmp / f"node{i}")) for i in range(3)]
                for i, s in enumerate(times):
                    print(f"node fetch {i + 1}: {s:.2f} s", flush=True)
                node_s = min(times)
        finally:
            mirror.terminate()
            mirror.wait(10)
            if nginx is not None:
                nginx.terminate()
                nginx.wait(10)
    figures.append(f"mirror_add_1gib: {add_s:.2f} s")
    figures.append(f"mirror_serve_1gib: {best['mirror'] / 1e6:.0f} MB/s")
    if nginx is not None:
        figures.append(f"nginx_serve_1gib: {best['nginx'] / 1e6:.0f} MB/s")
        figures.append(f"mirror_vs_nginx: {100 * best['mirror'] / best['nginx']:.0f} %")
    if node_s is not None:
        figures.append(f"node_fetch_gemma_253mb: {node_s:.2f} s")
    print()
    print("\n".join(figures))


if __name__ == "__main__":
    main()
