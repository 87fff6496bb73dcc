"""Triton Python-backend model: an XGBoost Booster loaded from JSON or UBJ, ``inplace_predict`` per batch."""

import triton_python_backend_utils as pb_utils
import xgboost as xgb

from _common import AdapterSettings, execute_batched


class TritonPythonModel:
    def initialize(self, args):
        self.settings = AdapterSettings(args)
        if self.settings.artifact.suffix not in (".json", ".ubj"):  # XGBoost reads the format from the suffix
            raise ValueError(f"xgboost adapter loads JSON or UBJ models only, got {self.settings.artifact.name}")
        self.booster = xgb.Booster()
        self.booster.load_model(str(self.settings.artifact))
        self.booster.set_param({"nthread": self.settings.threads})

    def _predict(self, batch):
        return self.booster.inplace_predict(batch, validate_features=False)

    def execute(self, requests):
        return execute_batched(requests, pb_utils, self.settings, self._predict)

    def finalize(self):
        self.booster = None
