"""Models by name from a Hugging Face hub: references (``refs``), downloads into
huggingface_hub's cache (``download``) and the `tokenmill pull|list|rm` commands (``cli``).

A local path that exists always wins over a reference of the same spelling. Nothing here
imports torch, so these commands start fast; huggingface_hub is imported on first use.
"""

from tokenmill.hub.refs import HubRef, parse_hub_ref

__all__ = ["HubRef", "parse_hub_ref"]
