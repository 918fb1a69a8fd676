"""The column-sum kernel (CPU: TRITON_INTERPRET=1) against torch's sum, and the stage-4
rewrite that routes Inductor's mix-order reductions' final sums to it (any line it must
rewrite, any line it must leave alone)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fsg
from fsg._src import _torch_private
from fsg._src.backend import column_sums as CS
from fsg._src.kernels import column_sum as K
from fsg._src.passes.options import Fusions
from tests.kernels.common import KERNEL, needs_triton


@needs_triton
@KERNEL
@given(rows=st.integers(1, 2100), cols=st.integers(1, 40), seed=st.integers(0, 99))
def test_column_sum_matches_torch(rows, cols, seed):
    """Any shape (rows past one block of 1024, columns not a multiple of 16): torch's sum
    up to float32 rounding, and the same bits on a second call."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 10
    got = K.column_sum(x)
    want = x.double().sum(dim=0)
    assert got.dtype == torch.float32 and got.shape == (cols,)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4 * rows**0.5)
    assert torch.equal(K.column_sum(x), got)


@needs_triton
def test_column_sum_of_a_view_and_the_fallbacks():
    """A slice of a workspace (what the wrapper passes), and the inputs the kernel does not
    take, which get torch's sum: another dtype, another rank, no elements."""
    ws = torch.randn(3 * 64 * 24)
    view = ws[64 * 24 : 2 * 64 * 24].view(64, 24)
    torch.testing.assert_close(K.column_sum(view), view.sum(dim=0))
    for x in (torch.randn(5, 7, dtype=torch.float64), torch.randn(4, 3, 2), torch.randn(0, 5)):
        assert torch.equal(K.column_sum(x), x.sum(dim=0))


class _Wrapper:
    """What the rewrite needs of Inductor's wrapper codegen: its import block."""

    def __init__(self):
        self.imports = _Imports()


@pytest.fixture(autouse=True)
def _buffers_of_their_own(monkeypatch):
    """Outside a compile there is no Inductor graph to ask: buffers have storage of their own
    unless a test says otherwise."""
    monkeypatch.setattr(_torch_private, "buffer_storage", lambda name, wrapper=None: "own")


class _Imports:
    """What the rewrite needs of Inductor's import buffer: ``getvalue`` and ``writeline``."""

    def __init__(self):
        self.lines = []

    def getvalue(self):
        return "\n".join(self.lines)

    def writeline(self, line):
        self.lines.append(line)


_NAME = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)


@given(
    buf=_NAME, ws=_NAME, idx=st.integers(0, 9), n=st.integers(1, 4096), c=st.integers(1, 9000),
    tail=st.sampled_from(["", ".to(torch.bfloat16)", ".view([C])", ".view([C]).to(torch.float16)"]),
)  # fmt: skip
def test_the_final_sum_becomes_a_call_of_the_kernel(buf, ws, idx, n, c, tail):
    """Both forms Inductor writes (torch 2.11: ``...sum(dim=0)[.to(dtype)]``; 2.13 adds
    ``.view([C])``): the same slice and view go to ``fsg_column_sum``, the tail stays, and the
    import is added once."""
    tail = tail.replace("C", str(c))
    stride = f"({n}) * ({c})"
    operand = f"{ws}[{idx} * {stride} : ({idx} + 1) * {stride}].view({n}, {c})"
    wrapper = _Wrapper()
    for _ in range(2):
        assert CS.rewrite(f"{buf} = {operand}.sum(dim=0){tail}", wrapper) == f"{buf} = fsg_column_sum({operand}){tail}"
    assert wrapper.imports.lines == [CS.IMPORT]


@pytest.mark.parametrize(
    "line",
    [
        "buf3 = workspace_0[0 : 8].view(2, 4).amax(dim=0)",  # a max/min reduction into its own buffer
        "buf3 = workspace_0[0 : 8].view(2, 4).sum(dim=1)",
        "buf3 = x.sum(dim=0)",  # not a slice of a workspace
        "extern_kernels.mm(buf1, buf2, out=buf3)",
        "# buf3 = workspace_0[0 : 8].view(2, 4).sum(dim=0)",
    ],
)
def test_other_lines_are_left_alone(line):
    wrapper = _Wrapper()
    assert CS.rewrite(line, wrapper) == line and wrapper.imports.lines == []


def test_the_context_patches_and_restores():
    """Inside: the rewrite sits in Inductor's wrapper codegen and the cache-key tag is fsg's,
    with the step's fusions (added to a user's own); outside, both are as they were. The kernel
    off: the rewrite still corrects the sums' destinations, under a tag of its own."""
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    original = PythonWrapperCodegen.writeline
    tags = set()
    with torch.compiler.config.patch(cache_key_tag="mine"):  # (monkeypatch would delete the option after)
        for fusions, tag in ((Fusions(), CS.CACHE_TAG), (Fusions(batch_casts=False), CS.CACHE_TAG),
                             (Fusions(column_sums=False), CS.FIX_TAG)):  # fmt: skip
            with CS.final_sums_as_kernels(fusions):
                assert PythonWrapperCodegen.writeline is not original
                assert torch.compiler.config.cache_key_tag == f"mine+{tag}+{fusions.tag()}"
                tags.add(torch.compiler.config.cache_key_tag)
            assert PythonWrapperCodegen.writeline is original and torch.compiler.config.cache_key_tag == "mine"
    assert torch.compiler.config.cache_key_tag == "" and len(tags) == 3  # other fusions: another cache entry


