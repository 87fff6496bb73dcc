"""What a worker process is started with: the parent's settings, secrets included."""

import json

from pydantic import SecretStr

from server.settings import Settings
from server.runtime.workers import settings_json, worker_settings


def test_a_worker_gets_the_key_pepper_in_clear(tmp_path):
    parent = Settings(model_repository=tmp_path, key_pepper=SecretStr("pepper"), redis_url="redis://127.0.0.1:6379/0", workers=2, grpc_port=9001, http_port=9000)
    worker = Settings(**json.loads(settings_json(worker_settings(parent, "127.0.0.1:1234", 9001, 9000))))
    assert worker.key_pepper.get_secret_value() == "pepper"
    assert (worker.worker, worker.workers, worker.triton_url, worker.redis_url) == (True, 1, "127.0.0.1:1234", parent.redis_url)
