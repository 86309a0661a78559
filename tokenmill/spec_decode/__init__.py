"""Speculative decoding's proposers: cheap guesses of the next tokens, made after each step.

``proposer`` (the interface, what a proposer knows of the target, and the factory), ``ngram``
(prompt lookup) and ``draft`` (a small model, or the target's first layers) make the guesses.
The target model verifies them inside the runner (``tokenmill.runner.spec_verify`` and
``tokenmill.runner.rejection``), so that the output keeps the target's distribution.
"""
