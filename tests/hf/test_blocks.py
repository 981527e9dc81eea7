import pytest
import torch
from torch import nn

from gss import GSSError, find_decoder_blocks
from gss.hf.blocks import residual_width, resolve_layer

from ..helpers import ARCHITECTURES


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_known_architectures(make_model, arch):
    model = make_model(arch, layers=3)
    blocks = find_decoder_blocks(model)
    assert isinstance(blocks, nn.ModuleList) and len(blocks) == 3
    assert resolve_layer(model, -1)[0] == 2
    assert resolve_layer(model, -1)[1] is blocks[2]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.lin(x)


class _Config:
    num_hidden_layers = 3


class _Odd(nn.Module):
    """An unknown layout: blocks live under an unusual name."""

    def __init__(self, n_blocks=3):
        super().__init__()
        self.config = _Config()
        self.stack = nn.Module()
        self.stack.units = nn.ModuleList(_Block() for _ in range(n_blocks))
        self.heads = nn.ModuleList([nn.Linear(4, 4)])


def test_structural_fallback_and_override():
    model = _Odd()
    assert find_decoder_blocks(model) is model.stack.units
    assert find_decoder_blocks(model, "stack.units") is model.stack.units
    with pytest.raises(GSSError, match="does not name"):
        find_decoder_blocks(model, "stack.nothing")


def test_unknown_layout_lists_candidates():
    model = _Odd(n_blocks=2)  # length does not match the config: nothing to fall back on
    with pytest.raises(GSSError, match=r"stack\.units \(len 2\).*block_path"):
        find_decoder_blocks(model)


def test_layer_out_of_range(make_model):
    with pytest.raises(GSSError, match=r"valid layers are 0\.\.1"):
        resolve_layer(make_model("llama"), 2)


def test_wrapped_model_is_searched_through(make_model):
    inner = make_model("llama")
    wrapper = nn.Module()
    wrapper.module = inner  # as DistributedDataParallel does
    assert find_decoder_blocks(wrapper) is inner.model.layers
    torch.testing.assert_close(len(find_decoder_blocks(wrapper)), 2)


def test_residual_width_is_the_blocks_not_the_embeddings(make_model):
    opt = make_model("opt")  # embeddings half as wide as the blocks
    assert opt.get_input_embeddings().weight.shape[1] == 16
    assert residual_width(opt) == 32

    class Wrapper(nn.Module):  # as DDP keeps a model: under .module, with no config of its own
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner

    assert residual_width(Wrapper(opt)) == 32
    bare = nn.Module()
    bare.embed = nn.Embedding(10, 12)
    bare.get_input_embeddings = lambda: bare.embed  # no config: the embeddings' width
    assert residual_width(bare) == 12
    with pytest.raises(GSSError, match="cannot tell the hidden size"):
        residual_width(nn.Linear(2, 2))
