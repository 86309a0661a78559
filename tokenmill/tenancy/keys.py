"""Project API keys: random, shown once, kept only as a hash.

A key is ``sk-proj-`` and 32 random bytes (256 bits, URL-safe base64). The store keeps its
SHA-256: a slow password hash (bcrypt, argon2) defends a low-entropy secret against guessing,
but nobody can guess 2**256 values, so one fast hash is as safe here and keeps the lookup of
every request a single indexed query."""

from __future__ import annotations

import hashlib
import secrets

PREFIX = "sk-proj-"


def new_key() -> str:
    """A fresh project key (the only time it exists in clear)."""
    return PREFIX + secrets.token_urlsafe(32)


def key_hash(key: str) -> str:
    """The hex SHA-256 under which the store keeps ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


def redacted(key: str) -> str:
    """What listings show of a key: its prefix and last four characters (OpenAI's form)."""
    return f"{key[:len(PREFIX) + 2]}****{key[-4:]}"


def looks_like_project_key(token: str) -> bool:
    """Whether a bearer token is meant as a project key (else it may be the server key)."""
    return token.startswith(PREFIX)
