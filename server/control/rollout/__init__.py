"""Rolling versions out: the deployers (models, composites), the traffic controller (canary, blue-green, A/B, shadow), its statistics."""
