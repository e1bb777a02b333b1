"""compressed-tensors pack-quantized int4 checkpoints: the format against the package's own
compressor, exact dequantization, logits against a dense model on the dequantized weights, the
ignore list, refused configs, merged projections and the quant group on such a checkpoint."""
from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY
from fastgemma.engine.cache import KVCache
from fastgemma.kernels.int4_pack import dequantize_int4
from fastgemma.transforms.fuse import MergeProjections
from fastgemma.transforms.quant import Int4Linear, Int4Quant, NoQuant
from fastgemma.weights.compressed import PackQuantized, parse_scheme, to_int4
from fastgemma.weights.hf import CheckpointError, load_hf

PROJ = re.compile(r"^model\.(layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)|per_layer_model_projection)\.weight$")
# K of per_layer_projection is ple_dim = 16 < any group; the PLE gate is left dense as quant=int4 does
IGNORE = ["re:.*per_layer_input_gate$", "re:.*per_layer_projection$", "model.layers.1.mlp.down_proj"]


# ---- the format, as its spec reads (checked against the package below) --------------------------
def _words(u: torch.Tensor) -> torch.Tensor:
    """[R, 8C] nibbles 0..15 -> int32 [R, C]: nibble i of a word in bits 4i..4i+3."""
    w = sum(u[:, i::8].long() << (4 * i) for i in range(8))
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def pack_ct(q: torch.Tensor) -> torch.Tensor:
    """Signed codes q [N, K] in -8..7 -> weight_packed int32 [N, K/8] (stored = q + 8)."""
    return _words(q.long() + 8)


def pack_zp_ct(zp: torch.Tensor) -> torch.Tensor:
    """Signed zero points [N, K/G] -> weight_zero_point int32 [ceil(N/8), K/G], packed along N."""
    u = zp.long().t() + 8
    u = torch.nn.functional.pad(u, (0, -u.shape[1] % 8))
    return _words(u).t().contiguous()


def quantize_ct(w: torch.Tensor, G: int, symmetric: bool, dtype=torch.bfloat16):
    """RTN as compressed-tensors does it -> (codes int8 [N, K], scale [N, K/G], zp int8 [N, K/G] | None)."""
    N, K = w.shape
    g = w.float().reshape(N, K // G, G)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    if symmetric:
        scale = (torch.maximum(-lo, hi) / 7.5).to(dtype)
        zp = torch.zeros_like(scale, dtype=torch.int8)
    else:
        scale = ((hi - lo) / 15).to(dtype)
        zp = torch.round(-8 - lo / scale.float()).clamp(-8, 7).to(torch.int8)
    q = torch.round(g / scale.float()[..., None] + zp[..., None]).clamp(-8, 7).to(torch.int8)
    return q.reshape(N, K), scale, None if symmetric else zp


def dequant_ref(q, scale, zp, G):
    """w = (q - zp) * scale in fp32 [N, K]."""
    z = 0 if zp is None else zp.float().repeat_interleave(G, 1)
    return (q.float() - z) * scale.float().repeat_interleave(G, 1)


def qconfig(G=32, symmetric=True, ignore=IGNORE, **weights):
    """quantization_config as compressed-tensors' QuantizationConfig.model_dump() writes it."""
    w = {"num_bits": 4, "type": "int", "symmetric": symmetric, "group_size": G, "strategy": "group",
         "dynamic": False, "actorder": None, **weights}
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": None,
                                          "output_activations": None, "format": None}},
            "quant_method": "compressed-tensors", "kv_cache_scheme": None, "format": "pack-quantized",
            "quantization_status": "compressed", "global_compression_ratio": None, "ignore": list(ignore)}


