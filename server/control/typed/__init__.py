"""Typed per-model APIs: the schema, its .proto form, the compatibility check, the catalog and its store."""
