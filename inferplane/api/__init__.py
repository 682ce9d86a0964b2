"""Types shared by the operator, the control plane and the local supervisor."""
