"""Benchmarking DFlash against its peers (``python -m dflash_core bench``)."""
