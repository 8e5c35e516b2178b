"""Benchmarks shipped with the package: ``python -m bigbatch.bench.<name>`` or ``bigbatch bench <name>``.

Each module has ``main(argv=None) -> int``; shared timing/memory helpers live in :mod:`.common`.
"""
