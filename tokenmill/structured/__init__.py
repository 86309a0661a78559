"""Structured outputs: output constraints (JSON schema, regex, choice, EBNF grammar) compiled
by xgrammar, and the per-request matchers whose token bitmasks the runner's sampler applies."""
