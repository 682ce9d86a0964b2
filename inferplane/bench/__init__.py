"""Benchmarks that run a peer and our code side by side in one run and print the ratio.

Each module has `main(argv) -> int`; `inferplane bench NAME [args]` runs it.
"""
