"""torch's fast paths (``_fast_paths``): ``nn.MultiheadAttention`` and the transformer encoder
in eval mode, without autograd, run fused kernels whose values differ from the composite
path's (a fully masked row: NaN against 0; padded positions: zeros). The record pass's
torch-function mode hid them, and every engine compiled the composite path: silently not
eager's values, from the first call (probe 42b). Now the record pass takes the fast path as
eager code does, and the step runs eagerly, warned; where no fast path is taken, it compiles."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines

MASK = torch.tensor([[False, False, True], [True, True, True]])
"""A padded position in the first row, the whole second row masked."""


def _attention() -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(4, 2, batch_first=True)


def _encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=True)


@pytest.fixture
def fast_path_on() -> Iterator[None]:
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(True)
    yield
    torch.backends.mha.set_fastpath_enabled(before)


def _x(n: int = 1) -> torch.Tensor:
    return n * torch.linspace(-1, 1, 24).reshape(2, 3, 4)


def test_attention_in_eval_mode_without_autograd_runs_eagerly_like_eager(
    fast_path_on: None,
) -> None:
    mha = _attention().eval()
    step = lambda x: mha(x, x, x, key_padding_mask=MASK, need_weights=False)[0]  # noqa: E731
    jitted = ptj.jit(step)
    with torch.no_grad():
        with pytest.warns(ptj.JitWarning, match="fast path .*MultiheadAttention"):
            first = jitted(_x())
        torch.testing.assert_close(first, step(_x()), equal_nan=True)  # the record pass's
        assert first[1].isnan().all()  # the fast path's answer for a row fully masked
        for n in range(2, 5):
            torch.testing.assert_close(jitted(_x(n)), step(_x(n)), equal_nan=True)
    assert jitted.num_traces == 1


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_an_encoder_made_eval_after_the_trace_retraces_and_runs_its_fast_path_eagerly(
    fast_path_on: None,
) -> None:
    """Trained with autograd (composite path, compiled), then ``.eval()`` under ``no_grad``:
    the module guard retraces, and the record pass meets the fast path (nested tensors)."""
    encoder = _encoder()
    mask = MASK.clone()
    mask[1, 0] = False  # (a nested tensor needs a position left in each row)
    step = lambda x: encoder(x, src_key_padding_mask=mask)  # noqa: E731
    jitted = ptj.jit(step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for n in range(1, 4):
            torch.testing.assert_close(jitted(_x(n)), step(_x(n)))
    encoder.eval()
    with torch.no_grad():
        with pytest.warns(ptj.JitWarning, match="fast path .*TransformerEncoder"):
            torch.testing.assert_close(jitted(_x()), step(_x()))
        for n in range(2, 5):
            torch.testing.assert_close(jitted(_x(n)), step(_x(n)))


def test_with_the_fast_path_turned_off_attention_compiles() -> None:
    mha = _attention().eval()
    step = lambda x: mha(x, x, x, need_weights=False)[0]  # noqa: E731
    jitted = ptj.jit(step)
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", ptj.JitWarning)
            for n in range(1, 4):
                torch.testing.assert_close(jitted(_x(n)), step(_x(n)))
    finally:
        torch.backends.mha.set_fastpath_enabled(before)
    assert "eagerly" not in jitted.explain().split("not guarded")[0]
