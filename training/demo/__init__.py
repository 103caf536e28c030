"""The bundled demo model pair: corpus, tokenizer and training of a small target, built offline.

Everything here is derived from the Python standard library's own sources, which every machine that runs
this project has, so the demo models can be rebuilt anywhere without a download (docs/ARCHITECTURE.md §7).
"""
