"""The MTP drafter against transformers' Gemma4AssistantForCausalLM on the same tiny random weights,
fp32: a transformers target provides the shared K/V and hidden state (as its assisted generation
does), ours reads them from our static cache; logits, projected states and drafted tokens must agree.
Plus the checkpoint loader's refusals and the exact E4B drafter shapes.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY, randomize_
from fastgemma.engine.cache import KVCache
from fastgemma.engine.generator import Generator
from fastgemma.kernels.decode_attention import decode_attention_ref
from fastgemma.model.config import GEMMA4_E4B, SLIDING
from fastgemma.model.drafter import (
    Drafter, DrafterError, drafter_config_for, load_drafter, synthetic_drafter, to_hf_assistant_config,
)
from fastgemma.weights.hf import load_hf

PROMPT, DRAFTS = 40, 5  # prompt longer than the window (16): the sliding keys come from a wrapped ring


def make_hf_drafter(target_cfg=TINY, seed=5, **overrides):
    from transformers import Gemma4AssistantForCausalLM

    cfg = drafter_config_for(target_cfg, **overrides)
    torch.manual_seed(seed)
    hf = Gemma4AssistantForCausalLM(to_hf_assistant_config(cfg, attn_implementation="eager")).float().eval()
    randomize_(hf, seed)
    if cfg.ordered_embeddings:
        order = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))
        hf.masked_embedding.token_ordering.copy_(order)
    return cfg, hf


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter")
    cfg, hf = make_hf_drafter()
    hf.save_pretrained(d)
    return d, cfg, hf


@pytest.fixture(scope="module")
def target(hf_tiny_dir):
    d, hf = hf_tiny_dir
    ours, _ = load_hf(d, dtype=torch.float32)
    ours.step_attention = decode_attention_ref
    return hf, ours


@torch.no_grad()
def hf_drafts(hf_target, hf_drafter, ids, window, steps):
    """transformers' assisted-generation draft loop (Gemma4AssistantCandidateGenerator.get_candidates)
    after a prefill: fixed position = the new token's, K/V of every earlier position; the sliding
    layers get the last `window` keys (the target's own window at the previous position)."""
    native = hf_target.config.sliding_window
    hf_target.config.sliding_window = window  # the window override applies to the target too
    try:
        out = hf_target(ids, output_hidden_states=True, return_shared_kv_states=True)
    finally:
        hf_target.config.sliding_window = native
    T = ids.shape[1]
    kv = {k: (v[0][:, :, :T], v[1][:, :, :T]) for k, v in out.shared_kv_states.items()}
    kv[SLIDING] = tuple(x[:, :, max(0, T - window):] for x in kv[SLIDING])
    tok = out.logits[:, -1:].argmax(-1)
    h = out.hidden_states[-1][:, -1:]
    res = []
    for _ in range(steps):
        x = torch.cat([hf_target.model.embed_tokens(tok), h], -1)
        o = hf_drafter(inputs_embeds=x, position_ids=torch.tensor([[T]]), shared_kv_states=kv, use_cache=False)
        tok, h = o.logits.argmax(-1), o.last_hidden_state
        res.append((o.logits[0, 0], h[0, 0], int(tok)))
    return res


@torch.no_grad()
def our_drafts(target, drafter, ids, window, steps):
    cache = KVCache(TINY, 1, 96, window=window, dtype=torch.float32)
    h = Generator(target, cache, prefill_chunk=16).prefill(ids)
    tok = target.compute_logits(h).argmax(-1)
    T = ids.shape[1]
    pos = torch.tensor([[T]])
    rope = drafter.rope(pos, h.dtype)
    res = []
    for _ in range(steps):
        x = torch.cat([drafter.embed_input(tok, target.embed_tokens.weight), h], -1)
        g, h = drafter(x, rope, pos - 1, cache, decode_attention_ref)
        logits = drafter.logits(g)
        fast = drafter.next_token(g)
        tok = logits.argmax(-1)
        assert torch.equal(fast, tok), "centroid top-k argmax differs from the scattered logits' argmax"
        res.append((logits[0, 0], h[0, 0], int(tok)))
    return res


@pytest.mark.parametrize("window", [16, 11], ids=["native", "w11"])
def test_drafter_matches_transformers(target, drafter_dir, window):
    hf_t, ours_t = target
    d, cfg, hf_d = drafter_dir
    drafter = load_drafter(d, TINY, dtype=torch.float32)
    ids = torch.randint(5, TINY.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    ref = hf_drafts(hf_t, hf_d, ids, window, DRAFTS)
    got = our_drafts(ours_t, drafter, ids, window, DRAFTS)
    for j, ((rl, rh, rt), (gl, gh, gt)) in enumerate(zip(ref, got)):
        el, eh = (rl - gl).abs().max().item(), (rh - gh).abs().max().item()
        print(f"window {window} draft {j}: logits max abs diff {el:.2e}, projected state {eh:.2e}, tokens {rt} {gt}")
        assert el < 1e-4 and eh < 1e-4
        assert rt == gt


def test_centroid_top_k_is_configurable(drafter_dir):
    d, cfg, _ = drafter_dir
    drafter = load_drafter(d, TINY, dtype=torch.float32)
    g = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    drafter.set_top_k(cfg.num_centroids)  # every centroid: the whole vocabulary is scored
    full = g @ drafter.model.embed_tokens.weight.T
    assert torch.equal(drafter.next_token(g), full.argmax(-1))
    drafter.set_top_k(1)
    assert drafter.candidates(g).shape == (64, cfg.tokens_per_centroid)
    assert (drafter.logits(g) > -1e30).all()
    for bad in (0, cfg.num_centroids + 1, 2.5):
        with pytest.raises(DrafterError, match="centroid_top_k"):
            drafter.set_top_k(bad)
    drafter.set_top_k(None)
    assert drafter.top_k == cfg.centroid_top_k


def _write_variant(src, dst, **changes):
    """A copy of a checkpoint dir with config.json keys changed (text_config keys as 'text_config.x')."""
    import shutil

    shutil.copytree(src, dst)
    c = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if k.startswith("text_config."):
            c["text_config"][k.split(".", 1)[1]] = v
        else:
            c[k] = v
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def test_checkpoint_backbone_mismatch_is_refused(drafter_dir, tmp_path):
    d, cfg, _ = drafter_dir
    e2b_like = _write_variant(d, tmp_path / "e2b_drafter", backbone_hidden_size=48)
    with pytest.raises(DrafterError, match=r"backbone of hidden size 48.*target gemma4_tiny has hidden size 64"):
        load_drafter(e2b_like, TINY, dtype=torch.float32)
    # the E4B drafter shape against the tiny target, without any file
    with pytest.raises(DrafterError, match="backbone of hidden size 2560"):
        Drafter(drafter_config_for(GEMMA4_E4B), TINY)


def test_checkpoint_errors_are_clear(drafter_dir, tmp_path):
    d, cfg, _ = drafter_dir
    with pytest.raises(DrafterError, match="no such directory"):
        load_drafter(tmp_path / "nope", TINY)
    wrong = _write_variant(d, tmp_path / "not_drafter", model_type="gemma4_text")
    with pytest.raises(DrafterError, match="not a Gemma 4 drafter"):
        load_drafter(wrong, TINY)
    dims = _write_variant(d, tmp_path / "dims", **{"text_config.head_dim": 16})
    with pytest.raises(DrafterError, match="head_dim 16"):
        load_drafter(dims, TINY)
    # a checkpoint missing a tensor: every key is checked before anything is copied
    from safetensors.torch import load_file, save_file

    short = _write_variant(d, tmp_path / "short")
    f = next(short.glob("*.safetensors"))
    sd = load_file(f)
    del sd["model.layers.3.self_attn.q_proj.weight"]
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(DrafterError, match=r"missing keys \(1\): model.layers.3.self_attn.q_proj.weight"):
        load_drafter(short, TINY)


def test_e4b_drafter_has_the_published_shapes():
    """google/gemma-4-E4B-it-assistant: 78.5M parameters, hidden 256, 4 layers, 2048 centroids,
    reading target layers 22 (sliding) and 23 (full). Built on the meta device: no memory."""
    cfg = drafter_config_for(GEMMA4_E4B)
    with torch.device("meta"):
        d = Drafter(cfg, GEMMA4_E4B)
    n = sum(p.numel() for p in d.parameters())
    assert round(n / 1e6, 1) == 78.5, n
    assert d.sources == {"sliding_attention": 22, "full_attention": 23}
    assert [layer.spec.kv_source for layer in d.model.layers] == [22, 22, 22, 23]
    shapes = {k: tuple(v.shape) for k, v in d.state_dict().items()}
    assert shapes["pre_projection.weight"] == (256, 5120)
    assert shapes["post_projection.weight"] == (2560, 256)
    assert shapes["masked_embedding.centroids.weight"] == (2048, 256)
    assert shapes["masked_embedding.token_ordering"] == (262144,)
    assert shapes["model.layers.3.self_attn.q_proj.weight"] == (4 * 512, 256)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4 * 256, 256)
    assert cfg.candidates == 4096
    # the keys are transformers' own: an E4B-shaped transformers assistant has the same state dict
    from transformers import Gemma4AssistantForCausalLM

    with torch.device("meta"):
        hf = Gemma4AssistantForCausalLM(to_hf_assistant_config(cfg))
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert hf_shapes == shapes


def test_synthetic_drafter_is_seeded():
    a = synthetic_drafter(TINY, dtype=torch.float32, seed=1)
    b = synthetic_drafter(TINY, dtype=torch.float32, seed=1)
    c = synthetic_drafter(TINY, dtype=torch.float32, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.pre_projection.weight, c.pre_projection.weight)
    order = a.masked_embedding.token_ordering
    assert torch.equal(order.sort().values, torch.arange(TINY.vocab_size))


@pytest.mark.parametrize("task", ["bench", "identity"])
def test_cli_runs_a_checkpoint_with_its_drafter_checkpoint(task, hf_tiny_dir, drafter_dir, tmp_path):
    """weights=hf + spec=mtp spec.drafter=DIR through the tasks, as a user serves a local copy of both: the bench
    record carries the acceptance metrics, identity is exact (fp32)."""
    from fgcli_helpers import run_job

    rec = run_job([f"task={task}", "weights=hf", f"weights.path={hf_tiny_dir[0]}", "workload=smoke", "device=cpu",
                   "logger=jsonl", "progress=false", "spec=mtp", "spec.depth=3", f"spec.drafter={drafter_dir[0]}"],
                  tmp_path)
    assert rec["status"] == "ok", rec["error"]
    m = rec["metrics"]
    if task == "bench":
        assert m["output_tokens"] == 3 * 16 and len(m["accept_by_pos"]) == 3 and 1 <= m["tokens_per_step"] <= 4
    else:
        assert m["identity_rate"] == 1.0
    assert rec["details"]["parts"]["spec"]["drafter"] == str(drafter_dir[0])
