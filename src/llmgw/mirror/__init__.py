"""The model mirror: downloads weights once and serves the bytes to every node.

Modules, in the order a fetch passes through them:

- :mod:`llmgw.sourcecheck` (outside this package) turns ``hf:``/``https://``/``file:`` into a Download.
- :mod:`.policy` — SourcePolicy: ``file:`` only from ``--import-dir``, ``http(s):`` only to public addresses.
- :mod:`.models` — FetchRequest, FetchStatus (the API's shapes) and Manifest (the on-disk row).
- :mod:`.download` — resumable, sha256-verified HTTP download (also used by the node agent's cache).
- :mod:`.fetch` — Fetcher: one fetch per ``model/version``, copy or download, state in manifests.
- :mod:`.store` — the ``<dir>/<model>/<version>/<file>`` layout and which paths may be served.
- :mod:`.server` — the bytes server and the management API (aiohttp); ``run`` for ``mirror serve``.
- :mod:`.client` — MirrorClient, the synchronous client of the management API.
- :mod:`.setup` — ``llmgw mirror init`` (a mirror on its own machine) and ``llmgw mirror add``.
- :mod:`.usage` — which mirror entry a catalog model's source is (``ctl model rm --delete-weights``).
"""
