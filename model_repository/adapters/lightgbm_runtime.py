"""Triton Python-backend model: a LightGBM Booster loaded from its text model file, one predict per batch."""

import lightgbm as lgb
import triton_python_backend_utils as pb_utils

from _common import AdapterSettings, execute_batched


class TritonPythonModel:
    def initialize(self, args):
        self.settings = AdapterSettings(args)
        if self.settings.artifact.suffix != ".txt":
            raise ValueError(f"lightgbm adapter loads text models only, got {self.settings.artifact.name}")
        self.booster = lgb.Booster(model_file=str(self.settings.artifact))

    def _predict(self, batch):
        return self.booster.predict(batch, num_threads=self.settings.threads)

    def execute(self, requests):
        return execute_batched(requests, pb_utils, self.settings, self._predict)

    def finalize(self):
        self.booster = None
