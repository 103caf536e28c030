"""In-process tests of one module or engine (marker `unit`, tests/README.md)."""
