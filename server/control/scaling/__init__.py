"""The fleet and its scaling: placement, executors, load signals, the autoscaler, the weight cache."""
