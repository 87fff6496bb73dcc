"""The model registry and what it stores: versions, artifacts, safe formats, signatures, records at rest, retention."""
