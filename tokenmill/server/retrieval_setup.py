"""The server's retrieval service: files and vector stores embedded by the served embedding
model (the first one), through the same scheduler as every other request."""

from __future__ import annotations

import asyncio

from tokenmill.config import ServerConfig
from tokenmill.engine.async_llm import EngineOverloadedError
from tokenmill.retrieval.embedder import TokenizerEmbedder
from tokenmill.retrieval.service import RetrievalService, default_data_dir
from tokenmill.sampling_params import PoolingParams
from tokenmill.server.state import EMBED, ServerState

# Seconds between tries while the embedding engine's queue is full.
OVERLOADED_RETRY_S = 0.1


def build_retrieval(state: ServerState, config: ServerConfig) -> RetrievalService | None:
    """The retrieval service, or None when the server serves no embedding model."""
    embedders = [m for m in state.models.values() if m.task == EMBED]
    if not embedders:
        return None
    first = embedders[0]

    async def embed(texts: list[str]) -> list[list[float]]:
        """Embed with the embedding model of that name now (it may have been swapped), in
        slices the engine admits, waiting while its queue is full."""
        served = state.model(first.name if first.name in state.models else None, EMBED)
        step = max(1, served.client.capacity // 2)
        vectors: list[list[float]] = []
        params = PoolingParams(truncate_prompt_tokens=-1)
        for i in range(0, len(texts), step):
            while True:
                try:
                    with served.lease():
                        outs = await served.client.embed(texts[i:i + step], params)
                    break
                except EngineOverloadedError:
                    await asyncio.sleep(OVERLOADED_RETRY_S)
            vectors.extend(o.embedding for o in outs)
        return vectors

    embedder = TokenizerEmbedder(embed, first.client.tokenizer.backend,
                                 first.client.max_model_len)
    return RetrievalService(config.data_dir or default_data_dir(), embedder)
