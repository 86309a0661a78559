"""The OpenAI-compatible API without HTTP: request schemas, validation of a request into engine
prompts and SamplingParams, response bodies and error bodies. The HTTP server, batch files and
streams all go through it, so a bad request gets the same answer everywhere."""