def write_ckpt(src, dst, G=32, symmetric=True, ignore=IGNORE, qcfg=None):
    """The tiny checkpoint with every targeted projection packed; -> (dir, {key: fp32 reference W})."""
    scheme = PackQuantized(G, symmetric, tuple(ignore))
    tensors, ref, dense = {}, {}, {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out = {}
    for key, t in tensors.items():
        base = key.removesuffix(".weight")
        if PROJ.match(key) and not scheme.ignores(base):
            q, scale, zp = quantize_ct(t, G, symmetric)
            out.update({base + ".weight_packed": pack_ct(q), base + ".weight_scale": scale,
                        base + ".weight_shape": torch.tensor(t.shape)})
            if zp is not None:
                out[base + ".weight_zero_point"] = pack_zp_ct(zp)
            ref[key] = dequant_ref(q, scale, zp, G)
        else:
            out[key] = t
        dense[key] = ref.get(key, t)
    dst.mkdir(parents=True)
    # two shards, keys alternating: a layer's codes and scales sit in different files
    shards = {f"model-0000{i + 1}-of-00002.safetensors": dict(sorted(out.items())[i::2]) for i in range(2)}
    for name, part in shards.items():
        save_file(part, str(dst / name))
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg or qconfig(G, symmetric, ignore)}))
    (dst.parent / f"{dst.name}_dense").mkdir()
    save_file(dense, str(dst.parent / f"{dst.name}_dense" / "model.safetensors"))
    (dst.parent / f"{dst.name}_dense" / "config.json").write_text(json.dumps(cfg))
    return dst, ref


def _edit(d, key, value=None):
    """Replace (or, with None, delete) one tensor of a sharded checkpoint."""
    index = json.loads((d / "model.safetensors.index.json").read_text())
    f = d / index["weight_map"][key]
    t = load_file(str(f))
    if value is None:
        del t[key], index["weight_map"][key]
    else:
        t[key] = value
    save_file(t, str(f))
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _logits(model, ids):
    cache = KVCache(model.config, 1, 128, dtype=torch.float32)
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(ids.shape[1])[None], cache, start=0))[0]


IDS = torch.randint(0, TINY.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module", params=[(32, True), (64, False)], ids=["g32-sym", "g64-asym"])
def ckpt(request, hf_tiny_dir, tmp_path_factory):
    G, sym = request.param
    d, ref = write_ckpt(hf_tiny_dir[0], tmp_path_factory.mktemp("ct") / "ckpt", G, sym)
    model, report = load_hf(d, dtype=torch.float32)
    return d, ref, model, report, G, sym


# ---- the format against the real implementation --------------------------------------------------
@pytest.mark.parametrize("symmetric", [True, False])
def test_packing_matches_compressed_tensors(symmetric):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    G, N, K = 32, 44, 96  # N % 8 != 0: the packed zero point's last word is partial
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1))
    q, scale, zp = quantize_ct(w, G, symmetric)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=G))
    state = {"weight": w, "weight_scale": scale.float()}
    if not symmetric:
        state["weight_zero_point"] = zp
    comp = PackedQuantizationCompressor.compress(state, scheme)
    assert torch.equal(comp["weight_packed"], pack_ct(q)), "codes or nibble order differ from compressed-tensors"
    assert comp["weight_shape"].tolist() == [N, K]
    assert ("weight_zero_point" in comp) == (not symmetric)
    if not symmetric:
        assert torch.equal(comp["weight_zero_point"], pack_zp_ct(zp))
    # the package's own dequantization (fp32 scale: no rounding on its side) equals ours exactly
    want = PackedQuantizationCompressor.decompress({**comp, "weight_scale": scale.float()}, scheme)["weight"]
    ours = dequantize_int4(*to_int4(comp["weight_packed"], scale, comp.get("weight_zero_point")), G)
    assert torch.equal(ours, want) and torch.equal(ours, dequant_ref(q, scale, zp, G))
    # and its config serialization is what we read
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=IGNORE,
                            quantization_status="compressed")
    assert parse_scheme(json.loads(json.dumps(qc.model_dump(mode="json")))) == PackQuantized(G, symmetric, tuple(IGNORE))
    print(f"compressed-tensors {ct.__version__}: packing and dequantization identical")


