"""Autoscaling: signals → one saturation figure per deployment → a Knative-style decision → a Scaler.

- `signals`    per-replica figures folded into one saturation number (the same rule for every runtime)
- `decision`   pure: (signal history, now, current replicas, policy, state) → desired replicas
- `activator`  holds requests for a deployment at zero replicas until one is ready
- `autoscaler` the loop in the control plane: poll, decide, scale, report
"""
