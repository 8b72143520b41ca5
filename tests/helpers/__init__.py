"""Helpers shared by test modules (and benchmarks): fakes, real processes and their set-up.

Test modules import from here, never from each other. ``control`` (a control plane install on
loopback, served in-process), ``net`` (free ports), ``processes`` (``llmgw`` as a child process),
``mirrors``, ``judges``, ``placement``, ``discovery``, ``clocks``.
"""
