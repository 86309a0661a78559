"""Retrieval: uploaded files, vector stores (SQLite + FAISS under a data folder), chunking,
embedding through an ``Embedder`` and search. ``RetrievalService`` is the entry point; the
Responses API's ``file_search`` tool calls its ``search``."""

from tokenmill.retrieval.embedder import Embedder, HashEmbedder, TokenizerEmbedder
from tokenmill.retrieval.service import RetrievalService, SearchResult, default_data_dir

__all__ = ["Embedder", "HashEmbedder", "RetrievalService", "SearchResult", "TokenizerEmbedder",
           "default_data_dir"]
