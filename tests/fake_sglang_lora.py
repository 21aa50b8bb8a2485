"""SGLang's multi-LoRA serving in the fake server (tests/fake_sglang_server.py): `/load_lora_adapter` reads PEFT's
adapter folder (adapter_config.json, adapter_model.safetensors) into an engine of its own (the base with the
adapters merged, models/lora.py), `/unload_lora_adapter` drops it, and a request naming an adapter
(`lora_path`) decodes with it, so its logprobs are real. Refusals as SGLang's: LoRA not enabled, a name loaded
twice or not loaded, a rank above `--max-lora-rank`. Not runnable alone; see tests/test_sglang_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from safetensors.torch import load_file


class LoRAMixin:
    """Mixed into FakeSGLangServer (which provides model_path, seed, engine)."""

    lora_enabled = False  # --enable-lora
    max_lora_rank = 0  # --max-lora-rank

    def adapter_engines(self) -> dict:
        if not hasattr(self, "_adapters"):
            self._adapters = {}
        return self._adapters

    def load_lora(self, body: dict):
        from fake_sglang_server import value_error
        from nanoverl_async.generators.builtin_engine import BuiltinEngine

        name, path = body.get("lora_name"), Path(str(body.get("lora_path")))
        if not self.lora_enabled:
            raise value_error("LoRA is not enabled: launch the server with --enable-lora")
        if name in self.adapter_engines():
            raise value_error(f"The LoRA adapter {name} has already been loaded")
        config = json.loads((path / "adapter_config.json").read_text())
        if config["r"] > self.max_lora_rank:
            raise value_error(f"LoRA adapter {name} has rank {config['r']} > --max-lora-rank {self.max_lora_rank}")
        engine = BuiltinEngine(self.model_path, seed=self.seed, lora_scaling=config["lora_alpha"] / config["r"])
        engine.stage_weights(load_file(str(path / "adapter_model.safetensors")), 1)
        self.adapter_engines()[name] = engine
        return {"success": True, "loaded_adapters": {key: key for key in self.adapter_engines()}}

    def unload_lora(self, body: dict):
        from fake_sglang_server import value_error

        if self.adapter_engines().pop(body.get("lora_name"), None) is None:
            raise value_error(f"The LoRA adapter {body.get('lora_name')} is not loaded")
        return {"success": True, "loaded_adapters": {key: key for key in self.adapter_engines()}}

    def engine_for(self, adapter: Optional[str]):
        """The engine a request naming `adapter` decodes with (None: the base)."""
        from fake_sglang_server import value_error

        if adapter is None:
            return self.engine
        if adapter not in self.adapter_engines():
            raise value_error(f"LoRA adapter {adapter} is not loaded")
        return self.adapter_engines()[adapter]
