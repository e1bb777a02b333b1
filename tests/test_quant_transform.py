"""quant transforms on a tiny Gemma-shaped module tree: which layers are swapped, output error, errors."""
import copy
import importlib.util
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it at decoration

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastgemma.kernels.w4a16 import W4A16Config
from fastgemma.transforms.quant import Int4Linear, Int4Quant, Nf4Quant, NoQuant

H, I, P, V = 128, 256, 128, 64  # hidden, intermediate, per-layer dim, vocab


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(H, H, bias=False)
        self.k_proj, self.v_proj = nn.Linear(H, 64, bias=False), nn.Linear(H, 64, bias=False)
        self.o_proj = nn.Linear(H, H, bias=False)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x).repeat(1, 1, 2), self.v_proj(x).repeat(1, 1, 2)
        a = torch.softmax(q @ k.transpose(-1, -2) / H**0.5, dim=-1)
        return self.o_proj(a @ v)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = Attn(), Mlp()
        self.per_layer_input_gate = nn.Linear(H, P, bias=False)
        self.per_layer_projection = nn.Linear(P, H, bias=True)

    def forward(self, x):
        x = x + self.self_attn(F.rms_norm(x, (H,)))
        x = x + self.mlp(F.rms_norm(x, (H,)))
        return x + self.per_layer_projection(F.gelu(self.per_layer_input_gate(x)))


class Tiny(nn.Module):
    """Embedding with a tied head (F.linear on the embedding weight: not an nn.Linear)."""

    def __init__(self, n_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList(Layer() for _ in range(n_layers))

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return F.linear(F.rms_norm(x, (H,)), self.embed_tokens.weight)


def _model(seed=0):
    torch.manual_seed(seed)
    return Tiny().eval()


def _ids(T, seed=0):
    return torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_int4_swaps_the_right_modules():
    model = _model()
    emb = model.embed_tokens.weight
    q = Int4Quant(group_size=128, backend="torch")
    out = q.apply(model)
    assert out is model
    for name, mod in model.named_modules():
        if name.endswith("per_layer_input_gate"):
            assert type(mod) is nn.Linear, name
        elif name.endswith("_proj") or name.endswith("per_layer_projection"):
            assert isinstance(mod, Int4Linear) and mod.group_size == 128, name
    assert not any(type(m) is nn.Linear for n, m in model.named_modules() if "gate" not in n)
    assert model.embed_tokens.weight is emb  # the tied embedding / head is not touched
    d = q.describe()
    n_quant = 2 * 7  # q, k, v, o, gate, up, down per layer; per_layer_projection below
    assert d["quant"] == "int4" and d["group_size"] == 128
    assert d["quantized_layers"] == n_quant + 2
    assert d["skipped"] == ["layers.0.per_layer_input_gate", "layers.1.per_layer_input_gate"]
    assert d["quantized_params"] == 2 * (H * H * 2 + H * 64 * 2 + 3 * H * I + P * H)
    # int4 + fp32 scale and zero per 128: 0.5 + 8 / 128 bytes per param
    assert d["weight_bytes"] == d["quantized_params"] * (0.5 + 8 / 128)
    assert d["dense_weight_bytes"] == 4 * d["quantized_params"]


@pytest.mark.parametrize("G", [32, 64, 128])
def test_int4_output_close_torch_backend(G):
    ref_model = _model()
    ids = _ids(12)
    with torch.no_grad():
        ref = ref_model(ids)
        out = Int4Quant(group_size=G, backend="torch").apply(copy.deepcopy(ref_model))(ids)
    rel = _rel(out, ref)
    print(f"\nint4 g{G} (torch twin) vs fp32 tiny model: relative logit error {rel:.4f}")
    assert rel < 0.1


def test_int4_triton_backend_matches_twin():
    # interpreter: decode (M = 1, GEMV kernel) and a 3-row verify step (tl.dot kernel), fp32;
    # wide per-layer tile overrides keep the interpreter's program count small
    torch.manual_seed(0)
    ref_model = Tiny(n_layers=1).eval()
    tw = Int4Quant(group_size=64, backend="torch").apply(copy.deepcopy(ref_model))
    tr = Int4Quant(group_size=64, backend="triton").apply(copy.deepcopy(ref_model))
    lins = [m for m in tr.modules() if isinstance(m, Int4Linear)]
    assert lins and all(m.backend == "triton" for m in lins)
    for T, cfg in ((1, W4A16Config(block_n=64, block_k=128)), (3, W4A16Config(block_n=64, block_k=128, block_m=16))):
        for m in lins:
            m.config = cfg
        ids = _ids(T, seed=T)
        with torch.no_grad():
            a, b, ref = tr(ids), tw(ids), ref_model(ids)
        print(f"\nT={T}: triton vs twin max abs {(a - b).abs().max():.2e}; vs fp32 model rel {_rel(a, ref):.4f}")
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_int4linear_shapes_bias_and_state_dict():
    lin = nn.Linear(256, 48, bias=True)
    m = Int4Linear.from_linear(lin, 64, backend="torch")
    assert m.qweight.shape == (48, 128) and m.qweight.dtype == torch.uint8
    assert m.scales.shape == m.zeros.shape == (4, 48)
    x = torch.randn(2, 5, 256)
    y = m(x)
    assert y.shape == (2, 5, 48)
    assert _rel(y, lin(x).detach()) < 0.1
    m2 = Int4Linear(256, 48, group_size=64, bias=True, backend="torch", dtype=torch.float32)
    m2.load_state_dict(m.state_dict())
    torch.testing.assert_close(m2(x), y)


def test_bad_group_size_names_the_layer():
    model = _model()
    model.layers[1].odd_proj = nn.Linear(96, 16)  # K = 96: 64 and 128 do not divide it
    with pytest.raises(ValueError, match=r"K=96.*layers\.1\.odd_proj"):
        Int4Quant(group_size=64, backend="torch").apply(model)
    # validated before any swap: the model is left dense
    assert not any(isinstance(m, Int4Linear) for m in model.modules())
    with pytest.raises(ValueError, match="group_size must be one of"):
        Int4Quant(group_size=48)
    with pytest.raises(ValueError, match="backend"):
        Int4Quant(backend="cuda")


def test_skip_patterns():
    model = _model()
    with pytest.warns(UserWarning, match="no_such_layer"):
        Int4Quant(skip=["per_layer_input_gate", "no_such_layer"], backend="torch").apply(model)
    model = _model()
    q = Int4Quant(skip=["layers.*.mlp.*"], backend="torch")  # fnmatch
    q.apply(model)
    assert type(model.layers[0].mlp.up_proj) is nn.Linear
    assert isinstance(model.layers[0].per_layer_input_gate, Int4Linear)
    assert len(q.describe()["skipped"]) == 6


def test_tied_linear_head_is_left_alone():
    model = _model()
    model.lm_head = nn.Linear(H, V, bias=False)
    model.lm_head.weight = model.embed_tokens.weight
    Int4Quant(backend="torch").apply(model)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.embed_tokens.weight


def test_noquant_returns_model_unchanged():
    model = _model()
    q = NoQuant()
    assert q.apply(model) is model
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert q.describe()["quant"] == "bf16" and q.describe()["quantized_params"] == 0


def test_nf4_without_bitsandbytes_says_how_to_install():
    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed here: the missing-package error cannot be raised")
    with pytest.raises(ImportError, match=r"bitsandbytes.*pip install 'fastgemma\[nf4\]'"):
        Nf4Quant()


def test_nf4_needs_cuda():
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed")
    with pytest.raises(ValueError, match="CUDA"):
        Nf4Quant().apply(_model())
