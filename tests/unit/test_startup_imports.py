"""What a control plane and an agent import when they start: not numpy. The ``gguf`` package pulls it
(0.25-0.3 s of CPU in every start, measured on 2 cores); :mod:`llmgw.ggufheader` imports it at the
first header read instead. The header is still read with it: tests/unit/test_estimate.py.

Nor psycopg: only the PostgreSQL election uses it directly (SQLAlchemy loads it for a
``postgresql+psycopg`` store by itself), and its import was ~80 ms of every start, SQLite ones too
(importing the control plane and the mirror: 0.82 s of CPU before, 0.74-0.77 s after, 2026-12-05)."""

from __future__ import annotations

import subprocess
import sys


def test_a_control_plane_and_an_agent_start_without_numpy() -> None:
    code = ("import sys, llmgw.control.server, llmgw.agent.loop.loop; "
            "print(sorted(m for m in ('numpy', 'gguf', 'psycopg') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr
