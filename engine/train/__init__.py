"""Training the small model: the batched training forward, parameters, the run loop and its CLI
(`python -m engine.train`)."""
