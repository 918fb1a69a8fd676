"""Stage 4's views-as-reshapes rewrite (``backend/views.py``): a view no op writes through
becomes a reshape (the same values, also where the strides Inductor chose allow no view); a
view an op writes through stays."""

import torch
from torch import fx

from fsg._src.backend import views

aten = torch.ops.aten


def test_views_become_reshapes_except_those_written_through():
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    read = g.call_function(aten.view.default, (x, [4, 2]))
    doubled = g.call_function(aten.mul.Tensor, (read, 2.0))
    dst = g.call_function(aten.view.default, (y, [4, 2]))
    g.call_function(aten.copy_.default, (dst, doubled))
    g.output((doubled,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert views.views_as_reshapes(gm) == 1
    assert read.target is aten.reshape.default and dst.target is aten.view.default
    x_val, y_val = torch.randn(2, 4).t(), torch.zeros(8)  # x_val: strides no [4, 2] view takes
    (out,) = gm(x_val, y_val)
    torch.testing.assert_close(out, x_val.reshape(4, 2) * 2)
    torch.testing.assert_close(y_val.view(4, 2), out)
