"""Hot-path ops of the engine, one op per file (imported from their modules: the package re-exports
nothing, so `batchgen.kernels.rmsnorm` is always the module, never its function).

Every file holds a Triton kernel, its launcher and a torch reference of the same op, and one public
function that picks between them: the Triton launcher for CUDA tensors, the torch reference
elsewhere (CPU runs of the engine, and the ground truth of the kernel tests).

No compile inside a job: Triton compiles a kernel once per specialization of its arguments (an int
that is 1 or a multiple of 16, a pointer that is 16-byte aligned), and the engine's warm-up
(executor/warmup.py) makes every specialization a job can meet. So an argument that varies from step
to step is never specialized: ints such as a split or part count are `do_not_specialize`, and index
arrays (rows, lengths, positions, slots, a sampler's seeds), views at any offset into a step's
staged inputs (`rows[num_decode:]`, the seeds after the top-k values), are
`do_not_specialize_on_alignment`: their loads are per row, where alignment buys nothing.
"""
