"""Offline artifact optimization before rollout.

``recipes`` turns a registered version's artifact into candidates (ONNX graph optimization, FP16,
INT8 dynamic / static QDQ, INT4 weight-only, tree models compiled to ONNX, TensorRT plans);
``gate`` checks each candidate against its parent on the stored validation set (pure);
``profile`` measures parent and candidates together in a real Triton with the loadtest tool;
``pipeline`` ties them together and registers accepted candidates with lineage and recipe;
``embedding`` runs the same recipes, gate and profile on the text-in embedding model (MiniLM);
``cli`` is ``inferplane optimize``; ``bench`` produces the BENCHMARKS.md tables.
"""
