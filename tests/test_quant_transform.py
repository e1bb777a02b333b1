"""quant transforms on a tiny Gemma-shaped module tree: which layers are swapped, output error, errors."""
import copy
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it at decoration

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastgemma.kernels.w4a16_table import W4A16Config
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


def test_int4linear_keeps_its_packed_scale_zero_words_in_step():
    """16-bit scales come with `sz` (pack_scale_zero), rebuilt by set_scales and by .to(); fp32 scales
    have none; state dicts leave it out; a triton-backend fp16 module passes it to the per-group
    kernel and gets the separate-scales output bit for bit."""
    from fastgemma.kernels.int4_pack import pack_scale_zero
    from fastgemma.transforms.fuse import _cat_int4

    lin = nn.Linear(256, 48).to(torch.bfloat16)
    m = Int4Linear.from_linear(lin, 64, backend="torch")
    assert torch.equal(m.sz, pack_scale_zero(m.scales, m.zeros))
    assert "sz" not in m.state_dict()
    m.set_scales(m.scales * 2, m.zeros)
    assert torch.equal(m.sz, pack_scale_zero(m.scales, m.zeros))
    with pytest.raises(ValueError, match=r"scales / zeros must be \[4, 48\]"):
        m.set_scales(m.scales[:2], m.zeros[:2])
    m.half()
    assert m.scales.dtype == torch.float16 and torch.equal(m.sz, pack_scale_zero(m.scales, m.zeros))
    m.float()
    assert m.scales.dtype == torch.float32 and m.sz is None
    assert Int4Linear.from_linear(nn.Linear(256, 48), 64).sz is None  # fp32 weights, fp32 scales
    parts = [Int4Linear.from_linear(nn.Linear(256, n).half(), 64, backend="triton") for n in (32, 16)]
    merged = _cat_int4(parts)
    assert torch.equal(merged.sz, pack_scale_zero(merged.scales, merged.zeros))
    x = torch.randn(5, 256).half()
    merged.config = W4A16Config(32, 128, 2, 4, 3, 16, per_group=True)
    sep = Int4Linear(256, 48, 64, backend="triton", dtype=torch.float16)
    sep.load_state_dict(merged.state_dict())  # scales copied in place: the words are repacked
    assert torch.equal(sep.sz, merged.sz)
    sep.sz = None
    sep.config = merged.config
    assert torch.equal(merged(x), sep(x))


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


def test_nf4_without_bitsandbytes_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    with pytest.raises(ImportError, match=r"bitsandbytes.*pip install 'fastgemma\[nf4\]'"):
        Nf4Quant()


def _nf4_reference(w):
    """NF4 by hand (the 16 levels, absmax per 64 along the flattened weight, nearest level): what
    bitsandbytes' codes must decode to, up to ties."""
    import bitsandbytes.functional as bnbf

    code = bnbf.get_4bit_type("nf4", device="cpu")  # [16], -1 .. 1
    blocks = w.float().reshape(-1, 64)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    return absmax, code, blocks / absmax


def test_nf4_on_cpu_is_bitsandbytes_nf4_blocks_of_64():
    bnb = pytest.importorskip("bitsandbytes", reason="quant=nf4 needs bitsandbytes (in the test extra)")
    import bitsandbytes.functional as bnbf

    ref_model, ids = _model(), _ids(12)
    model = copy.deepcopy(ref_model)
    q = Nf4Quant()
    assert q.apply(model) is model and not q.needs_cuda
    lins = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(lins) == 2 * 8 and not any("per_layer_input_gate" in n for n in lins)
    assert type(model.layers[0].per_layer_input_gate) is nn.Linear
    assert model.embed_tokens.weight.dtype == torch.float32  # the tied head is left alone
    dense = dict(ref_model.named_modules())
    worst = 0.0
    for name, lin in lins.items():
        st = lin.weight.quant_state
        assert lin.weight.dtype == torch.uint8 and lin.weight.numel() == lin.in_features * lin.out_features // 2
        assert st.quant_type == "nf4" and st.blocksize == 64 and st.dtype == torch.float32 and not st.nested
        w = dense[name].weight.detach()
        dq = bnbf.dequantize_4bit(lin.weight.data, st)
        absmax, code, scaled = _nf4_reference(w)
        torch.testing.assert_close(st.absmax, absmax.flatten(), rtol=0, atol=0)
        # every decoded value is an NF4 level times its block's absmax, and the nearest one
        got = dq.reshape(-1, 64) / absmax
        dist = (scaled.reshape(-1, 1) - code.reshape(1, -1)).abs()
        lvl = (got.reshape(-1, 1) - code.reshape(1, -1)).abs().argmin(dim=1)
        assert torch.allclose(code[lvl], got.reshape(-1), atol=1e-6), name
        assert (dist.gather(1, lvl[:, None]).squeeze(1) <= dist.min(dim=1).values + 1e-6).all(), name
        worst = max(worst, _rel(dq, w))
        # the CPU forward is dequantize_4bit + an fp32 matmul
        x = torch.randn(3, lin.in_features)
        with torch.no_grad():
            torch.testing.assert_close(lin(x), x @ dq.T + (0 if lin.bias is None else lin.bias), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        rel = _rel(model(ids), ref_model(ids))
    print(f"\nnf4 (bitsandbytes {bnb.__version__}, CPU): worst layer weight error {worst:.4f}, "
          f"relative logit error vs fp32 {rel:.4f}")
    assert worst < 0.15 and rel < 0.1
    d = q.describe()
    assert d["quant"] == "nf4" and d["quantized_layers"] == 16 and len(d["skipped"]) == 2
    assert d["quantized_params"] == 2 * (H * H * 2 + H * 64 * 2 + 3 * H * I + P * H)
    assert d["weight_bytes"] == d["quantized_params"] * (0.5 + 4 / 64)  # nibbles + fp32 absmax per 64


def test_nf4_on_cpu_bf16_and_double_quantization():
    bnb = pytest.importorskip("bitsandbytes", reason="quant=nf4 needs bitsandbytes (in the test extra)")
    ref_model, ids = _model(), _ids(12)
    dq_model = Nf4Quant(compress_statistics=True).apply(copy.deepcopy(ref_model))
    bf_model = Nf4Quant().apply(copy.deepcopy(ref_model).to(torch.bfloat16))
    assert all(m.weight.quant_state.nested for m in dq_model.modules() if isinstance(m, bnb.nn.Linear4bit))
    with torch.no_grad():
        ref, out, bf = ref_model(ids), dq_model(ids), bf_model(ids)
    print(f"\nnf4 double-quantized absmax: rel logit error {_rel(out, ref):.5f}; bf16: {_rel(bf.float(), ref):.5f}")
    assert _rel(out, ref) < 0.1 and bf.dtype == torch.bfloat16 and _rel(bf.float(), ref) < 0.1


def test_nf4_on_cpu_with_an_old_bitsandbytes_says_which_version(monkeypatch):
    bnb = pytest.importorskip("bitsandbytes", reason="quant=nf4 needs bitsandbytes (in the test extra)")
    monkeypatch.setattr(bnb, "__version__", "0.45.5")
    model = _model()
    with pytest.raises(ValueError, match=r"CPU with bitsandbytes >= 0\.46 \(installed: 0\.45\.5\)"):
        Nf4Quant().apply(model)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
