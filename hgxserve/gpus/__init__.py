"""`hgxserve gpus`: the GPU checks engine units run around the engine."""
