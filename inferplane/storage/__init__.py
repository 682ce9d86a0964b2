"""Model weights on a node: fetch them by URI into a digest-keyed cache, verified before anyone loads them.

The registry records a model as a URI and a sha256; a worker loads weights only from this cache (or
from a path already on the node), never from a half-written or unverified file. Modules, one job each:

- `digest`: the sha256 of a file or a model folder (the registry's definition).
- `uris`: what a model URI may be (file, pvc, http(s), s3) and its parts.
- `cache`: the on-disk layout, shared with the operator, and its lock and atomic commit.
- `fetch`: `fetch_model`, which ties them together; `http_source` and `s3_source` do the transfers.
- `cli`: `inferplane fetch-model`, the init container's command.

This package imports only the standard library, third-party libraries and `inferplane.api`, so the
worker, the operator and the control plane can all use it. This file imports nothing, so that
`import inferplane.storage.cache` (the operator) or building `inferplane --help` stays cheap.
"""
