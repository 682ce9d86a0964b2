"""The Kubernetes operator: the InferenceDeployment CRD reconciled into worker Deployments.

`manifests` (and `api.resolve`, which it uses) are pure (no kopf, no Kubernetes client) so that the local supervisor
and tests can use them; `handlers` holds the kopf lifecycle; `cli` starts it.
"""
