"""The serving wing: how one replica is served.

The gRPC server (`server.py`), the asyncio face of the engine it drives (`async_engine.py`), the
replica's Prometheus metrics (`metrics.py`), the memory check a replica makes before it loads
(`footprint.py`) and the `inferplane worker` command (`cli.py`). It imports the engine wing; nothing
below imports it.
"""
