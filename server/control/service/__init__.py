"""The control plane as one service: the leader lease, the desired state and its watchers, the reconciler."""
