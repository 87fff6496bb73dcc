"""Composite endpoints: the spec, its compiler, the composite versions of the registry."""
