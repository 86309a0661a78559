"""Stored responses (``store: true``): kept in memory, the most recent ``capacity`` of them,
for ``GET /v1/responses/{id}`` and for a later request's ``previous_response_id``.

Nothing is written to disk: a restart forgets them, and the oldest are dropped once the store
is full (a ``previous_response_id`` naming a dropped response is a 404, as an unknown one is).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.api.errors import APIError
from tokenmill.api.responses_input import Message
from tokenmill.api.responses_protocol import ResponseObject

# Responses kept by default; each holds its conversation, so this bounds memory too.
DEFAULT_CAPACITY = 1024


@dataclass(frozen=True)
class StoredResponse:
    """A finished response and the conversation that led to it, its answer last."""

    response: ResponseObject
    conversation: list[Message]


class ResponseStore:
    """The most recent ``capacity`` stored responses by id (least recently used dropped
    first); safe to use from several threads."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        """Keep ``stored``, dropping the least recently used beyond the capacity."""
        with self._lock:
            self._items[stored.response.id] = stored
            self._items.move_to_end(stored.response.id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; 404 (naming ``param``) when there is none by that id."""
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
        if stored is None:
            raise _not_found(response_id, param)
        return stored

    def delete(self, response_id: str) -> None:
        """Forget the response; 404 when there is none by that id."""
        with self._lock:
            if self._items.pop(response_id, None) is None:
                raise _not_found(response_id, None)


def _not_found(response_id: str, param: str | None) -> APIError:
    return APIError(404, f"no response with id {response_id!r} is stored (responses are kept "
                    "in memory, the most recent ones only)", param=param, code="not_found")