def test_wrapper_lines_rewritten_restores_on_error():
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    original = PythonWrapperCodegen.writeline
    with pytest.raises(RuntimeError), _torch_private.wrapper_lines_rewritten(lambda line, imports: line):
        raise RuntimeError("a failed compile")
    assert PythonWrapperCodegen.writeline is original


@given(
    buf=_NAME, op=st.sampled_from(["sum", "amax", "amin", "prod"]), kernel=st.booleans(),
    tail=st.sampled_from(["", ".to(torch.bfloat16)", ".view([24])"]),
)  # fmt: skip
def test_a_sum_into_a_slice_of_a_cat_is_written_there(buf, op, kernel, tail):
    """A buffer that is a slice of another (a ``cat`` input computed in place): its slice is
    allocated first (asked of ``buffer_storage`` with the wrapper) and the result written into
    it, by the kernel's ``out=`` or ``copy_``; never bound to a new tensor under its name."""
    asked = []
    operand = "workspace_0[0 * (4) * (24) : (0 + 1) * (4) * (24)].view(4, 24)"
    wrapper = _Wrapper()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_torch_private, "buffer_storage", lambda name, wrapper=None: asked.append(wrapper) or "alias")
        got = CS.rewrite(f"  {buf} = {operand}.{op}(dim=0){tail}", wrapper, kernel)
    if kernel and op == "sum":
        assert got == f"  fsg_column_sum({operand}, out={buf})"
    else:
        assert got == f"  {buf}.copy_({operand}.{op}(dim=0){tail})"
    assert asked == [wrapper]


def test_a_sum_into_any_other_foreign_buffer_is_refused(monkeypatch):
    """A buffer whose storage is neither its own nor a slice (a mutated input): no silent new
    tensor; an error that names the buffer and the way out."""
    monkeypatch.setattr(_torch_private, "buffer_storage", lambda name, wrapper=None: "other")
    with pytest.raises(fsg.UnsupportedError, match="buf7.*TORCHINDUCTOR_MIX_ORDER_REDUCTION=0"):
        CS.rewrite("buf7 = workspace_0[0 : 8].view(2, 4).sum(dim=0)", _Wrapper())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_sum_into_out(dtype):
    """``out=``: a slice of a larger buffer (float32: the kernel writes it; another dtype:
    converted), nothing outside the slice touched; the wrong size is an error."""
    x = torch.randn(300, 24)
    base = torch.full((100,), 7.0, dtype=dtype)
    out = base[10:34]
    assert K.column_sum(x, out=out) is out
    torch.testing.assert_close(out.float(), x.sum(dim=0).to(dtype).float())
    assert (base[:10] == 7).all() and (base[34:] == 7).all()
    with pytest.raises(ValueError, match="24 column sums"):
        K.column_sum(x, out=torch.empty(23))


@needs_triton
@KERNEL
@given(
    n=st.integers(1, 40), c=st.integers(1, 40), idx=st.integers(0, 2), op=st.sampled_from(["sum", "amax", "prod"]),
    kernel=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 99),
)  # fmt: skip
def test_the_rewritten_line_fills_the_slice_when_run(n, c, idx, op, kernel, dtype, seed):
    """The line the rewrite writes for a slice, run as the wrapper would run it (the workspace,
    the cat's buffer and the slice's alias in scope): the slice holds Inductor's reduction (in
    the buffer's dtype) and nothing else in the buffer changes."""
    g = torch.Generator().manual_seed(seed)
    ws = torch.randn(3 * n * c, generator=g)
    base = torch.full((c + 10,), 7.0, dtype=dtype)
    stride = f"({n}) * ({c})"
    partials = f"workspace_0[{idx} * {stride} : ({idx} + 1) * {stride}].view({n}, {c})"
    tail = "" if dtype == torch.float32 else ".to(torch.bfloat16)"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_torch_private, "buffer_storage", lambda name, wrapper=None: "alias")
        line = CS.rewrite(f"buf3 = {partials}.{op}(dim=0){tail}", _Wrapper(), kernel)
    scope = {"workspace_0": ws, "buf3": base[4 : 4 + c], "fsg_column_sum": K.column_sum, "torch": torch}
    exec(line, scope)  # noqa: S102 - the wrapper code under test
    want = getattr(ws[idx * n * c : (idx + 1) * n * c].view(n, c), op)(dim=0).to(dtype)
    torch.testing.assert_close(base[4 : 4 + c], want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    assert (base[:4] == 7).all() and (base[4 + c :] == 7).all()