def test_symmetric_zeros_are_exact_in_bf16():
    s = (torch.rand(1000, 4) * 2.0 ** torch.randint(-30, 10, (1000, 4))).bfloat16()
    q = torch.randint(-8, 8, (1000, 128), dtype=torch.int8)
    _, scales, zeros = to_int4(pack_ct(q), s)
    assert scales.dtype == zeros.dtype == torch.bfloat16 and torch.equal(zeros.float(), -8 * scales.float())


# ---- loading ---------------------------------------------------------------------------------
def test_layers_int4_and_dequantized_exactly(ckpt):
    d, ref, model, report, G, sym = ckpt
    int4 = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(int4) == len(ref) and report.quantization["int4_layers"] == len(ref)
    for name, mod in int4.items():
        assert mod.backend == "torch" and mod.group_size == G  # CPU: the torch twin
        w = dequantize_int4(mod.qweight, mod.scales, mod.zeros, G)
        assert torch.equal(w, ref[f"model.{name}.weight"]), name
    print(report.summary())
    assert report.shards == 2 and f"{len(ref)} linears int4 as stored" in report.summary()


def test_ignore_list_is_honoured(ckpt, hf_tiny_dir):
    _, _, model, _, _, _ = ckpt
    src = hf_tiny_dir[1].state_dict()
    dense = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert "layers.1.mlp.down_proj" in dense and "layers.0.mlp.down_proj" not in dense
    assert all("per_layer_input_gate" in n or "per_layer_projection" in n or n == "layers.1.mlp.down_proj" for n in dense)
    for name, mod in dense.items():
        assert torch.equal(mod.weight, src[f"model.{name}.weight"]), name


def test_logits_equal_dense_model_on_dequantized_weights(ckpt):
    d, _, model, _, _, _ = ckpt
    dense, _ = load_hf(d.parent / f"{d.name}_dense", dtype=torch.float32)
    err = (_logits(model, IDS) - _logits(dense, IDS)).abs().max().item()
    print(f"int4 checkpoint vs dense on the dequantized weights: max abs logit diff {err:.2e}")
    assert err < 1e-5


def test_merged_projections_on_int4(ckpt):
    _, _, model, _, _, _ = ckpt
    merged = MergeProjections().apply(copy.deepcopy(model))
    assert isinstance(merged.layers[0].self_attn.qkv_proj, Int4Linear)
    assert isinstance(merged.layers[0].mlp.gate_up_proj, Int4Linear)
    err = (_logits(merged, IDS) - _logits(model, IDS)).abs().max().item()
    print(f"merged int4 projections: max abs logit diff {err:.2e}")
    assert err < 1e-5


