"""Engines start from model folders on the node: ray.serve.llm's node initialization has
nothing to fetch for them, and skipping it saves a Ray task per engine start that imports vLLM
only to return the path it was given (about 10 s of the 2-core CPU at every app start)."""

from __future__ import annotations

from pathlib import Path

from ray.llm._internal.common.callbacks.base import CallbackBase


class LocalModelFolders(CallbackBase):
    """Skips the node initialization when the model source is a folder here; any other source
    (a hub id, a bucket) is initialized as ray.serve.llm does by default."""

    async def on_before_node_init(self) -> None:
        source = self.llm_config.get_engine_config().actual_hf_model_id
        self.ctx.run_init_node = not Path(source).is_dir()
