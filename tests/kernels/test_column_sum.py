"""The column-sum kernel (CPU: TRITON_INTERPRET=1) against torch's sum, and the stage-4
rewrite that routes Inductor's mix-order reductions' final sums to it (any line it must
rewrite, any line it must leave alone)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fsg._src import _torch_private
from fsg._src.backend import column_sums as CS
from fsg._src.kernels import column_sum as K
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
    imports = _Imports()
    for _ in range(2):
        assert CS.rewrite(f"{buf} = {operand}.sum(dim=0){tail}", imports) == f"{buf} = fsg_column_sum({operand}){tail}"
    assert imports.lines == [CS.IMPORT]


@pytest.mark.parametrize(
    "line",
    [
        "buf3 = workspace_0[0 : 8].view(2, 4).amax(dim=0)",  # a max/min reduction: not a sum
        "buf3 = workspace_0[0 : 8].view(2, 4).sum(dim=1)",
        "buf3 = x.sum(dim=0)",  # not a slice of a workspace
        "extern_kernels.mm(buf1, buf2, out=buf3)",
        "# buf3 = workspace_0[0 : 8].view(2, 4).sum(dim=0)",
    ],
)
def test_other_lines_are_left_alone(line):
    imports = _Imports()
    assert CS.rewrite(line, imports) == line and imports.lines == []


def test_the_context_patches_and_restores(monkeypatch):
    """Inside: the rewrite sits in Inductor's wrapper codegen and the cache-key tag is fsg's
    (added to a user's own); outside, both are as they were. Disabled: nothing changes."""
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    original = PythonWrapperCodegen.writeline
    with torch.compiler.config.patch(cache_key_tag="mine"):  # (monkeypatch would delete the option after)
        with CS.final_sums_as_kernels():
            assert PythonWrapperCodegen.writeline is not original
            assert torch.compiler.config.cache_key_tag == f"mine+{CS.CACHE_TAG}"
        assert PythonWrapperCodegen.writeline is original and torch.compiler.config.cache_key_tag == "mine"
        monkeypatch.setattr(CS, "ENABLED", False)
        with CS.final_sums_as_kernels():
            assert PythonWrapperCodegen.writeline is original and torch.compiler.config.cache_key_tag == "mine"
    assert torch.compiler.config.cache_key_tag == ""


def test_wrapper_lines_rewritten_restores_on_error():
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    original = PythonWrapperCodegen.writeline
    with pytest.raises(RuntimeError), _torch_private.wrapper_lines_rewritten(lambda line, imports: line):
        raise RuntimeError("a failed compile")
    assert PythonWrapperCodegen.writeline is original
