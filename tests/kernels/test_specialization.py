"""The rule of kernels/__init__.py, checked on every kernel the engine launches (a `@triton.jit`
function named `*_kernel`): a parameter that takes an index array (a step's rows, lengths, query
starts, positions or slots, a sampler's per-row parameters) is not specialized on 16-byte alignment.
Such arrays are views at any offset into a step's inputs, the warm-up's are aligned, and a kernel
specialized on them compiled in the middle of a job. tests/gpu/test_warmup_gpu.py shows the effect on
a GPU; this checks the rule on CPU, where Triton's interpreter keeps no specializations."""
import ast
import re
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "batchgen" / "kernels"
INDEX_ARRAY = re.compile(r"(rows|lens|q_start|positions|slots|seeds|steps|temperatures)_ptr$")
# its arrays of that kind are the decode graph's static buffers, which it writes
STATIC_BUFFERS = {"_unpack_decode_kernel"}
# Gluon kernels jitted at their first launch (kernels/decode_mlp_gluon.py: an experimental API must not
# fail the import), with no do_not_specialize_on_alignment: an index array among their parameters fails
LAZILY_JITTED = {"_decode_mlp_gluon_kernel", "_row_product_gluon_kernel"}


def launched_kernels():
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                yield path.name, node


def unaligned_params(fn: ast.FunctionDef) -> set[str] | None:
    """The names in its triton.jit(do_not_specialize_on_alignment=[...]); None: not a triton.jit kernel."""
    for deco in fn.decorator_list:
        call = deco if isinstance(deco, ast.Call) else None
        if ast.unparse(call.func if call else deco) != "triton.jit":
            continue
        names = set()
        for keyword in call.keywords if call else []:
            if keyword.arg == "do_not_specialize_on_alignment":
                names.update(ast.literal_eval(keyword.value))
        return names
    return None


def test_index_arrays_are_not_specialized_on_alignment():
    kernels = list(launched_kernels())
    assert len(kernels) >= 10
    missing = []
    for file, fn in kernels:
        unaligned = set() if fn.name in LAZILY_JITTED else unaligned_params(fn)
        assert unaligned is not None, f"{file}: {fn.name} is not a triton.jit kernel"
        if fn.name in STATIC_BUFFERS:
            continue
        missing += [f"{file}: {fn.name}({a.arg})" for a in fn.args.args
                    if INDEX_ARRAY.search(a.arg) and a.arg not in unaligned]
    assert missing == []
