"""`tokenmill serve --replicas N`: replicas of the async engine on Ray Serve behind an ingress
with `tokenmill serve`'s HTTP surface, and a prefix-aware request router.

Importing this package imports no Ray (the CLI adds its options without it); the modules
that run on Ray do (``pip install tokenmill[ray]``).
"""

# `--router`: which replica a request goes to (see routing.py).
ROUTERS = ("prefix", "pow2", "round_robin")
