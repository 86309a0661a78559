"""Speculative decoding: cheap proposers guess the next tokens, the target model verifies them.

``proposer`` (the interface and its factory), ``ngram`` (prompt lookup) and ``draft`` (a small
model, or the target's first layers) make the guesses; ``rejection`` accepts or rejects them so
that the output keeps the target model's distribution; ``verify`` prepares the target's
distributions from the runner's logits; ``metrics`` counts what was proposed and accepted.
"""