def test_merge_refuses_int4_beside_dense(hf_tiny_dir, tmp_path):
    d, _ = write_ckpt(hf_tiny_dir[0], tmp_path / "ckpt", ignore=IGNORE + ["model.layers.0.self_attn.k_proj"])
    model, _ = load_hf(d, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.k_proj: Linear.*fuse=none"):
        MergeProjections().apply(model)
    assert hasattr(model.layers[0].self_attn, "q_proj") and hasattr(model.layers[0].mlp, "gate_proj")  # untouched


def test_quant_group_keeps_checkpoint_int4(ckpt):
    _, ref, model, _, _, _ = ckpt
    info = NoQuant()
    info.apply(model)
    assert info.describe()["quant"] == "int4 (checkpoint)"
    assert info.describe()["checkpoint_int4_layers"] == len(ref)
    m = copy.deepcopy(model)
    before = {n: (mod, mod.qweight.clone()) for n, mod in m.named_modules() if isinstance(mod, Int4Linear)}
    q = Int4Quant(group_size=32, skip=["per_layer_input_gate", "per_layer_projection"], backend="torch")
    m = q.apply(m)
    for n, (mod, qw) in before.items():  # the same modules, codes untouched: not re-quantized
        assert m.get_submodule(n) is mod and torch.equal(mod.qweight, qw)
    assert isinstance(m.get_submodule("layers.1.mlp.down_proj"), Int4Linear)  # the one dense target left
    assert q.describe()["quantized_layers"] == 1 and q.describe()["checkpoint_int4_layers"] == len(ref)


def test_run_through_the_cli(ckpt, tmp_path):
    """weights=hf on a compressed checkpoint, fuse=merged: the record says int4 and ppl equals the
    dense model's on the dequantized weights."""
    from fgcli_helpers import run_job

    d = ckpt[0]
    rows = [{"context_ids": [2] + list(range(10, 30)), "target_ids": list(range(40, 70))}]
    (tmp_path / "ppl.jsonl").write_text(json.dumps(rows[0]) + "\n")
    job = ["device=cpu", "dtype=fp32", "threads=1", "logger=jsonl", "progress=false", "task=ppl",
           f"eval.jsonl={tmp_path / 'ppl.jsonl'}", "fuse=merged"]
    rec = run_job(["weights=hf", f"weights.path={d}", *job], tmp_path, "int4")
    ref = run_job(["weights=hf", f"weights.path={d.parent / (d.name + '_dense')}", *job], tmp_path, "dense")
    assert rec["status"] == "ok", rec["error"]
    assert rec["details"]["parts"]["quant"]["quant"] == "int4 (checkpoint)"
    assert "linears int4 as stored" in rec["details"]["load"]["report"]
    assert rec["details"]["load"]["quantization"]["int4_layers"] == len(ckpt[1])
    got, want = rec["metrics"]["ppl"], ref["metrics"]["ppl"]
    assert math.isclose(got, want, rel_tol=1e-5), (got, want)


# ---- refused ---------------------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), r"num_bits is 8"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=96), r"group_size is 96"),
    (lambda q: q.update(format="float-quantized"), r"format \(group_0\) is 'float-quantized'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="channel"), r"strategy is 'channel'"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), r"input_activations"),
    (lambda q: q.update(quant_method="awq"), r"quant_method is 'awq'"),
])
def test_unsupported_configs_refused(hf_tiny_dir, tmp_path, change, message):
    q = qconfig()
    change(q)
    d, _ = write_ckpt(hf_tiny_dir[0], tmp_path / "ckpt", qcfg=q)
    with pytest.raises(CheckpointError, match=message) as err:
        load_hf(d, dtype=torch.float32)
    assert "supported: compressed-tensors 'pack-quantized' int4" in str(err.value) and "\n" not in str(err.value)


def test_missing_scale_named(hf_tiny_dir, tmp_path):
    d, _ = write_ckpt(hf_tiny_dir[0], tmp_path / "ckpt")
    _edit(d, "model.layers.2.mlp.up_proj.weight_scale")
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): model\.layers\.2\.mlp\.up_proj\.weight_scale"):
        load_hf(d, dtype=torch.float32)


def test_packed_layer_in_ignore_list_refused(hf_tiny_dir, tmp_path):
    q = qconfig(ignore=IGNORE + ["model.layers.3.self_attn.o_proj"])
    d, _ = write_ckpt(hf_tiny_dir[0], tmp_path / "ckpt", qcfg=q)
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.self_attn\.o_proj is packed but quantization_config\.ignore lists it"):
        load_hf(d, dtype=torch.float32)


def test_wrong_weight_shape_refused(hf_tiny_dir, tmp_path):
    d, _ = write_ckpt(hf_tiny_dir[0], tmp_path / "ckpt")
    _edit(d, "model.layers.0.self_attn.q_proj.weight_shape", torch.tensor([128, 32]))
    with pytest.raises(CheckpointError, match=r"q_proj\.weight_shape is \[128, 32\], the model's layer is \[128, 64\]"):
        load_hf(d, dtype=torch.float32)


def test_wrong_dtype_refused(hf_tiny_dir, tmp_path):
    d, _ = write_ckpt(hf_tiny_dir[0], tmp_path / "ckpt")
    _edit(d, "model.layers.0.mlp.gate_proj.weight_scale", torch.ones(128, 2, dtype=torch.int32))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight_scale: dtype I32, expected BF16/F16/F32"):
        load_hf(d, dtype=torch.float32)
