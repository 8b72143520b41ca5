"""``python -m llmgw`` is the ``llmgw`` command."""

from llmgw.cli.main import main

main()
