"""The decode loop and its parts: the engine, the draft-length policy, sampling and
verification, draft trees, the KV cache, row-exact attention, token events, text.

Nothing here imports the rest of specchat."""
