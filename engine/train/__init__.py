"""Training the small model: the batched training forward (batched.py), parameters (params.py), the
run loop and its CLI (loop.py, `python -m engine.train`), held-out evaluation (eval.py, `python -m
engine.train.eval`) and the training corpus (corpus_data.py)."""
