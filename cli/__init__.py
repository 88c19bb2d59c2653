"""Command-line tools: ``linattn-gen`` (cli/gen.py) and ``linattn-bench`` (cli/bench/)."""
