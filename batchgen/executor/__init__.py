"""The device side: StepInputs in, sampled tokens and log-probabilities out (model runner, memory,
KV tensors, CUDA graphs, warm-up, product tuning, tensor-parallel workers, sampling)."""
