"""Multi-LoRA serving: adapter weights read from PEFT folders (`weights.py`), the layers that add
each token's adapter to the base layers' output (`layers.py`), the runner's device slots and CPU
cache (`runner.py`) and the engine core's off-loop loads (`loads.py`)."""
