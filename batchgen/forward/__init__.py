"""What one forward pass of the model is given, below layers/ and models/ so that they import it
without reaching up into engine/: the step's tensors (batch.ForwardBatch) and the tensor-parallel
group (parallel.TensorParallel)."""
